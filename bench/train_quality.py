"""Quality per minute of training: train.py runs side by side, as a user runs them, in one go.

    python bench/train_quality.py                          # the cpu preset against the AdamW-only recipe
    python bench/train_quality.py --seeds 1337 1 2         # the preset over three seeds
    python bench/train_quality.py --candidate wide "model.n_embd=192"   # any train.py overrides
    python bench/train_quality.py --candidate preset --load-from 170     # one core taken from 170 s on
    python bench/train_quality.py --candidate "cpu preset" --load-from none 60 170 --plot docs/images/five_minutes.png

Each candidate is the real command (`python train.py preset=cpu <overrides>`) in a subprocess, timed by the
wall clock from its start, start-up and data preparation included. The val curve is read back from the run's
TensorBoard events: the table gives the shape and threads it trained with (chosen by the cpu preset's sizing
or named), the best and final val loss, the final train loss, the wall time, and the seconds until val loss
first reached --target (an evaluation at or below it; every run evaluates every --eval-interval steps, so
that the crossing is seen the same way in each). --log keeps each run's output, whose first lines say why
it trained what it did. --load-from runs each candidate once per value: on an idle machine (none), or with one
core busy from that second on. --plot draws every run's val loss against its wall-clock seconds, with a mark where
the run fixed its length and where it planned its steps again (its optim/planned_steps events).
"""

import argparse
import contextlib
import datetime
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import plots  # noqa: E402
from bench.configs import (REPO, check_training, host, positive_float, run_tool, thread_count,  # noqa: E402
                           training_failed, training_seed)
from bench.curve import read_curve, read_plans  # noqa: E402
from runtime.errors import OneLineErrorParser, UsageError, positive_int  # noqa: E402

# The cpu preset as it was before Muon, as overrides of it: AdamW on every parameter, 900 steps, a floor under
# the decay over all of them (README: val 1.699 in 3 min 40 s).
ADAMW_RECIPE = ["optim=adamw", "optim.min_lr=1e-3", "train.max_iters=900", "optim.decay_frac=1"]
CANDIDATES = {"cpu preset": [], "AdamW recipe": ADAMW_RECIPE}


@contextlib.contextmanager
def busy_core_from(seconds: float | None):
    """While inside: from `seconds` on, another program takes one core, in a busy loop (None: nothing)."""
    if seconds is None:
        yield
        return
    busy = []
    timer = threading.Timer(seconds, lambda: busy.append(subprocess.Popen([sys.executable, "-c", "while True: pass"])))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        for process in busy:
            process.kill()
            process.wait()


