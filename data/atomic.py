"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

import os
import tempfile
from pathlib import Path


def write_atomically(path, write) -> Path:
    """Call write(file) on a temporary file beside `path`, then rename it to `path`; on any error remove it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file private; give it an ordinary file's mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
