"""Edges: no run loses another's files or leaves debris, every failure is one line, and the GPU's code paths
(bf16 autocast, fused AdamW, a bf16 KV cache, the gpu preset compiled) run here on the CPU."""

import argparse
import dataclasses
import errno
import fcntl
import math
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
import uuid
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import corpus
import train
import runtime.checkpoint
import training.runs
from data import CharVocab
from model import GPT, GREEDY, GPTConfig, RingKVCache, Sampling, generate
from test_train import TINY, config, data_overrides
from tiny_models import random_model, random_tokens
from runtime.checkpoint import CheckpointError, build_checkpoint, save_checkpoint
from training.config import ConfigError, OptimConfig, validate
from runtime.devices import training_dtype
from runtime.errors import UsageError, one_line
from runtime.files import remove_stale_temporaries, write_atomically
from training.loop import Trainer
from training.optim import make_optimizers
from training.runs import new_run_dir

REPO = corpus.REPO
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SHORT = ["train.max_iters=4", "train.eval_interval=2", "train.eval_iters=1", "train.log_interval=1",
         "optim.warmup_iters=1"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


def train_cli(*args, cwd, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train.py"), *map(str, args)], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, prog: str, *fragments: str, status: int = 2) -> str:
    assert result.returncode == status, result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("preset=")]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def tree(folder: Path) -> dict:
    """Every file under folder with its contents and modification time."""
    return {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


# --- run directories ----------------------------------------------------------------------------------------------

def test_runs_claimed_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(training.runs.time, "strftime", lambda pattern: "2030-01-01_00-00-00")
    claimed = [new_run_dir(tmp_path / "runs") for _ in range(3)]  # as if three processes
    assert [c.name for c in claimed] == ["2030-01-01_00-00-00", "2030-01-01_00-00-00-2", "2030-01-01_00-00-00-3"]
    assert all(c.is_dir() for c in claimed)


def test_runs_started_at_once_each_write_their_own_directory(tmp_path, data_root):
    command = [sys.executable, str(REPO / "train.py"), *TINY, *SHORT, *data_overrides(data_root)]
    train_cli(*command[2:], cwd=tmp_path)  # prepares the data once, so that the runs below start together
    before = set((tmp_path / "runs").iterdir())
    processes = [subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True) for _ in range(3)]
    for process in processes:
        assert process.wait(timeout=180) == 0, process.stderr.read()
        process.stderr.close()
    run_dirs = sorted(set((tmp_path / "runs").iterdir()) - before)
    assert len(run_dirs) == 3
    writers = []  # the pids in each directory's events file names: events.out.tfevents.<time>.<host>.<pid>.<n>
    for run_dir in run_dirs:
        assert (run_dir / "last.pt").is_file() and (run_dir / ".hydra/config.yaml").is_file()
        writers.append({p.name.split(".")[-2] for p in run_dir.glob("events.out.tfevents.*")})
    assert all(len(pids) == 1 for pids in writers) and len(set.union(*writers)) == 3  # one run each


@pytest.mark.parametrize("naming", ["plain", "quoted", "interpolated"])
def test_a_refused_run_changes_nothing_in_the_directory_it_names(tmp_path, naming):
    run_dir = tmp_path / "runs/earlier"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra/config.yaml").write_text("the earlier run's config\n")
    (run_dir / "last.pt").write_bytes(b"the earlier run's checkpoint")
    before = tree(run_dir)
    names = {"plain": [f"hydra.run.dir={run_dir}"], "quoted": [f"hydra.run.dir='{run_dir}'"],
             "interpolated": [f"runs_dir={run_dir}", "hydra.run.dir=${runs_dir}"]}
    result = train_cli(*TINY, *names[naming], cwd=tmp_path)
    assert_one_line_error(result, "train.py", f"hydra.run.dir={run_dir} already holds another run's files",
                          f"train.resume={run_dir}")
    assert tree(run_dir) == before


@pytest.mark.parametrize("naming", ["hydra.run.dir", "hydra.sweep.dir", "runs_dir"])
def test_a_run_named_inside_another_runs_directory_is_refused(tmp_path, naming):
    """A run's files inside another run's directory would be listed (TensorBoard, the newest best.pt), moved and
    deleted with that run: refused, with nothing created in it."""
    earlier = tmp_path / "runs/earlier"
    (earlier / ".hydra").mkdir(parents=True)
    (earlier / "best.pt").write_bytes(b"the earlier run's checkpoint")
    before = tree(earlier)
    names = {"hydra.run.dir": [f"hydra.run.dir={earlier}/more"], "runs_dir": [f"runs_dir={earlier}/runs"],
             "hydra.sweep.dir": [f"hydra.sweep.dir={earlier}/sweep", "train.seed=1,2"]}
    result = train_cli(*(["-m"] if naming == "hydra.sweep.dir" else []), *TINY, *names[naming], cwd=tmp_path)
    assert_one_line_error(result, "train.py", f"lies inside the run directory {earlier}; give a {naming} outside")
    assert tree(earlier) == before


@pytest.mark.parametrize("flags, setting", [([], "hydra.job.chdir=true"), (["-m"], "hydra.job.chdir=true"),
                                            ([], "hydra.output_subdir=record")])
def test_hydra_settings_that_move_reads_or_writes_are_refused_before_any_folder(tmp_path, flags, setting):
    """hydra.job.chdir would read data.text, data.root and train.resume from inside the new run directory;
    hydra.output_subdir would write Hydra's record before the directory is claimed."""
    result = train_cli(*flags, *TINY, setting, cwd=tmp_path)
    assert_one_line_error(result, "train.py", f"{setting.split('=')[0]} cannot be set")
    assert list(tmp_path.iterdir()) == []


def test_another_hydra_programs_record_is_no_run_but_a_stopped_runs_is(tmp_path):
    """Refusing a run inside another's must not refuse one below a folder where another Hydra program wrote its
    record; a run stopped before its first checkpoint has its record beside its events."""
    (tmp_path / ".hydra").mkdir()
    assert training.runs.enclosing_run(tmp_path / "runs/new") is None
    (tmp_path / "events.out.tfevents.1700000000.host.1.0").write_bytes(b"")
    assert training.runs.enclosing_run(tmp_path / "runs/new") == tmp_path.resolve()


def test_an_empty_run_dir_is_the_current_folder_and_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("the user's own file\n")
    result = train_cli(*TINY, "hydra.run.dir=", cwd=tmp_path)
    assert_one_line_error(result, "train.py", "hydra.run.dir=. already holds another run's files")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def wait_until_stopped(pid: int):
    """SIGSTOP is delivered after kill() returns: until every thread of the process is stopped ("T" in its stat), its
    writer thread may still be writing."""
    def state(task):
        try:
            return task.read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return "T"  # a thread that ended writes nothing
    deadline = time.monotonic() + 30
    while any(state(task / "stat") != "T" for task in Path(f"/proc/{pid}/task").iterdir()):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.01)


