"""train.py's flags (--cfg, -m, --info, ...), read by Hydra's own parser as hydra.main will read them: a mistake is
one line before Hydra starts, rather than argparse's usage block or Hydra's traceback later."""

import argparse
import contextlib
import io
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
    check_together(args)
    if args.info is not None:
        raise_logging_errors()
    return args


def check_together(args: argparse.Namespace) -> None:
    """Refuse the flags that cannot apply, or cannot go together: Hydra ignores some, and refuses others with
    status 1, as if the machine had failed."""
    if args.experimental_rerun is not None:
        raise UsageError("--experimental-rerun reruns a job from a pickle that train.py never saves; continue a run "
                         "with train.resume=RUN")
    if args.package is not None and args.cfg is None:
        raise UsageError("--package applies to --cfg, which shows that part of the config; add --cfg job, or drop "
                         "--package")
    if args.resolve and args.cfg is None and not args.help:
        raise UsageError("--resolve applies to --cfg and --help, which show the config; add --cfg job, or drop "
                         "--resolve")
    if args.help or args.hydra_help:  # Hydra shows the help, whatever else is asked
        return
    commands = [flag for flag, given in (("--run", args.run), ("--multirun", args.multirun),
                                         ("--cfg", args.cfg is not None), ("--info", args.info is not None),
                                         ("--shell-completion", args.shell_completion)) if given]
    if len(commands) > 1:
        raise UsageError(f"{' and '.join(commands)} cannot go together: each says what train.py does; give one")
    subcommands = [override.split("=")[0] for override in args.overrides
                   if override.split("=")[0] in ("install", "uninstall", "query")]
    if args.shell_completion and len(subcommands) != 1:
        raise UsageError(f"--shell-completion takes one of install=SHELL, uninstall=SHELL or query=LINE, got "
                         f"{' and '.join(subcommands) or 'none'}; python train.py --hydra-help shows how")


@contextlib.contextmanager
def package_found(args: argparse.Namespace):
    """Hydra tells of a --package that names nothing by a line on stderr and status 1: here it is a mistake, one
    line with status 2. What else Hydra writes on stderr meanwhile is written after."""
    if args.cfg is None or args.package is None:
        yield
        return
    told, refused = io.StringIO(), False
    try:
        with contextlib.redirect_stderr(told):
            yield
    except SystemExit as e:
        refused = e.code == 1 and told.getvalue() == f"package '{args.package}' not found in config\n"
        if refused:
            raise UsageError(f"--package {args.package} names nothing the --cfg {args.cfg} config shows (no such "
                             f"section or setting, or it is null); python train.py --cfg {args.cfg} lists them") \
                from None
        raise
    finally:
        if not refused:
            sys.stderr.write(told.getvalue())


def raise_logging_errors() -> None:
    """Hydra writes --info's text through logging, whose handlers print a traceback for each record they cannot
    write and go on: raised instead, a closed pipe ends --info quietly and a full disk in one line."""
    def handle_error(handler, record):
        error = sys.exc_info()[1]  # emit() calls this while handling the error
        if isinstance(error, OSError) and not isinstance(error, BrokenPipeError):
            raise unwritable_output(error) from None
        raise error

    logging.Handler.handleError = handle_error
