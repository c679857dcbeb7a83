"""Run directories: each run's own, claimed before anything is written into it.

There is no `latest` link: inside runs/ TensorBoard would read it as a second copy of the run it points at."""

import atexit
import fcntl
import os
import shutil
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, read_write

from runtime.checkpoint import is_export, load_checkpoint, resolve_checkpoint
from runtime.command import fail
from runtime.errors import CheckpointError, ConfigError, one_line
from runtime.hf import exported_from

from .applies import check_runs_dir_applies
from .distributed import is_rank_zero

RECORD = ".hydra"  # Hydra's record of how a run started: its config, Hydra's own and the overrides
CHECKPOINTS = ("last.pt", "best.pt")
_held = {}  # the directories this process has claimed (resolved) -> whether it continues a run in place there
_made: set[Path] = set()  # the folders this process made for its runs (resolved): removed again if left empty


class RunDirectory(Callback):
    """conf/config.yaml's hydra callback after training.hydra_gate's: claims the run's directory (a sweep's, with
    -m) before anything is written into it, however it was named. A sweep's jobs claim their own through
    take_run_dir.

    Unnamed (hydra.run.dir=???), a run gets a new runs_dir/<date>_<time> (-2, -3, ... for runs started in the same
    second), and a resumed run goes on in its own directory. Under torchrun only rank 0 has a directory; the other
    processes write nothing."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        try:
            self.claim_run_dir(config)
        except Exception as e:  # Hydra would turn an exception raised here into a warning, and run on
            fail("train.py", e, speak=is_rank_zero())

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        try:
            if is_rank_zero():
                claim(Path(config.hydra.sweep.dir), "hydra.sweep.dir")
        except Exception as e:
            fail("train.py", e)

    def claim_run_dir(self, config: DictConfig) -> None:
        with read_write(config.hydra):
            if not is_rank_zero():
                config.hydra.run.dir = os.getcwd()
                return
            resumed = resumed_checkpoint(config.train.resume)
            if OmegaConf.is_missing(config.hydra.run, "dir"):
                if resumed:
                    check_runs_dir_applies(config, resumed)
                config.hydra.run.dir = str(resumed.parent if resumed else new_run_dir(runs_folder(config.runs_dir)))
            run_dir = Path(config.hydra.run.dir)
            claim(run_dir, "hydra.run.dir", resumed if continues_in_place(resumed, run_dir) else None)


def claim(path: Path, key: str, resumed: Path | None = None, job: str = "") -> None:
    """Take path for this process's run, before anything is written into it, or raise a ConfigError: the one
    rule for every directory a run writes to. A directory is taken by creating it, or empty, or as it is when
    the run resumed from `resumed` provably continues there (check_own_run). An exclusive lock on it for the
    process's lifetime keeps out every other run named alike, a second resume included."""
    where = f"{key}={path}" if not job else f"{key}: {job}'s folder {path}"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{where} is a file, not a folder")
    inside = enclosing_run(path)
    if inside is not None:  # its files would be read, listed and deleted as part of that run
        raise ConfigError(f"{where} lies inside the run directory {inside}; give a {key} outside every run's")
    try:
        make_folders(path)
        held = path.resolve()
        if held in _held:  # an earlier job of this sweep, or an earlier claim
            raise ConfigError(f"{where} already holds another run's files; give each run its own {key}")
        descriptor = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ConfigError(f"{where}: cannot create the folder ({one_line(e)})") from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise ConfigError(f"{where} is in use by another training process; wait for it to end, or give "
                          f"a new {key}") from None
    try:
        if resumed is not None:
            check_own_run(path, resumed)
        elif any(path.iterdir()):
            resume = f"continue that run with train.resume={path}, or " \
                if key == "hydra.run.dir" and (path / "last.pt").is_file() else ""
            raise ConfigError(f"{where} already holds another run's files; {resume}give a new {key}")
    except BaseException:
        os.close(descriptor)
        raise
    _held[held] = resumed is not None  # the lock lasts as long as the descriptor: the process's lifetime
    if resumed is None:
        atexit.register(remove_if_unused, path)


def enclosing_run(path: Path) -> Path | None:
    """The run directory that path lies inside, if any: a folder above it that holds a checkpoint, or a run's record
    beside its events (a run stopped before its first evaluation). Another Hydra program's record alone is not a
    run."""
    for parent in path.resolve().parents:
        if any((parent / name).is_file() for name in CHECKPOINTS) or \
                (parent / RECORD).is_dir() and any(parent.glob("events.out.tfevents.*")):
            return parent
    return None


def weights_only(path) -> ConfigError:
    """The refusal of a checkpoint with no training state to continue: an exported folder, or a file saved with
    the weights alone."""
    export = is_export(Path(path))
    what = "a folder that export.py wrote, which" if export else "a checkpoint that"
    return ConfigError(f"train.resume: {path} is {what} holds the weights alone, no optimiser state or step to "
                       f"continue: {resume_advice(Path(path)) if export else RESUME_ELSEWHERE}")


RESUME_ELSEWHERE = "resume from the last.pt of the run that trained it, or train anew without train.resume"