def test_a_run_directory_in_use_is_refused_and_a_stopped_run_resumes_in_it(tmp_path, data_root):
    """A second run, or a resume, named into the directory of a running training is refused while that runs (it
    is paused here, holding its lock). Stopped, the run says how to continue, and that command does continue it,
    in its own directory."""
    run_dir = tmp_path / "run"
    command = [*TINY, *data_overrides(data_root), "train.max_iters=300", "train.eval_interval=20",
               f"hydra.run.dir={run_dir}"]
    first = subprocess.Popen([sys.executable, str(REPO / "train.py"), *command], cwd=tmp_path, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not (run_dir / "last.pt").exists() and first.poll() is None:
            time.sleep(0.02)
        first.send_signal(signal.SIGSTOP)
        wait_until_stopped(first.pid)
        before = tree(run_dir)
        for extra in ([], [f"train.resume={run_dir}"]):
            result = train_cli(*command, *extra, cwd=tmp_path)
            assert_one_line_error(result, "train.py", f"hydra.run.dir={run_dir} is in use by another training")
        assert tree(run_dir) == before
        first.send_signal(signal.SIGCONT)
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == 0 and "continue with the same command plus" in stderr, stderr
    advice = stderr.split("continue with the same command plus ")[1].split()
    assert advice == [f"train.resume={run_dir}"]
    result = train_cli(*command, *advice, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert torch.load(run_dir / "last.pt", weights_only=True)["training"]["step"] == 300
    assert [p.name for p in tmp_path.iterdir() if p.name != "run"] == []  # no other run directory


def child_signal(signum: int, handler=signal.SIG_DFL):
    """A preexec_fn: in the child, signum delivered and handled by handler, whatever the parent left (a disposition
    of SIG_IGN, as nohup or a shell's background job leaves it, or a blocked mask, is inherited across exec)."""
    def preexec() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        signal.signal(signum, handler)
    return preexec


@pytest.mark.parametrize("output", ["pipes", "a closed terminal", "nohup"])
def test_a_hangup_saves_the_run_unless_nohup_asks_it_to_go_on(tmp_path, data_root, output):
    """SIGHUP (a closed terminal, a lost ssh session) stops a run after its step and saves last.pt there, as SIGTERM
    does, even once every write to the terminal fails (EIO); under nohup, which starts the process ignoring SIGHUP,
    the run trains on to its end. Evaluations (and so saves) come every 50,000 steps: a last.pt before then is the
    stop's."""
    run_dir = tmp_path / "run"
    max_iters = 300 if output == "nohup" else 100_000
    command = [sys.executable, str(REPO / "train.py"), *TINY, *data_overrides(data_root),
               f"train.max_iters={max_iters}", f"train.eval_interval={20 if output == 'nohup' else 50_000}",
               f"hydra.run.dir={run_dir}"]
    # the test decides how the child takes SIGHUP, not the suite (which may itself run under nohup)
    set_hangup = child_signal(signal.SIGHUP, signal.SIG_IGN if output == "nohup" else signal.SIG_DFL)
    if output == "a closed terminal":
        terminal, child_end = os.openpty()
        fcntl.ioctl(child_end, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # 80 columns, as a terminal has
        process = subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=child_end, stderr=child_end,
                                   preexec_fn=set_hangup)
        os.close(child_end)
        shown = b""
        while not re.search(rb"[1-9]\d*/100000", shown) and select.select([terminal], [], [], 60)[0]:
            shown += os.read(terminal, 4096)  # until the progress bar shows a step taken
        os.close(terminal)  # the terminal is gone: what the run writes to it now fails with EIO
    else:
        process = subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   preexec_fn=set_hangup)
        while not process.stdout.readline().startswith(b"step 0:"):  # the first evaluation is done
            assert process.poll() is None
    try:
        process.send_signal(signal.SIGHUP)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    step = torch.load(run_dir / "last.pt", weights_only=True)["training"]["step"]
    if output == "nohup":
        assert step == max_iters and b"stopped" not in stderr, stderr
        return
    assert step < 50_000
    if output == "pipes":
        assert f"stopped by SIGHUP at step {step}: saved {run_dir / 'last.pt'}".encode() in stderr, stderr


def test_a_sweep_runs_its_possible_jobs_and_names_the_impossible_one(tmp_path, data_root):
    result = train_cli("-m", *TINY, *SHORT, *data_overrides(data_root), "optim.lr=1e-2,-1,5e-3", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("train.py: error: job 1 (") and "optim.lr=-1" in lines[0], result.stderr
    assert lines[0].endswith("optim.lr must be a positive number, got -1.0")
    (sweep,) = (tmp_path / "runs/multirun").iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "2"]  # job 1's directory removed
    assert all((sweep / job / "last.pt").is_file() for job in ("0", "2"))


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory, data_root) -> list[Path]:
    """Two runs as if stopped at step 2 of 4, last.pt and best.pt both holding step 2."""
    tmp_path = tmp_path_factory.mktemp("stopped")
    run_dirs = [tmp_path / "runs/a", tmp_path / "runs/b"]
    for run_dir in run_dirs:
        train.main(config(tmp_path, data_root, *SHORT), run_dir)
        last = torch.load(run_dir / "last.pt", weights_only=True)
        last["training"]["step"] = 2
        for name in ("last.pt", "best.pt"):
            save_checkpoint(last, run_dir / name)
    return run_dirs


def copy_run(run_dir: Path, to: Path) -> Path:
    to.mkdir(parents=True)
    for path in run_dir.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    return to


def resume_checkpoint_elsewhere(keep: Path, other: Path) -> str:  # keep/snapshot.pt: a copy of another run's
    (keep / "snapshot.pt").write_bytes((other / "last.pt").read_bytes())
    return "keep/snapshot.pt"


def replace_last_pt(keep: Path, other: Path) -> str:
    (keep / "last.pt").write_bytes((other / "last.pt").read_bytes())
    return "keep"


def resume_best_pt_before_a_newer_last_pt(keep: Path, other: Path) -> str:
    last = torch.load(keep / "last.pt", weights_only=True)
    last["training"]["step"] = 3
    save_checkpoint(last, keep / "last.pt")
    return "keep/best.pt"


def forget_the_run_identity(keep: Path, other: Path) -> str:  # as an earlier version wrote it
    for name in ("last.pt", "best.pt"):
        contents = torch.load(keep / name, weights_only=True)
        del contents["training"]["run_id"]
        save_checkpoint(contents, keep / name)
    return "./keep/../keep"


