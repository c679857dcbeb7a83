"""A training budget in wall-clock time (train.max_minutes): how many steps fit in it on the machine at hand.

The run measures what its steps, evaluations and checkpoint saves cost here, and takes the most steps that end,
with their evaluations, within the budget less MARGIN, counted from the start of the process."""

import math
import os
import time

# The run aims this far below its budget: the speed measured in a few seconds at the start varies over a run
# (other processes, the processor's clock), and the process takes a moment to exit after its last line.
MARGIN = 0.03
REHEARSAL_STEPS = 10  # timed throwaway steps that measure a step's cost, after one untimed (its first costs more)


def process_started() -> float:
    """When this process started, on time.perf_counter()'s clock: its start-up (the interpreter, importing torch)
    counts against the budget too. Where /proc does not say (not Linux), now."""
    try:
        with open("/proc/uptime") as uptime, open("/proc/self/stat") as stat:
            since_boot = float(uptime.read().split()[0])
            # the fields after the command's name, which may hold spaces; starttime is the 22nd field of all
            started = int(stat.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        return time.perf_counter() - max(0.0, since_boot - started)
    except (OSError, ValueError, IndexError):
        return time.perf_counter()


def steps_within(seconds: float, step_s: float, evaluation_s: float, eval_interval: int) -> int:
    """The most steps n whose time, n steps and the evaluation after every eval_interval-th step and after the
    last (ceil(n / eval_interval) evaluations), fits in seconds; 0 if none does."""
    block_s = eval_interval * step_s + evaluation_s  # eval_interval steps and the evaluation after them
    blocks = max(0, math.floor(seconds / block_s))
    rest = seconds - blocks * block_s  # a last, shorter stretch of steps ends with an evaluation of its own
    return blocks * eval_interval + min(eval_interval - 1, max(0, math.floor((rest - evaluation_s) / step_s)))