def resume_advice(folder: Path) -> str:
    """What an exported folder's metadata tells of where its run may continue: the checkpoint it came from, if
    that file is still there."""
    source = exported_from(folder)
    if source is None:
        return f"it records no checkpoint it came from; {RESUME_ELSEWHERE}"
    if not source.is_file():
        return (f"it was exported from {source}, which is no longer there, and kvgpt starts no run from weights "
                f"alone: train anew without train.resume")
    if source.name != "best.pt":
        return f"it was exported from {source}: resume from that, train.resume={source}"
    last = source.parent / "last.pt"
    if not last.is_file():
        return f"it was exported from {source}: resume from that, train.resume={source}"
    return (f"it was exported from {source}: train.resume={last} continues the run from its latest step, or "
            f"train.resume={source} hydra.run.dir=NEW a run of its own from best.pt's step")


def check_own_run(run_dir: Path, resumed: Path) -> None:
    """A resumed run continues in place only in the directory that is provably the checkpoint's run, holding
    nothing newer: the checkpoint is its last.pt or best.pt and records the run's identity, and the other of the
    two, if any, records the same run at no later step. Anything else may be another run's files, which the run
    would overwrite."""
    ours = load_checkpoint(resumed).get("training")
    if ours is None:  # nothing to continue, here or in another directory
        raise weights_only(resumed)
    run_id = ours.get("run_id") if isinstance(ours, dict) else None
    reason, advice = None, ""
    if resumed.name not in CHECKPOINTS:
        reason = f"{resumed.name} is not a run's last.pt or best.pt"
    elif not isinstance(run_id, str):
        reason = "the checkpoint records no run identity: an earlier version of kvgpt wrote it"
    for other in (run_dir / name for name in CHECKPOINTS if name != resumed.name and reason is None):
        if not other.exists():
            continue
        try:
            theirs = load_checkpoint(other)["training"]
            same_run, newer = theirs.get("run_id") == run_id, theirs["step"] > ours["step"]
        except (CheckpointError, KeyError, TypeError, AttributeError):
            same_run, newer = False, False
        if not same_run:
            reason = f"its {other.name} is another run's"
        elif newer:
            reason, advice = f"its {other.name} is newer", f"resume from {other}, or "
    if reason is not None:
        raise ConfigError(f"train.resume: {run_dir} is not provably the run of {resumed} ({reason}); {advice}"
                          f"continue in a new directory with hydra.run.dir=NEW")


def take_run_dir(task_config: DictConfig) -> None:
    """In the job itself (where an error fails that job alone): claim a sweep job's directory
    (hydra.sweep.dir/hydra.sweep.subdir) as a run's, then write Hydra's record into the run's directory, unless
    the run continues there."""
    hydra_config = HydraConfig.instance().cfg
    job = hydra_config.hydra
    if not is_rank_zero():
        return
    run_dir = Path(job.runtime.output_dir)
    if job.mode == RunMode.MULTIRUN:
        claim(run_dir, "hydra.sweep.subdir", job=f"job {job.job.num}")
    if not _held.get(run_dir.resolve(), False):
        for name, node in (("config.yaml", task_config), ("hydra.yaml", hydra_config),
                           ("overrides.yaml", job.overrides.task)):
            write_record(node, name, run_dir / RECORD)


def write_record(node, name: str, folder: Path) -> None:
    """One file of the run's record (config, Hydra's settings, overrides), in YAML as Hydra writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(OmegaConf.to_yaml(node), encoding="utf-8")


def resumed_checkpoint(resume: str | None) -> Path | None:
    """The checkpoint train.resume names (a run directory: its last.pt)."""
    if resume is None:
        return None
    try:
        return resolve_checkpoint(resume, prefer="last.pt")
    except CheckpointError as e:
        raise ConfigError(f"train.resume: {e}") from None


def continues_in_place(resumed: Path | None, run_dir: Path) -> bool:
    """Whether a run resumed from the checkpoint `resumed` writes into that checkpoint's own directory."""
    return resumed is not None and resumed.parent.resolve() == Path(run_dir).resolve()


def runs_folder(runs_dir: str) -> Path:
    """runs_dir as a folder, refused where empty: Path("") is the working directory, which would take each run."""
    if not str(runs_dir).strip():
        raise ConfigError(f"runs_dir={runs_dir!r} names no folder; give the folder that holds the runs (runs_dir=runs)")
    return Path(runs_dir)


def new_run_dir(parent: Path) -> Path:
    """parent/<date>_<time>, created here so that no other run can have it: runs that start in the same second
    (an array job's) get <date>_<time>-2, -3, ..."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    inside = enclosing_run(parent / stamp)
    if inside is not None:
        raise ConfigError(f"runs_dir={parent} lies inside the run directory {inside}; give a runs_dir outside "
                          f"every run's")
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"runs_dir={parent} is a file, not a folder; give runs_dir a folder")
    try:
        make_folders(parent)
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


def make_folders(path: Path) -> None:
    """path.mkdir(parents=True, exist_ok=True), noting each folder it made: a run that never starts leaves none."""
    missing = [folder.resolve() for folder in (path, *path.parents) if not folder.exists()]
    path.mkdir(parents=True, exist_ok=True)
    _made.update(missing)


def remove_if_unused(run_dir: Path) -> None:
    """Remove a run directory that holds nothing but Hydra's record: its run failed before its first step. The
    empty folders this process made above it go too."""
    if not (run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {RECORD}):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    for folder in run_dir.resolve().parents:
        if folder not in _made or any(folder.iterdir()):
            break
        folder.rmdir()