def run(name: str, overrides: list[str], seed: int, eval_interval: int | None, workdir: Path,
        threads: int | None, log: Path | None = None, load_from: float | None = None) -> dict:
    plain_name = re.sub(r"[^\w.-]+", "_", name) + f"-{seed}"  # a name Hydra reads as one value in hydra.run.dir
    plain_name += "" if load_from is None else f"-busy{load_from:g}"
    run_dir = workdir / plain_name
    command = [sys.executable, str(REPO / "train.py"), "preset=cpu", *overrides, f"train.seed={seed}",
               f"hydra.run.dir={run_dir}", *([f"train.eval_interval={eval_interval}"] if eval_interval else [])]
    start = time.time()
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}  # torch's threads
    with busy_core_from(load_from):
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    seconds = time.time() - start
    if log is not None:
        log.mkdir(parents=True, exist_ok=True)
        (log / f"{plain_name}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise training_failed(name, result)
    curve = read_curve(run_dir)
    recorded = torch.load(run_dir / "last.pt", weights_only=True)["training"]["config"]
    trained = f"{recorded['model']['n_layer']}L, batch {recorded['train']['batch_size']}, " \
              f"{recorded['train'].get('threads')} thr"  # the shape and threads it trained with (sized or named)
    return {"name": name, "seed": seed, "seconds": seconds, "curve": curve, "start": start, "trained": trained,
            "load": load_from, "plans": read_plans(run_dir)}


def load_time(text: str) -> float | None:
    """An argparse type: none (an idle machine), or the seconds after which one core gets busy."""
    if text == "none":
        return None
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be none or a number of seconds above 0, got {text!r}") from None


def machine(load: float | None) -> str:
    return "idle" if load is None else f"one core busy from {load:g} s"


def picture_run(outcome: dict, seeds: int) -> dict:
    """What plots.training draws of a run: its label, its val curve and its plans, in seconds since its start."""
    def since(seconds):
        return seconds - outcome["start"]
    return {"label": f"{outcome['name']}, {machine(outcome['load'])}" + (f", seed {outcome['seed']}" if seeds > 1
                                                                            else ""),
            "seconds": [since(r["wall_time"]) for r in outcome["curve"]], "val": [r["val"] for r in outcome["curve"]],
            "plans": [(since(p["wall_time"]), p["steps"]) for p in outcome["plans"]], "load": outcome["load"]}


def seconds_to(target: float, outcome: dict) -> float | None:
    return next((row["wall_time"] - outcome["start"] for row in outcome["curve"] if row["val"] <= target), None)


def print_curves(outcomes: list[dict]) -> None:
    """Val loss against wall-clock seconds since each run's start, one column per run."""
    print("\n| step | " + " | ".join(f"{o['name']}: s | val" for o in outcomes) + " |")
    print("|---|" + "---|---|" * len(outcomes))
    rows = {o["name"]: {r["step"]: r for r in o["curve"]} for o in outcomes}
    for step in sorted({r["step"] for o in outcomes for r in o["curve"]}):
        cells = [f"{r['wall_time'] - o['start']:.0f} | {r['val']:.4f}" if (r := rows[o["name"]].get(step)) else "- | -"
                 for o in outcomes]
        print(f"| {step} | " + " | ".join(cells) + " |")
    print()


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidate", nargs="+", action="append", metavar=("NAME", "OVERRIDE"),
                        help="a name and train.py overrides (repeatable); default: the cpu preset and the AdamW recipe")
    parser.add_argument("--seeds", type=training_seed, nargs="+", default=[1337])
    parser.add_argument("--target", type=positive_float, default=1.70)
    parser.add_argument("--eval-interval", type=positive_int, help="override every candidate's train.eval_interval")
    parser.add_argument("--curves", action="store_true", help="also print each run's val loss against seconds")
    parser.add_argument("--log", type=Path, help="keep each run's output in this folder, as NAME-SEED.log "
                                                 "(NAME-SEED-busyS.log with one core busy from S s)")
    parser.add_argument("--threads", type=thread_count, help="torch's threads in each run (OMP_NUM_THREADS); 1 "
                                                             "stands in for a machine half as fast as a 2-core one")
    parser.add_argument("--load-from", type=load_time, nargs="+", default=[None], metavar="SECONDS",
                        help="from this many seconds into each run, a busy loop takes one core: a machine that "
                             "gets busy mid-run; several values (none: idle) run each candidate once per value")
    parser.add_argument("--plot", type=plots.plot_file, metavar="FILE.png", help="draw the picture into this file")
    args = parser.parse_args()
    candidates = {c[0]: c[1:] for c in args.candidate} if args.candidate else CANDIDATES
    if args.log is not None and args.log.exists() and not args.log.is_dir():
        raise UsageError(f"--log {args.log} is a file; give a folder")
    if args.candidate and len(candidates) < len(args.candidate):
        raise UsageError("two --candidate share a name; give each its own")
    if len(set(args.load_from)) < len(args.load_from):
        raise UsageError("--load-from names one value twice; give each once")
    interval = [f"train.eval_interval={args.eval_interval}"] if args.eval_interval else []
    for name, overrides in candidates.items():  # what train.py would refuse, refused before any run and any output
        check_training(f"--candidate {name}", *overrides, *interval)

    date = datetime.date.today().isoformat()
    print(f"# train.py quality: {host()}, {os.cpu_count()} cores, {args.threads or 'all'} thread(s) a run, "
          f"seeds {args.seeds}, time to val loss {args.target}, {date}")
    print("| candidate | machine | trained | seed | steps | planned again | wall s | best val | final val | "
          f"final train | s to val {args.target} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    every = []  # every run, for the picture
    with tempfile.TemporaryDirectory() as tmp:
        for seed, load in ((seed, load) for seed in args.seeds for load in args.load_from):
            outcomes = []
            for name, overrides in candidates.items():
                outcome = run(name, overrides, seed, args.eval_interval, Path(tmp), args.threads, args.log, load)
                outcomes.append(outcome)
                last = outcome["curve"][-1]
                reached = seconds_to(args.target, outcome)
                print(f"| {name} | {machine(load)} | {outcome['trained']} | {seed} | {last['step']} | "
                      f"{max(len(outcome['plans']) - 1, 0)} | {outcome['seconds']:.1f} | "
                      f"{min(r['val'] for r in outcome['curve']):.4f} | {last['val']:.4f} | {last['train']:.4f} | "
                      f"{'-' if reached is None else f'{reached:.0f}'} |", flush=True)
            every += outcomes
            if args.curves:
                print_curves(outcomes)
            times = [seconds_to(args.target, o) for o in outcomes]
            if len(outcomes) == 2 and None not in times:
                print(f"\nseed {seed}, {machine(load)}: {outcomes[0]['name']} reaches val {args.target} in "
                      f"{times[0] / times[1]:.2f}x the time of {outcomes[1]['name']}\n", flush=True)
    if args.plot:
        plots.training(args.plot, [picture_run(o, len(args.seeds)) for o in every],
                       "Five minutes of training: val loss by the clock, python train.py on a CPU",
                       f"python train.py preset=cpu, {os.cpu_count()} cores, {args.threads or 'all'} thread(s) a run: "
                       f"{host()}, {date}")
        print(f"picture: {args.plot}")


if __name__ == "__main__":
    run_tool(main)
