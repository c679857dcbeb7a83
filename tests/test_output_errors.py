"""Writing where it cannot: a full disk, a closed pipe or standard stream, an unusable folder, each told in one line."""

import errno
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import corpus
import training.runs
from data import CharVocab
from model import GPTConfig, build_model
from test_train import TINY, data_overrides
from runtime.checkpoint import build_checkpoint, save_checkpoint
from training.config import ConfigError
from runtime.errors import one_line
from training.runs import new_run_dir
from programs import ENV, REPO, SHORT, assert_one_line_error, checkpoint, data_root, sample_command, train_cli

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow


@pytest.mark.parametrize("where, fragments", [
    ("runs_dir=a-file", ["runs_dir=a-file is a file, not a folder"]),
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


def test_a_read_only_runs_dir_is_one_line(tmp_path, monkeypatch):
    def read_only(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    (tmp_path / "runs").mkdir()
    monkeypatch.setattr(training.runs.os, "mkdir", read_only)
    with pytest.raises(ConfigError, match=r"^runs_dir: cannot create a run directory in .*runs \(Permission denied\)"):
        new_run_dir(tmp_path / "runs")


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


def test_a_failure_while_the_config_is_first_written_leaves_no_directory(tmp_path):
    script = f"""
import errno, runpy, sys
sys.path.insert(0, {str(REPO)!r})
import training.runs
def save_on_a_full_disk(node, name, folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("")
    raise OSError(errno.ENOSPC, "No space left on device", str(folder / name))
training.runs.write_record = save_on_a_full_disk
sys.argv = ["train.py", *{TINY!r}]
runpy.run_path({str(REPO / "train.py")!r}, run_name="__main__")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                            timeout=120)
    assert_one_line_error(result, "train.py", "No space left on device", status=1)
    assert not (tmp_path / "runs").exists()  # the run directory, and runs/ made for it, went again


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
    assert not (tmp_path / "runs").exists()  # it failed before its first step: nothing of it is left


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_stdout_is_one_line(checkpoint):
    with open("/dev/full", "w") as full:
        result = subprocess.run(sample_command(checkpoint, "--max-new-tokens", 5), env=ENV, stdout=full,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    info, error = result.stderr.splitlines()  # the failure comes after the line that names the checkpoint
    assert info.startswith("sampling ") and result.returncode == 1
    assert error == "sample.py: error: cannot write the samples to standard output (No space left on device)"


@pytest.mark.parametrize("flag", ["--help", "--hydra-help"])
def test_a_reader_that_stops_early_ends_train_py_quietly(flag):
    """`train.py --help | head`: the pipe closes before the help is written; nothing more was wanted, so no error."""
    process = subprocess.Popen([sys.executable, str(REPO / "train.py"), flag], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=ENV, cwd=REPO)
    process.stdout.close()  # the reader is gone before the first line
    stderr = process.stderr.read().decode()
    assert process.wait() == 0 and stderr == "", stderr


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


def test_a_vocabulary_beyond_ascii_on_an_ascii_stdout_is_written_with_replacements(tmp_path):
    vocab = CharVocab.from_text("café au lait\n")
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=len(vocab), block_size=16, n_layer=1, n_head=2, n_embd=16))
    path = save_checkpoint(build_checkpoint(model, vocab), tmp_path / "best.pt")
    result = subprocess.run(sample_command(path, "--prompt", "café", "--max-new-tokens", 20),
                            env={**ENV, "PYTHONIOENCODING": "ascii"}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("caf?") and len(result.stdout) == len("café") + 20 + 1
    assert "written as '?'" in result.stderr.splitlines()[1] and "Traceback" not in result.stderr