@pytest.mark.parametrize("case, reason", [
    (resume_checkpoint_elsewhere, "snapshot.pt is not a run's last.pt or best.pt"),
    (replace_last_pt, "its best.pt is another run's"),
    (resume_best_pt_before_a_newer_last_pt, "its last.pt is newer); resume from keep/last.pt, or"),
    (forget_the_run_identity, "the checkpoint records no run identity"),
], ids=lambda case: getattr(case, "__name__", ""))
def test_a_resume_is_refused_where_the_checkpoint_is_not_provably_the_runs_own(tmp_path, data_root, stopped_runs,
                                                                               case, reason):
    keep = copy_run(stopped_runs[0], tmp_path / "keep")
    resume = case(keep, stopped_runs[1])
    before = tree(keep)
    result = train_cli(*TINY, *SHORT, *data_overrides(data_root), f"train.resume={resume}", cwd=tmp_path)
    run_dir = Path(resume).parent if resume.endswith(".pt") else Path(resume)
    assert_one_line_error(result, "train.py", f"train.resume: {run_dir} is not provably the run of", reason,
                          "continue in a new directory with hydra.run.dir=NEW")
    assert tree(keep) == before
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []


def test_a_resume_continues_in_its_own_run_however_the_path_is_written(tmp_path, data_root, stopped_runs):
    run = copy_run(stopped_runs[0], tmp_path / "run")
    (tmp_path / "link").symlink_to(run)
    result = train_cli(*TINY, *SHORT, *data_overrides(data_root), "train.resume=./link/../run/last.pt",
                       "hydra.run.dir=link", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    last, best = (torch.load(run / name, weights_only=True)["training"] for name in ("last.pt", "best.pt"))
    assert last["step"] == 4 and last["run_id"] == best["run_id"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "run"]


def test_sweep_jobs_named_into_one_folder_are_refused_after_the_first(tmp_path, data_root):
    result = train_cli("-m", *TINY, *SHORT, *data_overrides(data_root), "train.seed=1,2",
                       "hydra.sweep.subdir=same", "hydra.sweep.dir=sweep", cwd=tmp_path)
    line = assert_one_line_error(result, "train.py", "job 1 (", "train.seed=2", "hydra.sweep.subdir: job 1's folder",
                                 "already holds another run's files")
    assert "train.seed=1" not in line
    first = torch.load(tmp_path / "sweep/same/last.pt", weights_only=True)
    assert first["training"]["config"]["train"]["seed"] == 1 and first["training"]["step"] == 4
    assert (tmp_path / "sweep/same/.hydra/overrides.yaml").read_text().count("train.seed=1") == 1


@pytest.mark.parametrize("override, fragments", [
    ("train.sample_prompt='Romeo#'", ["train.sample_prompt", "'#'"]),  # found once the text is read
    ("model.block_size=2048", ["the val split", "too short", "2048"]),  # only at the first evaluation, before
])
def test_a_run_that_fails_before_its_first_step_leaves_no_directory(tmp_path, data_root, override, fragments):
    result = train_cli(*TINY, *data_overrides(data_root), override, cwd=tmp_path)
    assert_one_line_error(result, "train.py", *fragments)
    assert list((tmp_path / "runs").iterdir()) == []
    with pytest.raises(CheckpointError):
        runtime.checkpoint.find_latest_checkpoint(tmp_path / "runs")


@pytest.mark.parametrize("where, fragments", [
    ("runs_dir=a-file", ["runs_dir: cannot create a run directory in a-file"]),
    ("runs_dir=/proc/kvgpt-runs", ["runs_dir: cannot create a run directory in /proc/kvgpt-runs"]),
    ("runs_dir=null", ["runs_dir", "not Optional"]),
    ("hydra.run.dir=a-file", ["hydra.run.dir=a-file is a file"]),
    ("data.root=a-file", ["cannot prepare the data in a-file"]),
    ("data.root=/proc/kvgpt-data", ["cannot prepare the data in /proc/kvgpt-data"]),
])
def test_unusable_folders_are_one_line_errors(tmp_path, data_root, where, fragments):
    """/proc: a place that even root cannot write to."""
    (tmp_path / "a-file").write_text("not a folder\n")
    overrides = [o for o in data_overrides(data_root) if not o.startswith("data.root")] \
        if where.startswith("data.root") else data_overrides(data_root)
    result = train_cli(*TINY, *overrides, where, cwd=tmp_path)
    assert_one_line_error(result, "train.py", *fragments)
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []


@pytest.mark.parametrize("override", ["train.batch_size=1000000000000", "model.n_embd=10000000"])
def test_a_training_beyond_memory_is_refused_before_it_starts(tmp_path, data_root, override):
    result = train_cli(*TINY, *data_overrides(data_root), override, cwd=tmp_path)
    assert_one_line_error(result, "train.py", "need at least", "GiB, and the cpu device has", "smaller model or batch")
    assert list((tmp_path / "runs").iterdir()) == []


def test_a_read_only_runs_dir_is_one_line(tmp_path, monkeypatch):
    def read_only(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    (tmp_path / "runs").mkdir()
    monkeypatch.setattr(training.runs.os, "mkdir", read_only)
    with pytest.raises(ConfigError, match=r"^runs_dir: cannot create a run directory in .*runs \(Permission denied\)"):
        new_run_dir(tmp_path / "runs")


@pytest.mark.parametrize("failure, fragments, status", [
    ("OSError(errno.ENOSPC, 'No space left on device')", ["cannot save {run_dir}/best.pt (No space left on device",
                                                          "the previous one is kept"], 1),
    ("raise_signal(signal.SIGTERM) or raise_signal(signal.SIGTERM)", ["interrupted"], 130),
], ids=["a full disk", "a second SIGTERM"])
def test_a_failed_or_interrupted_save_keeps_the_previous_checkpoint(tmp_path, data_root, failure, fragments, status):
    """The second save of best.pt (step 4's, which improves on step 2's) fails in the middle of torch.save's
    writes, which torch reports as a RuntimeError; or a second SIGTERM arrives then. last.pt stays step 2's, and
    records the best val loss that best.pt holds."""
    run_dir = tmp_path / "run"
    script = f"""
import errno, runpy, signal, sys, torch
from signal import raise_signal
sys.path.insert(0, {str(REPO)!r})
save, calls = torch.save, []

class Failing:
    def __init__(self, file):
        self.file, self.writes = file, 0
    def write(self, data):
        self.writes += 1
        if self.writes == 2:
            failure = {failure}
            if failure is not None:
                raise failure
        return self.file.write(data)
    def flush(self):
        self.file.flush()

def save_failing_on_the_second_best_pt(obj, f, *args, **kwargs):
    best = ".best.pt." in f.name
    calls.extend([None] if best else [])
    return save(obj, Failing(f) if best and len(calls) == 2 else f, *args, **kwargs)
torch.save = save_failing_on_the_second_best_pt
sys.argv = ["train.py", *{[*TINY, *SHORT, *data_overrides(data_root), f"hydra.run.dir={run_dir}"]!r}]
runpy.run_path({str(REPO / "train.py")!r}, run_name="__main__")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                            timeout=180)
    assert_one_line_error(result, "train.py", *(f.format(run_dir=run_dir) for f in fragments), status=status)
    last, best = (torch.load(run_dir / name, weights_only=True)["training"] for name in ("last.pt", "best.pt"))
    assert last["step"] == best["step"] == 2 and last["best_val_loss"] == best["best_val_loss"]
    assert not list(run_dir.glob(".*.tmp"))


@pytest.mark.parametrize("method, step", [("log_pending", 1), ("save", 2)],
                         ids=["found by TensorBoard's writer thread", "found by a checkpoint save"])
def test_a_run_directory_removed_while_training_is_one_line(tmp_path, data_root, method, step):
    """The run directory is removed just before the run logs step 1's values (TensorBoard writes them in a thread
    of its own) or saves step 2's checkpoint. It is not made again: a run without its directory cannot go on."""
    run_dir = tmp_path / "run"
    script = f"""
import runpy, shutil, sys
sys.path.insert(0, {str(REPO)!r})
from training.loop import Trainer
original = Trainer.{method}

def removing_the_run_directory_first(self, *args, **kwargs):
    if self.step == {step} and self.run_dir.exists():
        # moved away at once, then deleted: TensorBoard's writer thread may still add a file to it meanwhile
        gone = self.run_dir.rename(self.run_dir.with_name("removed"))
        shutil.rmtree(gone, ignore_errors=True)
    return original(self, *args, **kwargs)
Trainer.{method} = removing_the_run_directory_first
sys.argv = ["train.py", *{[*TINY, *SHORT, *data_overrides(data_root), f"hydra.run.dir={run_dir}"]!r}]
runpy.run_path({str(REPO / "train.py")!r}, run_name="__main__")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                            timeout=180)
    assert_one_line_error(result, "train.py", f"the run directory {run_dir} vanished while training", status=1)
    assert not run_dir.exists()


def test_a_failed_write_of_the_events_names_their_file():
    """TensorBoard's writer names its events file in bytes."""
    error = OSError(errno.ENOSPC, "No space left on device", b"/runs/x/events.out.tfevents.1")
    assert one_line(error) == "No space left on device: /runs/x/events.out.tfevents.1"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_stdout_is_one_line_for_train(tmp_path, data_root):
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, *data_overrides(data_root)],
                                cwd=tmp_path, env=ENV, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert_one_line_error(result, "train.py", "cannot write to standard output (No space left on device)",
                          status=1)
    assert list((tmp_path / "runs").iterdir()) == []  # it failed before its first step


