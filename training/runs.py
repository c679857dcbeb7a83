"""Run directories: each run's own, claimed before anything is written into it, and the newest run's checkpoint.

There is no `latest` link: inside runs/ TensorBoard would read it as a second copy of the run it points at."""

import atexit
import fcntl
import os
import shutil
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, read_write

from .checkpoint import resolve_checkpoint
from .distributed import is_rank_zero
from .errors import CheckpointError, ConfigError, fail, one_line


class RunDirectory(Callback):
    """conf/config.yaml's hydra callback: claims the run's directory (a sweep's, with -m) before Hydra writes its
    .hydra/ record into it, however it was named, and holds it until the process ends.

    Unnamed (hydra.run.dir=???), a run gets a new runs_dir/<date>_<time> (-2, -3, ... for runs started in the same
    second), and a resumed run goes on in its own directory. A directory is taken by creating it, or as it is for
    the run being resumed; one that already holds files is another's and is refused. An exclusive lock on the
    directory for the process's lifetime keeps out every other run named alike, a second resume included.
    Under torchrun only rank 0 has a directory; the other processes write nothing."""

    def __init__(self):
        self.locked = []  # descriptors of the directories held; the lock ends with the process

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        try:
            self.claim_run_dir(config)
        except Exception as e:  # Hydra would turn an exception raised here into a warning, and run on
            fail("train.py", e, speak=is_rank_zero())

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        try:
            if is_rank_zero():
                self.claim(Path(config.hydra.sweep.dir), "hydra.sweep.dir", continuing=False)
        except Exception as e:
            fail("train.py", e)

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:  # a job's directory inside the sweep's
            atexit.register(remove_if_unused, Path(config.hydra.runtime.output_dir))

    def claim_run_dir(self, config: DictConfig) -> None:
        with read_write(config.hydra):
            if not is_rank_zero():
                config.hydra.output_subdir, config.hydra.run.dir = None, os.getcwd()
                return
            resumed = resumed_run_dir(config.train.resume)
            if OmegaConf.is_missing(config.hydra.run, "dir"):
                config.hydra.run.dir = str(resumed or new_run_dir(Path(config.runs_dir)))
            run_dir = Path(config.hydra.run.dir)
            continuing = resumed is not None and run_dir.resolve() == resumed.resolve()
            self.claim(run_dir, "hydra.run.dir", continuing)
            if continuing:
                config.hydra.output_subdir = None  # the run's own record of how it started stays

    def claim(self, path: Path, key: str, continuing: bool) -> None:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{key}={path} is a file, not a folder")
        try:
            path.mkdir(parents=True, exist_ok=True)
            self.locked.append(os.open(path, os.O_RDONLY))
        except OSError as e:
            raise ConfigError(f"{key}={path}: cannot create the folder ({one_line(e)})") from None
        try:
            fcntl.flock(self.locked[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{key}={path} is in use by another training process; wait for it to end, or give "
                              f"a new {key}") from None
        if continuing:
            return
        if any(path.iterdir()):
            resume = f"continue that run with train.resume={path}, or " if (path / "last.pt").is_file() else ""
            raise ConfigError(f"{key}={path} already holds another run's files; {resume}give a new {key}")
        atexit.register(remove_if_unused, path)


def resumed_run_dir(resume: str | None) -> Path | None:
    """The directory of the checkpoint train.resume names: where a resumed run goes on."""
    if resume is None:
        return None
    try:
        return resolve_checkpoint(resume, prefer="last.pt").parent
    except CheckpointError as e:
        raise ConfigError(f"train.resume: {e}") from None


def new_run_dir(parent: Path) -> Path:
    """parent/<date>_<time>, created here so that no other run can have it: runs that start in the same second
    (an array job's) get <date>_<time>-2, -3, ..."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1_000_000):
            candidate = parent / (stamp if n == 1 else f"{stamp}-{n}")
            try:
                candidate.mkdir()
                return candidate
            except FileExistsError:
                continue
    except OSError as e:  # read-only, a file where the folder should be, ...
        raise ConfigError(f"runs_dir: cannot create a run directory in {parent} ({e.strerror or e}); "
                          f"give runs_dir a writable folder") from None


def remove_if_unused(run_dir: Path) -> None:
    """Remove a run directory that holds nothing but Hydra's .hydra/ record: its run failed before its first step."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra"}:
        shutil.rmtree(run_dir, ignore_errors=True)


def find_latest_checkpoint(runs_dir="runs", name: str = "best.pt") -> Path:
    """The most recently written `name` anywhere under `runs_dir` (single runs and multirun jobs alike)."""
    runs_dir = Path(runs_dir)
    found = [p for p in runs_dir.rglob(name) if p.is_file() and not p.is_symlink()] if runs_dir.is_dir() else []
    if not found:
        raise CheckpointError(f"no {name} found under {runs_dir.resolve()}/; "
                              f"run `python train.py` first, or pass --checkpoint")
    return max(found, key=lambda p: p.stat().st_mtime_ns)
