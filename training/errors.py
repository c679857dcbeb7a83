"""How train.py and sample.py end on an error: one line on stderr, and an exit status that says whose fault it was.

    2    a mistake in the command line, the settings or the inputs: fix the command
    1    the machine failed (a full disk, a closed output, a run that diverged): the command was right
    130  interrupted (Ctrl-C, a second SIGTERM)

Code anywhere raises its own exception with a message that says what is wrong and what to do; only the entry
points turn it into a line and a status, here.
"""

import sys

from data import DataError

from .config import ConfigError

USAGE, FAILURE, INTERRUPTED = 2, 1, 130


class UsageError(Exception):
    """A mistake in a command line or its inputs, found by an entry point."""


class CheckpointError(Exception):
    """A checkpoint that is missing, unreadable, unsafe or not this project's (training/checkpoint.py)."""


MISTAKES = (UsageError, ConfigError, CheckpointError, DataError)  # what the user can fix: exit status 2


def one_line(error: BaseException) -> str:
    """The error's whole message on one line (library messages span several)."""
    return " ".join(str(error).split()) or type(error).__name__


def exit_status(error: BaseException) -> int:
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED
    return USAGE if isinstance(error, MISTAKES) else FAILURE


def fail(prog: str, error: BaseException, *, speak: bool = True):
    """Report error as `prog: error: <one line>` on stderr (unless speak is False: another process already
    does) and exit with its status."""
    if speak:
        message = "interrupted" if isinstance(error, KeyboardInterrupt) else one_line(error)
        print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(exit_status(error))
