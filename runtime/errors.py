"""How train.py and sample.py end on an error: one line on stderr, and an exit status that says whose fault it was.

    2    a mistake in the command line, the settings or the inputs: fix the command
    1    the machine failed (a full disk, a closed output, a run that diverged): the command was right
    130  interrupted (Ctrl-C, a second SIGTERM)
    143  stopped by SIGTERM where the command stops as the signal asks (export.py): 128 + the signal's number

Code anywhere raises its own exception with a message that says what is wrong and what to do; only the entry
points turn it into a line and a status, here.
"""

import argparse
import io
import os
import signal
import sys
import time

from tqdm import tqdm

from data import DataError


USAGE, FAILURE, INTERRUPTED = 2, 1, 130
QUIET_EXIT_DELAY_S = 2.0  # how long a process that leaves the report to another waits before it exits (fail)


class UsageError(Exception):
    """A mistake in a command line or its inputs, found by an entry point."""


class ConfigError(Exception):
    """A setting that cannot work, found before any training."""


class CheckpointError(Exception):
    """A checkpoint that is missing, unreadable, unsafe or not this project's."""


class OutputError(Exception):
    """What a run writes (a checkpoint, its events, standard output) cannot be written: a full disk, a closed pipe,
    a run directory removed."""


class Interrupted(KeyboardInterrupt):
    """A stop signal (SIGINT, SIGTERM, SIGHUP) ended the command: its exit status is 128 + the signal's number."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.status = 128 + signal.Signals[signal_name]


def loaded(module: str, name: str) -> type:
    """An exception class of a module that train.py loads (hydra, omegaconf), or one no error is: sample.py never
    imports hydra, so none of its errors can reach it."""
    return getattr(sys.modules.get(module), name, NoSuchError)


class NoSuchError(Exception):
    """Stands for an exception class whose module is not loaded."""


def mistakes() -> tuple[type, ...]:
    """What the user can fix: exit status 2. Hydra's and OmegaConf's errors are a bad override or config option."""
    return (UsageError, ConfigError, CheckpointError, DataError, loaded("hydra.errors", "HydraException"),
            loaded("omegaconf.errors", "OmegaConfBaseException"))


def one_line(error: BaseException) -> str:
    """The error's whole message on one line (library messages span several)."""
    if isinstance(error, loaded("hydra.errors", "MissingConfigException")) and error.options:
        group, _, option = error.missing_cfg_file.rpartition("/")  # its message goes on with Hydra's search path
        return f"{group}={option} is not an option; choose one of {', '.join(error.options)}"
    if isinstance(error, loaded("hydra.errors", "HydraException")) and \
            isinstance(error.__cause__, loaded("omegaconf.errors", "OmegaConfBaseException")):
        error = error.__cause__  # what is wrong with an override, rather than Hydra's advice on overriding
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}: {os.fsdecode(error.filename)}" if error.filename else error.strerror
    return " ".join(str(error).split()) or type(error).__name__


def exit_status(error: BaseException) -> int:
    if isinstance(error, KeyboardInterrupt):
        return error.status if isinstance(error, Interrupted) else INTERRUPTED
    return USAGE if isinstance(error, mistakes()) else FAILURE


def fail(prog: str, error: BaseException, *, speak: bool = True):
    """Report error as `prog: error: <one line>` on stderr (unless speak is False: another process already
    does) and exit with its status."""
    try:  # what stdout holds goes before the error; if it cannot, it is dropped, or it would fail again at exit
        sys.stdout.flush()
    except (OSError, ValueError, AttributeError):
        silence(sys.stdout)
    if not speak:  # torchrun stops every process once one exits: the speaking one must get to its line first
        time.sleep(QUIET_EXIT_DELAY_S)
    if speak:
        message = "interrupted" if isinstance(error, KeyboardInterrupt) else one_line(error)
        stream = sys.stderr if sys.stderr is not None else sys.stdout  # closed stderr: refused before any output
        try:
            if stream is not None:
                print(f"{prog}: error: {message}", file=stream, flush=True)
        except (OSError, ValueError):  # a full or closed stream: the status alone tells
            silence(stream)
    sys.exit(exit_status(error))


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


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, whose mistakes are one line with status 2 like every other error, not the usage block first."""

    def error(self, message):
        self.exit(USAGE, f"{self.prog}: error: {message}\n")

    def print_help(self, file=None):
        """argparse ignores a failed write of --help's text; here it is raised, to be reported."""
        (file or sys.stdout).write(self.format_help())


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value
