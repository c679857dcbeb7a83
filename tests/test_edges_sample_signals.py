"""SIGTERM and SIGHUP stop sample.py as Ctrl-C does, at every moment once it runs: the text written so far stays,
an --interactive session is saved, and the exit status is 128 + the signal's number."""

import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from programs import ENV, checkpoint, child_signal, sample_command  # noqa: F401  checkpoint: a fixture
from test_sample import VOCAB
from test_sample_sessions_and_lines import models  # noqa: F401  models: a fixture

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow

STOPS = [signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])]
LINUX = Path("/proc/self/status").exists()


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler of its own for signum (the kernel's SigCgt mask)."""
    with open(f"/proc/{pid}/status") as status:
        caught = next(line for line in status if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


def started(command: list, signum: int, **streams) -> subprocess.Popen:
    return subprocess.Popen(command, env=ENV, text=True, preexec_fn=child_signal(signum), **streams)


def stopped(process: subprocess.Popen, signum: int, stdin: str | None = None) -> tuple[str, str]:
    """Send signum to process and return its stdout and stderr; it must end within 120 s."""
    process.send_signal(signum)
    try:
        return process.communicate(stdin, timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def wait_until(condition, what: str, process: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{what} did not happen: {process.communicate()}")
        time.sleep(0.01)


def assert_stopped_by(process: subprocess.Popen, stderr: str, signum: int) -> None:
    assert process.returncode == 128 + signum, (process.returncode, stderr)
    assert "Traceback" not in stderr and stderr.splitlines()[-1] == "sample.py: error: interrupted", stderr


@pytest.mark.skipif(not LINUX, reason="reads when the handler is set from /proc")
@pytest.mark.parametrize("signum", STOPS, ids=lambda s: signal.Signals(s).name)
def test_a_stop_signal_as_soon_as_sample_py_catches_it_ends_it_with_the_signal_s_status(checkpoint, signum):
    """Sent while the modules load (the first moment a handler is set): one line, no traceback, no text."""
    process = started(sample_command(checkpoint, "--no-compile"), signum, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
    wait_until(lambda: catches(process.pid, signum), "setting a handler", process)
    stdout, stderr = stopped(process, signum)
    assert_stopped_by(process, stderr, signum)
    assert stdout == ""


@pytest.mark.parametrize("signum", STOPS[:1], ids=lambda s: signal.Signals(s).name)
def test_a_stop_signal_while_sampling_keeps_the_text_written_so_far(checkpoint, tmp_path, signum):
    out = tmp_path / "sample.txt"
    with open(out, "w") as file:
        process = started(sample_command(checkpoint, "--max-new-tokens", 10**8, "--prompt", "JULIET:",
                                         "--no-compile"), signum, stdout=file, stderr=subprocess.PIPE)
        wait_until(lambda: out.stat().st_size >= 200, "writing 200 characters", process)
        _, stderr = stopped(process, signum)
    assert_stopped_by(process, stderr, signum)
    text = out.read_text()
    assert text.startswith("JULIET:") and text.endswith("\n") and len(text) >= 200


@pytest.mark.parametrize("signum", STOPS[-1:], ids=lambda s: signal.Signals(s).name)
def test_a_stop_signal_while_a_new_session_waits_for_its_first_line_saves_it(models, tmp_path, signum):
    session = tmp_path / "chat.pt"
    process = started(sample_command(models["model"], "--interactive", "--temperature", 0, "--session", session,
                                     "--prompt", "Citizens:"), signum,
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in process.stderr:
        if line.startswith("type a line"):
            break
    shown = process.stdout.read(len("Citizens:"))  # the text so far, written once the banner is: now it waits
    stdout, stderr = stopped(process, signum)
    assert_stopped_by(process, stderr, signum)
    assert f"saved the session, 9 tokens and their cache, to {session}" in stderr
    assert VOCAB.decode(torch.load(session, weights_only=True)["tokens"].tolist()) == "Citizens:" == shown + stdout


@pytest.mark.parametrize("signum", STOPS, ids=lambda s: signal.Signals(s).name)
def test_a_stop_signal_during_a_reply_saves_the_session_with_every_character_shown(models, tmp_path, signum):
    """Sent as the reply's first character shows (the reply may go on, or have ended at a blank line): the text
    saved is the text shown, to the character, with the line typed."""
    session = tmp_path / "chat.pt"
    process = started(sample_command(models["model"], "--interactive", "--temperature", 0, "--session", session,
                                     "--max-new-tokens", 10**6, "--no-compile"), signum,
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    shown = []
    reader = threading.Thread(target=lambda: shown.extend(iter(lambda: process.stdout.read(1), "")), daemon=True)
    reader.start()
    process.stdin.write("First Citizen:\n")
    process.stdin.flush()
    prompt, line = "\n", "First Citizen:\n"  # the default prompt, and the line typed (the terminal shows it)
    wait_until(lambda: len(shown) > len(prompt), "the reply's first character", process)
    process.send_signal(signum)
    process.wait(timeout=120)
    reader.join(timeout=60)
    stderr = process.stderr.read()
    assert_stopped_by(process, stderr, signum)
    reply = "".join(shown).removeprefix(prompt)
    assert reply and "".join(shown) == prompt + reply
    assert VOCAB.decode(torch.load(session, weights_only=True)["tokens"].tolist()) == prompt + line + reply
