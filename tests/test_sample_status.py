"""What sample.py waits for, shown on a terminal while it waits: the modules loading, the checkpoint, the timing of
thread counts. Each status line is cleared when its wait ends; a pipe or a file gets none of it."""

import io
import os
import pty
import subprocess

import pytest

from programs import ENV, checkpoint, sample_command  # noqa: F401  checkpoint: a fixture
from runtime.streams import show_status, waiting_on

CLEAR = "\r\x1b[2K"  # carriage return, then erase the line: what a terminal shows next starts on a clean line


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream, shown", [(Terminal(), f"{CLEAR}loading x…{CLEAR}"), (io.StringIO(), "")])
def test_a_wait_is_shown_and_cleared_on_a_terminal_alone(monkeypatch, stream, shown):
    monkeypatch.setattr("sys.stderr", stream)
    with waiting_on("loading x"):
        pass
    assert stream.getvalue() == shown


def test_a_terminal_that_hung_up_ends_no_wait(monkeypatch):
    class HungUp(Terminal):
        def write(self, text):
            raise OSError(5, "Input/output error")

    monkeypatch.setattr("sys.stderr", HungUp())
    show_status("loading x…")  # no error


def read_all(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_sample_py_says_on_a_terminal_what_it_waits_for_and_clears_it(checkpoint):
    leader, follower = pty.openpty()
    process = subprocess.Popen(sample_command(checkpoint, "--max-new-tokens", 5, "--no-compile", "--seed", 1),
                               env=ENV, stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    seen = read_all(leader)
    process.wait(timeout=120)
    os.close(leader)
    assert process.returncode == 0, seen
    assert seen.startswith("loading torch…") and f"{CLEAR}loading {checkpoint}…{CLEAR}" in seen, seen
    after_last_clear = seen.rsplit(CLEAR, 1)[1]
    assert "…" not in after_last_clear and after_last_clear.startswith("sampling "), seen
    piped = subprocess.run(sample_command(checkpoint, "--max-new-tokens", 5, "--no-compile", "--seed", 1), env=ENV,
                           capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and "…" not in piped.stderr and "\x1b" not in piped.stderr, piped.stderr
