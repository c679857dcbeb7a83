"""The standard streams of a command: refused when closed at the start, every write whole or an error, a write
that fails said as an OutputError, and a stream whose reader has gone pointed away so that the exit stays quiet."""

import contextlib
import io
import os
import sys

from tqdm import tqdm

from runtime.errors import OutputError, UsageError


def ready_standard_streams() -> None:
    """A standard output or error closed at the start (`>&-`, `2>&-`) is refused before any work: with stderr
    closed, print() would send the errors and the summary to stdout, among the results. Then every write to
    standard output is made whole or an error (whole_writes)."""
    for name, stream in (("output", sys.stdout), ("error", sys.stderr)):
        if stream is None:
            raise UsageError(f"standard {name} is closed; send it to a file or a pipe")
    sys.stdout = whole_writes(sys.stdout)


def whole_writes(stream: io.TextIOWrapper) -> io.TextIOWrapper:
    """The stream, each of its writes whole or an error. Unbuffered (PYTHONUNBUFFERED, python -u), Python hands
    text straight to the file and drops what a short write leaves (a disk that fills, a file-size limit) with no
    error; WholeFile writes the rest, and so meets the error. Buffered streams write the rest already."""
    if not isinstance(getattr(stream, "buffer", None), io.RawIOBase):
        return stream
    return io.TextIOWrapper(WholeFile(stream.fileno()), encoding=stream.encoding, errors=stream.errors,
                            line_buffering=stream.line_buffering, write_through=True)


class WholeFile(io.RawIOBase):
    """An open file descriptor, unbuffered, whose write() writes every byte or raises (os.write may write part)."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return os.isatty(self.fd)

    def write(self, data) -> int:
        rest = memoryview(data).cast("B")
        try:
            while rest:
                rest = rest[os.write(self.fd, rest):]
        except OSError as e:
            e.filename = "standard output"  # what failed, for a message that reaches the user as it is
            raise
        return len(data)


def flush_standard_output() -> None:
    """Write what standard output holds (--help's text, ...) now: a write that fails is then an OutputError, where
    at exit it would be Python's 'Exception ignored' with status 120. A reader that stopped early is no error."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: nothing more was wanted
        silence(sys.stdout)
    except OSError as e:
        raise unwritable_output(e) from None


def unwritable_output(error: OSError) -> OutputError:
    """The error for a write to standard output that failed."""
    return OutputError(f"cannot write to standard output ({error.strerror or error})")


def silence(stream) -> None:
    """Point a standard stream at /dev/null, so that the flush at exit does not fail again on what it holds."""
    if stream is not None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def write_line(text: str) -> None:
    """Print a line on standard output now (around a progress bar, if one is shown); an OutputError if it
    cannot be written."""
    try:
        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()
    except OSError as e:
        raise unwritable_output(e) from None


@contextlib.contextmanager
def waiting_on(what: str):
    """While inside, a terminal's stderr shows what the command waits for, on a line that is cleared at the end;
    a pipe or a file gets nothing, so that logs hold only what happened."""
    show_status(f"{what}…")
    try:
        yield
    finally:
        show_status("")


def show_status(line: str) -> None:
    """Replace the status line on a terminal's stderr with line ("": clear it); elsewhere do nothing."""
    try:
        if sys.stderr is not None and sys.stderr.isatty():
            sys.stderr.write(f"\r\x1b[2K{line}")
            sys.stderr.flush()
    except (OSError, ValueError):  # a terminal that hung up: the status was only a courtesy
        pass