def test_sigterm_while_preparing_the_data_leaves_nothing_behind(tmp_path):
    """Reading the text waits (as on a slow disk) until the signal."""
    source, root = tmp_path / "source.txt", tmp_path / "data"
    corpus.write_corpus(source)
    script = f"""
import runpy, sys, time
sys.path.insert(0, {str(REPO)!r})
import data.prepare
data.prepare.read_regular_file = lambda path: time.sleep(60)
sys.argv = ["train.py", *{[*TINY, f"data.text={source}", f"data.root={root}"]!r}]
runpy.run_path({str(REPO / "train.py")!r}, run_name="__main__")
"""
    process = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not any((tmp_path / "runs").glob("*")) and process.poll() is None:  # the run has claimed its folder
            time.sleep(0.05)
        time.sleep(1)  # and now reads the text
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130 and stderr == "train.py: error: interrupted\n", stderr
    assert (not root.exists() or list(root.rglob("*")) == []) and list((tmp_path / "runs").iterdir()) == []


@pytest.mark.parametrize("kind", ["a pipe with no writer", "a device without end", "a folder"])
def test_a_text_that_is_not_a_regular_file_is_refused_before_it_is_read(tmp_path, kind, checkpoint):
    path = {"a pipe with no writer": tmp_path / "pipe", "a device without end": Path("/dev/zero"),
            "a folder": tmp_path / "folder"}[kind]
    if kind == "a pipe with no writer":
        os.mkfifo(path)
    elif kind == "a folder":
        path.mkdir()
    result = train_cli(*TINY, f"data.text={path}", f"data.root={tmp_path / 'data'}", cwd=tmp_path, timeout=60)
    assert_one_line_error(result, "train.py", f"the text {path} is not a regular file")
    result = subprocess.run(sample_command(checkpoint, "--prompt-file", path), env=ENV, capture_output=True,
                            text=True, timeout=60)
    assert_one_line_error(result, "sample.py", f"--prompt-file {path} is not a regular file")


def test_a_failure_while_the_config_is_first_written_leaves_no_directory(tmp_path):
    script = f"""
import errno, runpy, sys
import hydra.core.utils
sys.path.insert(0, {str(REPO)!r})
def save_on_a_full_disk(cfg, filename, output_dir):
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / filename).write_text("")
    raise OSError(errno.ENOSPC, "No space left on device", str(output_dir / filename))
hydra.core.utils._save_config = save_on_a_full_disk
sys.argv = ["train.py", *{TINY!r}]
runpy.run_path({str(REPO / "train.py")!r}, run_name="__main__")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                            timeout=120)
    assert_one_line_error(result, "train.py", "No space left on device", status=1)
    assert list((tmp_path / "runs").iterdir()) == []


@pytest.mark.parametrize("when", ["twice as the final summaries are written", "as training returns",
                                  "as the process exits"])
def test_a_signal_after_a_run_finished_and_saved_leaves_its_success(tmp_path, data_root, when):
    run_dir = tmp_path / "run"
    script = f"""
import atexit, runpy, signal, sys
sys.path.insert(0, {str(REPO)!r})
from training.loop import Trainer
from training.summaries import Summaries
fit, evaluation = Trainer.fit, Summaries.evaluation

def fit_then_sigterm(self):
    result = fit(self)
    signal.raise_signal(signal.SIGTERM)
    return result

def evaluation_then_two_signals(self, step, *args):  # after the final save; the sample is still to come
    evaluation(self, step, *args)
    if step == 4:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
if {when!r} == "twice as the final summaries are written":
    Summaries.evaluation = evaluation_then_two_signals
elif {when!r} == "as training returns":
    Trainer.fit = fit_then_sigterm
else:
    atexit.register(signal.raise_signal, signal.SIGTERM)  # registered first: the last to run
