"""Which signals stop a command. Standard library only: export.py sets its first handlers with it before its heavy
imports."""

import signal

HANGUP = getattr(signal, "SIGHUP", None)  # a closed terminal or a lost ssh session (POSIX only)


def stop_signals() -> tuple:
    """SIGINT, SIGTERM and SIGHUP, unless SIGHUP was ignored when the process started: `nohup` asks for a run that
    outlives its terminal."""
    hangup = HANGUP is not None and signal.getsignal(HANGUP) is not signal.SIG_IGN
    return (signal.SIGINT, signal.SIGTERM, *([HANGUP] if hangup else []))
