"""A run's loss curve, read back from its TensorBoard events, as a Markdown table.

    python bench/curve.py runs/2026-11-22_12-00-00

One row per evaluation: step, seconds since the run's first logged event, the evaluated train and
val losses, and the learning rate at that step.
"""

import argparse
import math
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import run_tool  # noqa: E402
from training.summaries import LR, PLANNED_STEPS, TRAIN_EVAL_LOSS, VAL_LOSS  # noqa: E402
from runtime.errors import OneLineErrorParser, UsageError  # noqa: E402


def scalars(run_dir) -> EventAccumulator:
    """A run's scalar events, every one of them (TensorBoard keeps a sample by default)."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return events


def read_curve(run_dir) -> list[dict]:
    """One dict per evaluation: step, wall_time, train and val loss, lr (NaN where not logged)."""
    events = scalars(run_dir)
    if VAL_LOSS not in events.Tags()["scalars"]:
        raise ValueError(f"no {VAL_LOSS} events in {run_dir}; give a run directory of train.py")
    train_loss = {e.step: e.value for e in events.Scalars(TRAIN_EVAL_LOSS)}
    lr = {e.step: e.value for e in events.Scalars(LR)}
    return [{"step": e.step, "wall_time": e.wall_time, "train": train_loss[e.step], "val": e.value,
             "lr": lr.get(e.step - 1, float("nan"))} for e in events.Scalars(VAL_LOSS)]


def read_plans(run_dir) -> list[dict]:
    """A budget run's plans, in order (none for a run of fixed length): step, wall_time and the steps planned,
    first where the run fixed its length, then at each change of plan."""
    events = scalars(run_dir)
    if PLANNED_STEPS not in events.Tags()["scalars"]:
        return []
    return [{"step": e.step, "wall_time": e.wall_time, "steps": round(e.value)} for e in events.Scalars(PLANNED_STEPS)]


def run_directory(text: str) -> Path:
    """An argparse type: a folder that exists (the event reader would take any other path for an empty run)."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"no folder at {text}; give a run directory of train.py")
    return Path(text)


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=run_directory, help="a run directory of train.py")
    args = parser.parse_args()
    try:
        curve = read_curve(args.run_dir)
    except ValueError as e:
        raise UsageError(str(e)) from None
    start = curve[0]["wall_time"]
    print("| step | seconds | train loss | val loss | lr |")
    print("|---|---|---|---|---|")
    for row in curve:
        lr = "-" if math.isnan(row["lr"]) else f"{row['lr']:.2e}"  # no lr is logged before the first step
        print(f"| {row['step']} | {row['wall_time'] - start:.0f} | {row['train']:.4f} | {row['val']:.4f} | {lr} |")


if __name__ == "__main__":
    run_tool(main)
