"""Signals: a hangup, Ctrl-C or SIGTERM stops train.py and sample.py cleanly, keeping what they saved or wrote."""

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch

import corpus
from test_train import TINY, data_overrides
from programs import ENV, REPO, SHORT, checkpoint, child_signal, data_root, sample_command

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow


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


def test_sigterm_as_the_first_line_appears_saves_the_run_it_names(tmp_path, data_root):
    """The first line names the run directory: from then on a stop saves last.pt there, with status 0."""
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, str(REPO / "train.py"), *TINY, *data_overrides(data_root),
                                "train.max_iters=100000", "train.eval_interval=50000", f"hydra.run.dir={run_dir}"],
                               cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=child_signal(signal.SIGTERM))
    try:
        line = process.stdout.readline()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert line.startswith("training ") and process.returncode == 0, stderr
    assert stderr == f"stopped by SIGTERM at step 0: saved {run_dir / 'last.pt'}; continue with the same command " \
                     f"plus train.resume={run_dir}\n", stderr


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
    assert (not root.exists() or list(root.rglob("*")) == []) and not (tmp_path / "runs").exists()


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
