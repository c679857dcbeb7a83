"""Atomic file writes: a reader sees the old file or the new one, never half of one. And a file that one process
at a time may take up and write (locked)."""

import contextlib
import errno
import fcntl
import os
import re
import socket
import stat
import tempfile
import uuid
from pathlib import Path

# A temporary file's name says which process wrote it: .<name>.<host>-<pid>.<hex>.tmp beside the target
_TEMPORARY = re.compile(r"\..+\.(?P<host>[^.]+)-(?P<pid>\d+)\.[0-9a-f]{32}\.tmp")


def _writer() -> str:
    return f"{socket.gethostname().replace('.', '_')}-{os.getpid()}"


def write_atomically(path, write) -> Path:
    """Call write(file) on a temporary file beside `path`, then rename it to `path`; on any error remove it.

    The temporary file is created like any other file (mode 0666 less the umask), under a name no other
    writer uses, and synced to disk before the rename, so that a crash leaves the previous file intact.
    A process killed mid-write leaves its temporary file; remove_stale_temporaries() clears it later."""
    path = Path(path)
    tmp = _temporary(path)
    try:
        with open(tmp, "xb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{_writer()}.{uuid.uuid4().hex}.tmp")


def cannot_write_atomically(path) -> OSError | None:
    """The error that write_atomically(path) would meet now making its temporary file (a read-only folder, a
    name too long once the temporary's suffix is added), or None: asked before work whose result is saved there at
    the end."""
    tmp = _temporary(Path(path))
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as e:
        return e
    tmp.unlink(missing_ok=True)
    return None


def link_loop(path) -> OSError | None:
    """stat's error where path's links lead round in a loop, else None. Path.resolve raises on a loop only before
    Python 3.13, so stat asks."""
    try:
        os.stat(path)
    except OSError as e:
        return e if e.errno == errno.ELOOP else None
    return None


def special_kind(path) -> str | None:
    """What is at path when it is no regular file, links followed: a folder, a pipe, a socket or a device; None
    for a regular file or nothing at all. Asked with stat, which opens nothing (opening a pipe waits for a
    writer)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # nothing there: a file to be made
        return None
    kinds = ((stat.S_ISREG, None), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a pipe (FIFO)"),
             (stat.S_ISSOCK, "a socket"))
    return next((kind for is_kind, kind in kinds if is_kind(mode)), "a device")


class Locked(Exception):
    """The file is locked by another process, whose id is `holder` (None: unknown)."""

    def __init__(self, path: Path, holder: int | None):
        super().__init__(f"{path} is locked by process {holder}")
        self.path, self.holder = path, holder


@contextlib.contextmanager
def locked(path):
    """While inside, this process alone holds `path`: an flock on .<name>.lock beside it, which says the holder's
    process id and is removed on leaving. Locked if another process holds it. A process that dies lets go of its
    lock with it: the file it leaves is taken over."""
    path = Path(path)
    lock = path.with_name(f".{path.name}.lock")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 20).decode(errors="replace")
            os.close(fd)
            raise Locked(path, int(holder) if holder.isdigit() else None) from None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break  # the file locked is still the one named .<name>.lock: not removed by a holder as it left
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield path
    finally:
        lock.unlink(missing_ok=True)  # before letting go: whoever waits on this file then takes a new one
        os.close(fd)


def cannot_make_a_file_in(folder) -> OSError | None:
    """The error that making a file in folder raises now (read-only, full, a file system that takes none), or
    None if one can be made: asked before work whose result is saved there at the end."""
    try:
        tempfile.TemporaryFile(dir=folder).close()  # nameless where the system can: nothing is left behind
    except OSError as e:
        return e
    return None


def remove_stale_temporaries(folder) -> list[Path]:
    """Remove the temporary files in folder that write_atomically left behind in processes that died (killed
    mid-write), and return them. Only the files of this host's processes are judged: a live writer elsewhere on
    a shared file system keeps its own."""
    removed = []
    host = _writer().rsplit("-", 1)[0]
    for path in Path(folder).glob(".*.tmp"):
        match = _TEMPORARY.fullmatch(path.name)
        if match and match["host"] == host and not _alive(int(match["pid"])):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True
