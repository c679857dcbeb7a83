"""How every entry point runs: run_command readies the standard streams, runs the command, and ends a mistake,
a failed write or a stop signal in one line on stderr with the status that says whose fault it was
(runtime/errors.py)."""

import sys
import time
from typing import Callable

from runtime.errors import OutputError, exit_status, mistakes, one_line
from runtime.streams import flush_standard_output, ready_standard_streams, silence

QUIET_EXIT_DELAY_S = 2.0  # how long a process that leaves the report to another waits before it exits (fail)


def run_command(prog: str, command: Callable[[], None], *, ends: tuple = (), speak: bool = True) -> None:
    """Run command() with the standard streams readied, and what it leaves on standard output flushed (--help's
    text too). A reader that stopped early (`| head`) ends it quietly. A mistake, a failed write, an OSError, a
    stop signal, or an error in `ends` is one line and its status (fail)."""
    try:
        ready_standard_streams()
        try:
            command()
        finally:
            flush_standard_output()
    except BrokenPipeError:  # nothing more is wanted
        silence(sys.stdout)
    except (*mistakes(), OutputError, OSError, KeyboardInterrupt, *ends) as e:
        fail(prog, e, speak=speak)


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
