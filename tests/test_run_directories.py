"""Where a training run writes: a directory of its own, never another run's, none left when it is refused or fails."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import runtime.checkpoint
import training.runs
from test_train import TINY, data_overrides
from runtime.checkpoint import CheckpointError
from training.runs import new_run_dir
from programs import ENV, REPO, SHORT, assert_one_line_error, data_root, train_cli, tree

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow


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


def test_a_sweep_runs_its_possible_jobs_and_names_the_impossible_one(tmp_path, data_root):
    result = train_cli("-m", *TINY, *SHORT, *data_overrides(data_root), "optim.lr=1e-2,-1,5e-3", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("train.py: error: job 1 (") and "optim.lr=-1" in lines[0], result.stderr
    assert lines[0].endswith("optim.lr must be a positive number from 1.18e-38 to 3.4e+38, got -1.0")
    (sweep,) = (tmp_path / "runs/multirun").iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "2"]  # job 1's directory removed
    assert all((sweep / job / "last.pt").is_file() for job in ("0", "2"))


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
    assert not (tmp_path / "runs").exists()  # its directory, and runs/ made for it, went again
    with pytest.raises(CheckpointError):
        runtime.checkpoint.find_latest_checkpoint(tmp_path / "runs")


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


def test_a_run_whose_reader_is_gone_by_its_first_evaluation_leaves_no_directory(tmp_path, data_root):
    """`train.py | head -c 10`: the first lines are read, then the evaluation before the first step cannot write."""
    script = f"""
import os, runpy, sys
sys.path.insert(0, {str(REPO)!r})
from training.loop import Trainer
original = Trainer.evaluate_and_save

def with_the_reader_gone(self):
    reading, writing = os.pipe()
    os.close(reading)
    os.dup2(writing, sys.stdout.fileno())
    return original(self)
Trainer.evaluate_and_save = with_the_reader_gone
sys.argv = ["train.py", *{[*TINY, *SHORT, *data_overrides(data_root)]!r}]
runpy.run_path({str(REPO / "train.py")!r}, run_name="__main__")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                            timeout=180)
    assert_one_line_error(result, "train.py", "cannot write to standard output (Broken pipe)", status=1)
    assert not (tmp_path / "runs").exists()
