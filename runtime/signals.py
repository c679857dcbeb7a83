"""Stopping on SIGINT, SIGTERM or SIGHUP after the current step, at the same step in every process."""

import signal
import sys

import torch
import torch.distributed as dist

from runtime.errors import Interrupted
from runtime.streams import silence
from runtime.stop_signals import HANGUP, stop_signals


# the standard streams that are a terminal, noted at the start: once it hangs up, isatty() answers False
TERMINALS = [stream for stream in (sys.stdout, sys.stderr) if stream is not None and stream.isatty()]


def hung_up(signum) -> None:
    """After SIGHUP the terminal is gone and every write to it fails (EIO): send what the standard streams still
    print there to /dev/null, so that nothing written on the way stops the run from saving."""
    if signum == HANGUP:
        for stream in TERMINALS:
            silence(stream)


def interrupt(signum, frame):
    hung_up(signum)
    raise KeyboardInterrupt


def interrupt_naming_the_signal(signum, frame):
    """sample.py: a stop signal interrupts, and the exit status names it (128 + its number)."""
    hung_up(signum)
    raise Interrupted(signal.Signals(signum).name)


def interrupt_on_signals() -> None:
    """train.py, outside training: the stop signals interrupt, and what is half done is cleaned up on the way
    out."""
    for sig in StopSignals.SIGNALS:
        signal.signal(sig, interrupt)


class StopSignals:
    """Turns the first stop signal (SIGINT, SIGTERM, SIGHUP) into a request to stop after the current step; a second
    one interrupts at once. In train.py's process, once the run has finished and saved, a signal is only noted in
    `late`: it cannot turn that success into a failure, and a sweep stops before its next job. Entered again
    while inside, it changes nothing: a caller may take the signals before the code that checks them begins."""

    SIGNALS = stop_signals()
    late = None  # the name of a signal received after a run finished

    def __init__(self):
        self.signal_name = None
        self._previous = {}
        self._group = None
        self._depth = 0

    def __enter__(self):
        self._depth += 1
        if self._depth > 1:
            return self
        if dist.is_initialized():  # the processes agree on the CPU, without waiting for the device's work
            self._group = dist.new_group(backend="gloo")
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type, *exc):
        self._depth -= 1
        if self._depth:
            return
        for sig, handler in self._previous.items():
            finished = exc_type is None and handler is interrupt
            signal.signal(sig, self._note_late if finished else handler)

    def finished(self) -> None:
        """The run has saved its final checkpoint: from now on a signal, even a second one, is only noted."""
        for sig in self.SIGNALS:
            signal.signal(sig, self._note_late)

    def _handle(self, signum, frame):
        hung_up(signum)
        if self.signal_name is not None:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    @staticmethod
    def _note_late(signum, frame):
        hung_up(signum)
        StopSignals.late = signal.Signals(signum).name

    def agreed(self) -> bool:
        """Whether to stop now. Under DDP all processes stop at the same step: they agree at every step."""
        if self._group is None:
            return self.signal_name is not None
        flag = torch.tensor(float(self.signal_name is not None))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        stop = bool(flag.item())
        if stop and self.signal_name is None:
            self.signal_name = "a signal to another process"
        return stop
