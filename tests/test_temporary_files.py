"""Half-written temporary files: each named after its writer, and removed only once that writer is dead."""

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import train
from test_train import config
from runtime.files import remove_stale_temporaries, write_atomically
from programs import SHORT, data_root, short_run


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
