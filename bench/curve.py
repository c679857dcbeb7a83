"""A run's loss curve, read back from its TensorBoard events, as a Markdown table.

    python bench/curve.py runs/2026-11-22_05-13-23

One row per evaluation: step, seconds since the run's first logged event, the evaluated train and
val losses, and the learning rate at that step.
"""

import argparse
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory, e.g. runs/2026-11-22_05-13-23")
    args = parser.parse_args()

    events = EventAccumulator(args.run_dir, size_guidance={"scalars": 0})
    events.Reload()
    if "loss/val" not in events.Tags()["scalars"]:
        sys.exit(f"curve.py: error: no loss/val events in {args.run_dir}; give a run directory of train.py")
    start = min(e.wall_time for tag in ("loss/val", "loss/train") for e in events.Scalars(tag))
    train_loss = {e.step: e.value for e in events.Scalars("loss/train_eval")}
    lr = {e.step: e.value for e in events.Scalars("optim/lr")}
    print("| step | seconds | train loss | val loss | lr |")
    print("|---|---|---|---|---|")
    for e in events.Scalars("loss/val"):
        print(f"| {e.step} | {e.wall_time - start:.0f} | {train_loss[e.step]:.4f} | {e.value:.4f} | "
              f"{lr.get(e.step - 1, float('nan')):.2e} |")


if __name__ == "__main__":
    main()
