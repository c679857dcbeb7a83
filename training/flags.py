"""train.py's flags (--cfg, -m, --info, ...), read by Hydra's own parser as hydra.main will read them: a mistake is
one line before Hydra starts, rather than argparse's usage block or Hydra's traceback later."""

import argparse
import logging
import sys

from hydra._internal.utils import get_args_parser

from runtime.errors import UsageError, unwritable_output


def read_flags(argv: list[str]) -> argparse.Namespace:
    """The flags of argv, checked; with --info, its text fails as --cfg's does where it cannot be written."""
    parser = get_args_parser()

    def error(message):
        raise UsageError(f"{message}; python train.py --help lists the flags, which go before the overrides")

    parser.error = error
    args = parser.parse_args(argv)
    if args.info is not None:
        raise_logging_errors()
    return args


def raise_logging_errors() -> None:
    """Hydra writes --info's text through logging, whose handlers print a traceback for each record they cannot
    write and go on: raised instead, a closed pipe ends --info quietly and a full disk in one line."""
    def handle_error(handler, record):
        error = sys.exc_info()[1]  # emit() calls this while handling the error
        if isinstance(error, OSError) and not isinstance(error, BrokenPipeError):
            raise unwritable_output(error) from None
        raise error

    logging.Handler.handleError = handle_error
