"""The errors a command ends on, and the exit status that says whose fault each was.

    2    a mistake in the command line, the settings or the inputs: fix the command
    1    the machine failed (a full disk, a closed output, a run that diverged): the command was right
    130  interrupted (Ctrl-C, a second SIGTERM)
    143  stopped by SIGTERM where the command stops as the signal asks (export.py): 128 + the signal's number

Code anywhere raises its own exception with a message that says what is wrong and what to do; only the entry
points turn it into a line and a status (runtime/command.py: run_command).
"""

import argparse
import math
import os
from decimal import Decimal, InvalidOperation
import signal
import sys

from data import DataError


USAGE, FAILURE, INTERRUPTED = 2, 1, 130


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
        self.signal_name = signal_name
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


def float_as_written(text: str) -> float:
    """An argparse type: a float that holds the number written. One that rounds to 0 (1e-400) or to infinity
    (1e400) is refused, so that no option means what its value does not say."""
    try:
        value, written = float(text), Decimal(text.strip())
    except (ValueError, InvalidOperation):
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if value == 0 and written != 0:
        raise argparse.ArgumentTypeError(f"{text} rounds to 0 in a float, whose smallest is about 5e-324: give a "
                                         f"value it holds")
    if math.isinf(value) and written.is_finite():
        raise argparse.ArgumentTypeError(f"{text} is beyond a float's range (about 1.8e308)")
    return value
