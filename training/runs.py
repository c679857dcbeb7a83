"""Run directories: a new one for every run, and the newest run's checkpoint.

There is no `latest` link: inside runs/ TensorBoard would read it as a second copy of the run it points at."""

import os
import re
import time
from pathlib import Path

from .checkpoint import CheckpointError
from .config import ConfigError

_claimed: dict[str, str] = {}  # parent -> the run directory this process claimed in it


def claim_run_dir(parent) -> str:
    """parent/<date>_<time>, created here so that no other run can have it: runs that start in the same second
    (a sweep's, an array job's) get <date>_<time>-2, -3, ... The same parent gives the same directory for the
    rest of the process, however often the config that names it is resolved."""
    parent = str(parent)
    if parent not in _claimed:
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
        try:
            Path(parent).mkdir(parents=True, exist_ok=True)
            for n in range(1, 1_000_000):
                candidate = os.path.join(parent, stamp if n == 1 else f"{stamp}-{n}")
                try:
                    os.mkdir(candidate)
                except FileExistsError:
                    continue
                _claimed[parent] = candidate
                break
        except OSError as e:  # read-only, a file where the folder should be, ...
            raise ConfigError(f"runs_dir: cannot create a run directory in {parent} ({e.strerror or e}); "
                              f"give runs_dir a writable folder") from None
    return _claimed[parent]


def find_latest_checkpoint(runs_dir="runs", name: str = "best.pt") -> Path:
    """The most recently written `name` anywhere under `runs_dir` (single runs and multirun jobs alike)."""
    runs_dir = Path(runs_dir)
    found = [p for p in runs_dir.rglob(name) if p.is_file() and not p.is_symlink()] if runs_dir.is_dir() else []
    if not found:
        raise CheckpointError(f"no {name} found under {runs_dir.resolve()}/; "
                              f"run `python train.py` first, or pass --checkpoint")
    return max(found, key=lambda p: p.stat().st_mtime_ns)


def refuse_used_dirs(argv: list[str]) -> None:
    """Refuse, before Hydra writes its .hydra/ there, a hydra.run.dir or hydra.sweep.dir that already holds
    files: they belong to another run."""
    for arg in argv:
        match = re.fullmatch(r"\+{0,2}hydra\.(run|sweep)\.dir=(.+)", arg)
        if match and "${" not in match[2]:
            path = Path(match[2])
            if path.is_dir() and any(path.iterdir()):
                raise ConfigError(f"hydra.{match[1]}.dir={path} already holds another run's files; continue that "
                                  f"run with train.resume={path}, or give a new hydra.{match[1]}.dir")
            if path.exists() and not path.is_dir():
                raise ConfigError(f"hydra.{match[1]}.dir={path} is a file, not a folder")
