"""Stopping on SIGINT or SIGTERM after the current step, at the same step in every process."""

import signal

import torch
import torch.distributed as dist


class StopSignals:
    """Turns the first SIGINT or SIGTERM into a request to stop after the current step; a second one
    interrupts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal_name = None
        self._previous = {}

    def __enter__(self):
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if self.signal_name is not None:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def agreed(self, step: int, log_interval: int, device) -> bool:
        """Whether to stop now. Under DDP all processes must stop at the same step: they agree at log
        intervals, so that the exchange costs no extra sync."""
        if not dist.is_initialized():
            return self.signal_name is not None
        if step % log_interval:
            return False
        flag = torch.tensor(float(self.signal_name is not None), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = bool(flag.item())
        if stop and self.signal_name is None:
            self.signal_name = "a signal to another process"
        return stop
