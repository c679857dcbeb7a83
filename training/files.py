"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

import os
import uuid
from pathlib import Path


def write_atomically(path, write) -> Path:
    """Call write(file) on a temporary file beside `path`, then rename it to `path`; on any error remove it.

    The temporary file is created like any other file (mode 0666 less the umask), under a name no other
    writer uses, and synced to disk before the rename, so that a crash leaves the previous file intact."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
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
