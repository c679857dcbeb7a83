"""Run directories: the newest run's checkpoint.

There is no `latest` link: inside runs/ TensorBoard would read it as a second copy of the run it points at."""

from pathlib import Path

from .checkpoint import CheckpointError


def find_latest_checkpoint(runs_dir="runs", name: str = "best.pt") -> Path:
    """The most recently written `name` anywhere under `runs_dir` (single runs and multirun jobs alike)."""
    runs_dir = Path(runs_dir)
    found = [p for p in runs_dir.rglob(name) if p.is_file() and not p.is_symlink()] if runs_dir.is_dir() else []
    if not found:
        raise CheckpointError(f"no {name} found under {runs_dir.resolve()}/; "
                              f"run `python train.py` first, or pass --checkpoint")
    return max(found, key=lambda p: p.stat().st_mtime_ns)

