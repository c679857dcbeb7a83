"""Which signals stop a command, and the two moments an entry point handles them itself: while its modules load,
and as Python exits. Standard library only: entry points use it before their heavy imports."""

import signal
from contextlib import contextmanager

HANGUP = getattr(signal, "SIGHUP", None)  # a closed terminal or a lost ssh session (POSIX only)


def stop_signals() -> tuple:
    """SIGINT, SIGTERM and SIGHUP, unless SIGHUP was ignored when the process started: `nohup` asks for a run that
    outlives its terminal."""
    hangup = HANGUP is not None and signal.getsignal(HANGUP) is not signal.SIG_IGN
    return (signal.SIGINT, signal.SIGTERM, *([HANGUP] if hangup else []))


def record_stop_signals() -> list[str]:
    """The names of the stop signals that come from now on, recorded, not acted on: loading torch takes seconds,
    and a command that sees them once it can (main) stops as it would at any other moment."""
    received = []
    for stop_signal in stop_signals():
        signal.signal(stop_signal, lambda signum, frame: received.append(signal.Signals(signum).name))
    return received


@contextmanager
def ignoring_stop_signals_after():
    """Run the command, then ignore stop signals: its status is set, and a signal as Python exits would only
    interrupt the exit's callbacks with a traceback, or change the status."""
    try:
        yield
    finally:
        for stop_signal in stop_signals():
            signal.signal(stop_signal, signal.SIG_IGN)