sys.argv = ["train.py", *{[*TINY, *SHORT, *data_overrides(data_root), f"hydra.run.dir={run_dir}"]!r}]
runpy.run_path({str(REPO / "train.py")!r}, run_name="__main__")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.splitlines()[-1].startswith("done: ")
    assert torch.load(run_dir / "last.pt", weights_only=True)["training"]["step"] == 4


@pytest.mark.parametrize("argv, fragment", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["preset=cpu", "-m", "train.seed=1,2"], "unrecognized arguments: train.seed=1,2"),
    (["--cfg"], "argument --cfg/-c: expected one argument"),
])
def test_a_flag_mistake_is_one_line(tmp_path, argv, fragment):
    result = train_cli(*argv, cwd=tmp_path)
    assert_one_line_error(result, "train.py", fragment, "the flags, which go before the overrides")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_a_mistake_is_told_once_and_every_rank_exits_alike(tmp_path, rank):
    env = {**ENV, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, "model.n_head=5"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    if rank == 0:
        assert_one_line_error(result, "train.py", "model: n_embd 32 is not divisible by n_head 5")
    else:
        assert result.stderr == ""
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []


def test_under_torchrun_itself_our_line_comes_first_with_the_cause(tmp_path):
    """torchrun adds its own report of the failed process after ours, and exits 1 (README)."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(REPO / "train.py"), *TINY, "model.n_head=5"], cwd=tmp_path, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.splitlines()[0] == "train.py: error: model: n_embd 32 is not divisible by n_head 5"
    assert result.stderr.count("train.py: error:") == 1  # rank 0's; the other rank is silent
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []


# --- debris -------------------------------------------------------------------------------------------------------

def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def temporary(folder: Path, name: str, host: str, pid: int) -> Path:
    path = folder / f".{name}.{host}-{pid}.{uuid.uuid4().hex}.tmp"
    path.write_bytes(b"half a checkpoint")
    return path


def test_only_temporaries_of_dead_writers_on_this_host_are_removed(tmp_path):
    host = socket.gethostname().replace(".", "_")
    dead = temporary(tmp_path, "last.pt", host, dead_pid())
    live = temporary(tmp_path, "last.pt", host, os.getpid())
    elsewhere = temporary(tmp_path, "best.pt", "another-host", dead_pid())
    other = tmp_path / ".notes.tmp"
    other.write_text("not ours")
    assert remove_stale_temporaries(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and elsewhere.exists() and other.exists()


def test_a_write_names_its_temporary_after_its_process(tmp_path):
    seen = []
    write_atomically(tmp_path / "last.pt", lambda file: seen.extend(Path(tmp_path).glob(".last.pt.*.tmp")))
    assert len(seen) == 1 and f"-{os.getpid()}." in seen[0].name
    assert remove_stale_temporaries(tmp_path) == []  # a live writer's, had it still been there


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, data_root) -> Path:
    """A run stopped at step 2 of 4: its last.pt can be resumed."""
    tmp_path = tmp_path_factory.mktemp("short")
    run_dir = tmp_path / "runs/short"
    train.main(config(tmp_path, data_root, *SHORT), run_dir)
    last = torch.load(run_dir / "last.pt", weights_only=True)
    last["training"]["step"] = 2
    save_checkpoint(last, run_dir / "last.pt")
    return run_dir


def test_resuming_a_run_clears_what_a_killed_save_left_there(tmp_path, data_root, short_run):
    source = tmp_path / "killed"
    source.mkdir()
    (source / "last.pt").write_bytes((short_run / "last.pt").read_bytes())
    host = socket.gethostname().replace(".", "_")
    stale = temporary(source, "last.pt", host, dead_pid())
    live = temporary(source, "best.pt", host, os.getpid())
    train.main(config(tmp_path, data_root, *SHORT, f"train.resume={source}"), tmp_path / "runs/elsewhere")
    assert stale.exists()  # another run's directory, which a run resumed elsewhere leaves as it is
    train.main(config(tmp_path, data_root, *SHORT, f"train.resume={source}"), source)
    assert not stale.exists() and live.exists()


def test_resuming_on_another_text_is_refused(tmp_path, data_root, short_run):
    other = tmp_path / "other.txt"
    other.write_text(corpus.TEXT.swapcase(), encoding="utf-8")  # the same characters, another text
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY, f"data.text={other}", f"data.root={data_root}",
                                           f"runs_dir={tmp_path / 'runs'}", *SHORT,
                                           f"train.resume={short_run}"])
    with pytest.raises(ConfigError, match=rf"^train.resume: the checkpoint was trained on .*corpus.txt \(sha256 "
                                          rf"{corpus.SHA256[:12]}\), not on {other}; resume with the text"):
        train.main(cfg, tmp_path / "runs/resumed")


@pytest.mark.parametrize("design", [["model.n_kv_head=1"], ["model.kv_share=2"],
                                    ["model.n_kv_head=1", "model.kv_share=2"], ["model.learned_sink=true"],
                                    ["model.kv_latent=8"]])
def test_resuming_a_checkpoint_older_than_the_cache_designs_with_another_design_is_one_line(tmp_path, data_root,
                                                                                         short_run, design):
    """A checkpoint saved before the cache designs existed holds multi-head attention with every layer its own
    keys and values: another design is refused with the settings to add, as for a newer checkpoint."""
    old = torch.load(short_run / "last.pt", weights_only=True)
    for section in (old["model_config"], old["training"]["config"]["model"]):
        for field in ("n_kv_head", "kv_share", "window_pattern", "local_window", "learned_sink", "kv_latent",
                      "kv_latent_rope"):
            del section[field]
    path = tmp_path / "old.pt"
    save_checkpoint(old, path)
    n_head = old["model_config"]["n_head"]
    with pytest.raises(ConfigError, match=r"^train.resume continues a run with other settings; add them to the "
                                          r"command: .*model\.(n_kv_head|kv_share|learned_sink|kv_latent)="):
        train.main(config(tmp_path, data_root, *SHORT, *design, f"train.resume={path}"), tmp_path / "runs/resumed")
    assert train.main(config(tmp_path, data_root, *SHORT, f"model.n_kv_head={n_head}", "model.kv_share=1",
                             f"train.resume={path}"), tmp_path / "runs/same") is not None  # the same design resumes


def damage(contents: dict, how: str) -> dict:
    model, state = contents["model"], contents["training"]
    if how == "a weight missing":
        del model["lm_head.weight"]
    elif how == "a weight of the wrong shape":
        model["wte.weight"] = model["wte.weight"][:, :3]
    elif how == "a weight that is no tensor":
        model["wpe.weight"] = "weights"
    elif how == "an optimizer of other weights":
        state["optimizers"][0]["param_groups"] = state["optimizers"][0]["param_groups"][:1]
    elif how == "optimizer moments of the wrong shape":
        moments = next(iter(state["optimizers"][0]["state"].values()))
        moments["exp_avg"] = moments["exp_avg"].flatten()[:1]
    elif how == "one optimizer too many":
        state["optimizers"].append(state["optimizers"][0])
    elif how == "a scheduler that is no dict":
        state["schedulers"] = [[1, 2]]
    elif how == "best_val_loss of the wrong type":
        state["best_val_loss"] = "low"
    elif how == "rng of the wrong type":
        state["rng"] = {"torch": 1}
    elif how == "a step that is a string":
        state["step"] = "2"
    elif how == "the training state missing a key":
        del state["schedulers"]
    elif how == "the text recorded as a string":
        contents["text"] = "corpus.txt"
    return contents


@pytest.mark.parametrize("how", ["a weight missing", "a weight of the wrong shape", "a weight that is no tensor",
                                 "an optimizer of other weights", "optimizer moments of the wrong shape",
                                 "one optimizer too many",
                                 "a scheduler that is no dict", "best_val_loss of the wrong type",
                                 "rng of the wrong type", "a step that is a string",
                                 "the training state missing a key", "the text recorded as a string"])
def test_a_damaged_checkpoint_that_still_loads_is_refused_in_one_line(tmp_path, data_root, short_run, how):
    path = tmp_path / "damaged.pt"
    save_checkpoint(damage(torch.load(short_run / "last.pt", weights_only=True), how), path)
    with pytest.raises(ConfigError) as caught:
        train.main(config(tmp_path, data_root, *SHORT, f"train.resume={path}"), tmp_path / "runs/resumed")
    message = str(caught.value)
    assert message.startswith(f"train.resume: {path} is damaged (") and "\n" not in message


@pytest.mark.parametrize("how", ["a weight that is no tensor", "best_val_loss of the wrong type",
                                 "a step that is a string", "the training state missing a key",
                                 "the text recorded as a string"])
def test_a_damaged_checkpoint_that_still_loads_is_one_line_for_sample(tmp_path, short_run, how):
    path = tmp_path / "damaged.pt"
    save_checkpoint(damage(torch.load(short_run / "last.pt", weights_only=True), how), path)
    result = subprocess.run(sample_command(path, "--max-new-tokens", "3"), env=ENV, capture_output=True, text=True,
                            timeout=60)
    assert_one_line_error(result, "sample.py", f"{path} is ")
    assert result.stdout == ""


# --- sample.py ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    vocab = CharVocab.from_text(corpus.TEXT)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(vocab), block_size=16, n_layer=1, n_head=2, n_embd=16))
    return save_checkpoint(build_checkpoint(model, vocab), tmp_path_factory.mktemp("run") / "best.pt")


def sample_command(checkpoint: Path, *args) -> list[str]:
    return [sys.executable, str(REPO / "sample.py"), "--checkpoint", str(checkpoint), *map(str, args)]


def test_a_reader_that_stops_early_ends_sampling_quietly(checkpoint):
    process = subprocess.Popen(sample_command(checkpoint, "--max-new-tokens", 300, "--num-samples", 2), env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # like `| head -c 0`: gone before the first sample is written
    stderr = process.stderr.read()
    process.stderr.close()
    assert process.wait(timeout=120) == 0 and stderr.startswith("sampling ") and stderr.count("\n") == 1


def test_a_reader_that_stops_early_ends_a_long_sample_promptly(checkpoint):
    """Like `| head -c 10`: a lone sample is written as it grows, so the closed pipe is noticed at once."""
    # --no-compile: a generation this long would compile its step first (sampling/compiled_step.py)
    process = subprocess.Popen(sample_command(checkpoint, "--max-new-tokens", 10**8, "--no-compile"), env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert select.select([process.stdout], [], [], 60)[0], "nothing written within 60 s"
        assert os.read(process.stdout.fileno(), 10)
        process.stdout.close()
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
    assert process.stderr.read().decode().startswith("sampling ")
    process.stderr.close()


def signal_state(pid: int) -> str:
    """The kernel's view of a process's signals: which it ignores, blocks, catches and has pending (hex masks)."""
    with open(f"/proc/{pid}/status") as status:
        return " ".join(line.strip() for line in status
                        if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")))


def test_ctrl_c_keeps_the_text_written_so_far(checkpoint, tmp_path):
    out = tmp_path / "sample.txt"
    with open(out, "w") as file:
        process = subprocess.Popen(sample_command(checkpoint, "--max-new-tokens", 10**8, "--prompt", "JULIET:",
                                                  "--no-compile"),
                                   env=ENV, stdout=file, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=child_signal(signal.SIGINT))
        try:
            deadline = time.monotonic() + 120
            while out.stat().st_size < 200 and time.monotonic() < deadline:  # some text generated and written
                time.sleep(0.1)
            assert out.stat().st_size >= 200, "no text written within 120 s"  # Ctrl-C during start-up is another case
            before = signal_state(process.pid) if Path("/proc/self/status").exists() else "?"
            process.send_signal(signal.SIGINT)
            try:
                _, stderr = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"sample.py ran on after SIGINT; its signals before: {before}; after: "
                                     f"{signal_state(process.pid)}") from None
        finally:  # never left running, asked for 10**8 tokens, for the rest of the suite
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 130 and stderr.splitlines()[-1] == "sample.py: error: interrupted"
    text = out.read_text()
    assert text.startswith("JULIET:") and text.endswith("\n") and len(text) >= 200


@pytest.mark.parametrize("program", ["train.py", "sample.py"])
@pytest.mark.parametrize("closed", ["output", "error"])
def test_a_closed_standard_stream_is_one_line_on_the_other_before_any_work(checkpoint, tmp_path, program, closed):
    """The same mistake, the same status in both programs; with stderr closed, the line goes to stdout, where
    nothing else was written."""
    command = [sys.executable, str(REPO / "train.py"), *TINY] if program == "train.py" \
        else sample_command(checkpoint, "--max-new-tokens", 5)
    redirect = ">&-" if closed == "output" else "2>&-"
    result = subprocess.run(["bash", "-c", " ".join(f"'{arg}'" for arg in command) + f" {redirect}"], cwd=tmp_path,
                            env=ENV, capture_output=True, text=True, timeout=120)
    if closed == "error":
        assert result.stderr == ""
        result.stderr, result.stdout = result.stdout, ""
    assert_one_line_error(result, program, f"standard {closed} is closed")
    assert list(tmp_path.iterdir()) == []


def test_a_closed_stdin_is_not_needed(checkpoint):
    command = " ".join(f"'{arg}'" for arg in sample_command(checkpoint, "--max-new-tokens", 5, "--seed", 1))
    result = subprocess.run(["bash", "-c", f"{command} <&-"], env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and len(result.stderr.splitlines()) == 2, result.stderr


def test_nan_weights_are_one_line(checkpoint, tmp_path):
    contents = torch.load(checkpoint, weights_only=True)
    contents["model"]["lm_head.weight"][3, 1] = math.nan
    path = save_checkpoint(contents, tmp_path / "nan.pt")
    result = subprocess.run(sample_command(path, "--temperature", 0), env=ENV, capture_output=True, text=True,
                            timeout=120)
    assert_one_line_error(result, "sample.py", f"{path} holds NaN or infinite weights (in wte.weight)")
    assert result.stdout == ""


def test_a_folder_of_runs_says_what_to_pass(checkpoint, tmp_path):
    for run in ("2030-01-01_00-00-00", "2030-01-02_00-00-00", "multirun/2030-01-03_00-00-00/0"):
        (tmp_path / "runs" / run).mkdir(parents=True)
        (tmp_path / "runs" / run / "best.pt").write_bytes(checkpoint.read_bytes())
    result = subprocess.run(sample_command(tmp_path / "runs"), env=ENV, capture_output=True, text=True, timeout=120)
    line = assert_one_line_error(result, "sample.py", f"{tmp_path / 'runs'} is no run directory but holds 3 below it",
                                 str(tmp_path / "runs/2030-01-01_00-00-00"), "pass one of them")
    assert "train" not in line


def test_a_vocabulary_beyond_ascii_on_an_ascii_stdout_is_written_with_replacements(tmp_path):
    vocab = CharVocab.from_text("café au lait\n")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(vocab), block_size=16, n_layer=1, n_head=2, n_embd=16))
    path = save_checkpoint(build_checkpoint(model, vocab), tmp_path / "best.pt")
    result = subprocess.run(sample_command(path, "--prompt", "café", "--max-new-tokens", 20),
                            env={**ENV, "PYTHONIOENCODING": "ascii"}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("caf?") and len(result.stdout) == len("café") + 20 + 1
    assert "written as '?'" in result.stderr.splitlines()[1] and "Traceback" not in result.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_stdout_is_one_line(checkpoint):
    with open("/dev/full", "w") as full:
        result = subprocess.run(sample_command(checkpoint, "--max-new-tokens", 5), env=ENV, stdout=full,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    info, error = result.stderr.splitlines()  # the failure comes after the line that names the checkpoint
    assert info.startswith("sampling ") and result.returncode == 1
    assert error == "sample.py: error: cannot write the samples to standard output (No space left on device)"


@pytest.mark.parametrize("args, fragments", [
    (["--seed", 10**23], ["--seed must be in [0, 18446744073709551615], got 100000000000000000000000"]),
    (["--seed", -1], ["--seed must be in [0, "]),
    (["--num-samples", 10**12], ["--num-samples 1000000000000 of", "GiB of KV cache", "use at most"]),
    (["--max-new-tokens", 10**12], ["--max-new-tokens 1000000000000 need", "ask for fewer new tokens"]),
    (["--max-new-tokens", 10**30], ["--max-new-tokens 1000000000000000000000000000000 need", "fewer new tokens"]),
    (["--temperature", 1e-38], ["temperature must be 0 (greedy) or a finite number >= 1e-06, got 1e-38"]),
    (["--temperature", "nan"], ["temperature must be 0 (greedy) or a finite number"]),
    (["--temperature", 0, "--top-k", 5], ["top_k and top_p apply to sampled text: temperature 0 takes the likeliest "
                                          "token whatever they keep"]),
    (["--window", 4, "--kv-cache", "sinks", "--kv-budget", 8], ["window moves the context that the float and "
                                                               "low-bit caches refill; a sink cache keeps its own"]),
])
def test_sample_values_that_cannot_work_are_one_line(checkpoint, args, fragments):
    result = subprocess.run(sample_command(checkpoint, *args), env=ENV, capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, "sample.py", *fragments)
    assert result.stdout == ""


def test_the_largest_seed_is_taken(checkpoint):
    result = subprocess.run(sample_command(checkpoint, "--seed", 2**64 - 1, "--max-new-tokens", 5), env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# --- the model's API ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model() -> GPT:
    return random_model()


@pytest.mark.parametrize("case, argument", [
    ("a cache of another batch size", "cache"), ("a cache shorter than block_size", "cache"),
    ("float idx", "idx"), ("empty idx", "idx"), ("1-D idx", "idx"),
    ("n_pad of the wrong length", "n_pad"), ("n_pad as a (B, 1) tensor", "n_pad"),
    ("negative max_new_tokens", "max_new_tokens"),
])
def test_generate_misuse_is_a_value_error_naming_the_argument(model, case, argument):
    idx, kwargs = random_tokens(2, 4), {}
    if case == "a cache of another batch size":
        kwargs["cache"] = model.new_kv_cache(3)
    elif case == "a cache shorter than block_size":
        c = model.config  # a cache of its own making: model.new_kv_cache refuses fewer slots than block_size
        kwargs["cache"] = RingKVCache(c.n_kv_layer, 2, c.n_kv_head, c.block_size - 1, c.head_dim)
        with pytest.raises(ValueError, match="max_len"):
            model.new_kv_cache(2, max_len=c.block_size - 1)
    elif case == "float idx":
        idx = idx.float()
    elif case == "empty idx":
        idx = idx[:, :0]
    elif case == "1-D idx":
        idx = idx[0]
    elif case == "n_pad of the wrong length":
        kwargs["n_pad"] = [0, 0, 0]
    elif case == "n_pad as a (B, 1) tensor":
        kwargs["n_pad"] = torch.zeros(2, 1, dtype=torch.long)
    max_new_tokens = -1 if case == "negative max_new_tokens" else 2
    with pytest.raises(ValueError, match=f"^{argument} "):
        generate(model, idx, max_new_tokens, sampling=GREEDY, **kwargs)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, 1e-38, -1.0])
def test_a_temperature_that_cannot_work_is_a_value_error(temperature):
    with pytest.raises(ValueError, match="^temperature must be"):
        Sampling(temperature=temperature)


# --- the GPU's code paths, on the CPU -----------------------------------------------------------------------------

@pytest.mark.parametrize("autocast", [False, True], ids=["fp32 activations", "bf16 autocast"])
def test_a_bf16_kv_cache_beside_fp32_weights_decodes_the_same_tokens(model, autocast):
    prompt = random_tokens(2, 5)
    uncached = generate(model, prompt, 40, sampling=GREEDY, use_cache=False)  # fp32 throughout
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        cache = model.new_kv_cache(2, dtype=torch.bfloat16)
        cached = generate(model, prompt, 40, sampling=GREEDY, cache=cache)
    assert cache.dtype == torch.bfloat16 and model.wte.weight.dtype == torch.float32
    assert torch.equal(cached, uncached)  # bf16's rounding does not change this model's argmax


def test_fused_adamw_steps_like_the_unfused_one():
    models = [random_model(seed=1) for _ in range(2)]
    optimizers = [make_optimizers(m, OptimConfig(lr=1e-2), fused=fused)[0] for m, fused in zip(models, (False, True))]
    assert optimizers[1].defaults["fused"] is True
    losses = [[], []]
    for _ in range(3):
        for m, optimizer, trajectory in zip(models, optimizers, losses):
            m.train()
            _, loss = m(random_tokens(4, 8), random_tokens(4, 8, seed=1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            trajectory.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    # The matrices only: the keys' bias has a zero gradient in exact arithmetic (softmax ignores a shift shared
    # by every key), so Adam scales rounding noise there, differently in each implementation.
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        if a.dim() >= 2:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_training_step_and_an_evaluation_in_each_precision(tmp_path, data_root, precision):
    settings = validate(config(tmp_path, data_root, *SHORT, f"train.precision={precision}"))
    data = train.prepare_data(settings)
    model = GPT(dataclasses.replace(settings.model, vocab_size=len(data.vocab)))

    class NoSummaries:
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    trainer = Trainer(settings, model, data, torch.device("cpu"), tmp_path, NoSummaries())
    logits_dtypes = []
    model.register_forward_hook(lambda module, args, out: logits_dtypes.append(out[0].dtype))
    trainer.train_step()
    trainer.train_step()
    trainer.evaluate_and_save()
    expected = torch.bfloat16 if precision == "bf16" else torch.float32
    assert trainer.dtype == expected and set(logits_dtypes) == {expected}  # the steps and evaluation alike
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the weights stay fp32
    assert math.isfinite(trainer.last_val_loss) and trainer.last_val_loss < math.log(65) + 0.5
    assert torch.load(tmp_path / "last.pt", weights_only=True)["training"]["step"] == 2


@pytest.mark.parametrize("device, native_bf16, expected", [
    ("cuda", False, torch.bfloat16), ("cpu", True, torch.bfloat16), ("cpu", False, torch.float32),
    ("mps", True, torch.float32)])
def test_auto_precision_is_bf16_on_a_gpu_and_on_a_cpu_that_multiplies_bf16_natively(monkeypatch, device, native_bf16,
                                                                                     expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert training_dtype("auto", torch.device(device)) == expected
    assert training_dtype("fp32", torch.device(device)) == torch.float32


def test_bf16_training_on_mps_is_refused_in_one_line(tmp_path, data_root):
    settings = validate(config(tmp_path, data_root, *SHORT, "train.precision=bf16"))
    data = train.prepare_data(settings)
    model = GPT(dataclasses.replace(settings.model, vocab_size=len(data.vocab)))
    with pytest.raises(ConfigError, match="^train.precision=bf16 trains on cuda and cpu only; on mps use fp32"):
        Trainer(settings, model, data, torch.device("mps"), tmp_path, None)


@pytest.mark.slow
def test_the_gpu_preset_compiled_trains_a_few_steps_at_a_tiny_size(tmp_path, data_root):
    tiny_gpu = ["preset=gpu", "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=16",
                "train.batch_size=4", "train.sample_tokens=4", *SHORT]
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*tiny_gpu, *data_overrides(data_root), f"runs_dir={tmp_path / 'runs'}"])
    assert cfg.train.compile is True
    val_loss = train.main(cfg, tmp_path / "runs/gpu")
    assert math.isfinite(val_loss)
    assert torch.load(tmp_path / "runs/gpu/last.pt", weights_only=True)["training"]["step"] == 4


@pytest.mark.parametrize("kv_cache, draft", [(None, None), ("int8", None), (None, "lookup")])
def test_the_memory_check_counts_the_cache_the_decoder_really_builds(monkeypatch, kv_cache, draft):
    """The cache as the decoder builds it: in its dtype, with speculative decoding's spare slots for k drafts."""
    from model.decoding.quantize import to_precision
    from sampling.options import check_samples_fit_memory

    model = to_precision(random_model(), "bf16")
    spare = 3 if draft else 0
    cache = model.new_kv_cache(1, max_len=model.config.block_size + spare, dtype=torch.int8 if kv_cache else None)
    need = cache.nbytes + (1 + 10) * 8  # a one-token prompt, 10 more
    assert cache.dtype == (torch.int8 if kv_cache else torch.float32)  # float32 on the CPU, even at bf16
    args = argparse.Namespace(num_samples=1, max_new_tokens=10, kv_cache=kv_cache, draft=draft,
                              speculate_k=spare or None)
    for memory, fits in ((2 * need, True), (2 * need - 2, False)):  # sample.py may use half of it
        monkeypatch.setattr(os, "sysconf", lambda name: memory if name == "SC_PHYS_PAGES" else 1)
        if fits:
            check_samples_fit_memory(args, 1, model, torch.device("cpu"))
        else:
            with pytest.raises(UsageError, match="need 0.0 GiB of KV cache and tokens"):
                check_samples_fit_memory(args, 1, model, torch.device("cpu"))


@pytest.mark.parametrize("error, status, fragment", [
    ("ENOSPC", 1, "free some space, or give data.root another disk"),  # the machine failed
    ("EACCES", 2, "give data.root a writable folder"),  # the folder chosen cannot be written: a mistake
], ids=["a full disk", "a read-only folder"])
def test_a_failure_while_preparing_the_data_is_one_line_with_its_status(tmp_path, error, status, fragment):
    """The text's encoding fails as it is written: a full disk is the machine's failure (status 1), a folder that
    cannot be written the user's (status 2), one line either way."""
    text = corpus.write_corpus(tmp_path / "text.txt")
    script = f"""
import errno, runpy, sys
sys.path.insert(0, {str(REPO)!r})
import data.prepare
def failing(*args, **kwargs):
    raise OSError(errno.{error}, "{error}", "train.bin")
data.prepare._encode = failing
sys.argv = ["train.py", *{[*TINY, *SHORT, f"data.text={text}", f"data.root={tmp_path / 'prepared'}",
                            f"hydra.run.dir={tmp_path / 'run'}"]!r}]
runpy.run_path({str(REPO / "train.py")!r}, run_name="__main__")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, env=ENV)
    assert_one_line_error(result, "train.py", "cannot prepare the data", fragment, status=status)


@pytest.mark.parametrize("flag", ["--help", "--hydra-help"])
def test_a_reader_that_stops_early_ends_train_py_quietly(flag):
    """`train.py --help | head`: the pipe closes before the help is written; nothing more was wanted, so no error."""
    process = subprocess.Popen([sys.executable, str(REPO / "train.py"), flag], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=ENV, cwd=REPO)
    process.stdout.close()  # the reader is gone before the first line
    stderr = process.stderr.read().decode()
    assert process.wait() == 0 and stderr == "", stderr
