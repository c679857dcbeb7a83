"""A training budget in wall-clock time (train.max_minutes): how many steps fit in it on the machine at hand.

The run measures what its steps, evaluations and checkpoint saves cost here as it trains, and fixes its length
when the learning rate must begin to decay (the rate before then does not depend on the length): to the most
steps that end, with their evaluations, within planned_seconds() of the budget, counted from the start of the
process.
The longer the rate holds at its peak (optim.decay_frac below 1), the more of the run is measured before the
length is fixed, and the closer the run ends to its budget. Should the machine slow down after that, so that one
more step and the final evaluation would pass the budget, the run ends there, evaluated and saved: the first
steps of its plan, which train.resume trains on to the end (Budget.late)."""

import math
import os
import time
from collections import deque

# The run aims this far below its budget: the speed of the steps left after the length is fixed still varies
# (other processes, the processor's clock). A run that slows down past the margin ends at its budget
# (Budget.late); one that speeds up ends early, so the margin is small.
MARGIN = 0.03
BUDGET_WINDOW = 100  # the latest steps that measure a step's cost (their evaluations left out)
# Seconds kept free at the budget's end for the process to exit after its final save (the event file closed, the
# interpreter torn down): a run that slows down ends early enough to leave them (Budget.late).
EXIT_S = 2.0


def planned_seconds(budget_s: float) -> float:
    """The seconds of a budget that a run plans its steps and evaluations into: MARGIN below it, and never closer
    to its end than EXIT_S, which the run's early end keeps free too (Budget.late): one rule for both."""
    return budget_s - max(MARGIN * budget_s, EXIT_S)


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


def steps_within(seconds: float, step_s: float, evaluation_s: float, eval_interval: int, step: int = 0) -> int:
    """The most steps n after `step` that fit in seconds with their evaluations: one after every step that is a
    multiple of eval_interval, and one after the last; 0 if none fit."""
    def cost(n: int) -> float:  # grows with n: a step past a multiple of eval_interval adds the last evaluation
        evaluations = (step + n) // eval_interval - step // eval_interval + ((step + n) % eval_interval != 0)
        return n * step_s + evaluations * evaluation_s if n else 0.0

    fits, too_many = 0, max(1, math.floor(seconds / step_s) + 1)  # each step costs at least step_s
    while too_many - fits > 1:  # bisect: cost(fits) fits, cost(too_many) does not
        middle = (fits + too_many) // 2
        fits, too_many = (middle, too_many) if cost(middle) <= seconds else (fits, middle)
    return fits


class Budget:
    """A run's budget of train.max_minutes as it trains, counted from started_at (time.perf_counter()): what a step
    and an evaluation with its saves cost here now, how many steps fit, and whether the run must end early."""

    def __init__(self, minutes: float | None, started_at: float):
        self.minutes, self.started_at = minutes, started_at
        self.evaluations = []  # (when it ended, seconds) of each evaluation with its saves
        self.clock = deque(maxlen=BUDGET_WINDOW + 1)  # (step, when) of the latest steps
        self.planned_step_s = None  # a step's cost when the length was fixed, in this life of the run

    def evaluated(self, started: float) -> None:
        """An evaluation with its saves, begun at `started`, has just ended."""
        now = time.perf_counter()
        self.evaluations.append((now, now - started))

    def costs(self, step: int) -> tuple[float, float]:
        """(seconds a step, seconds an evaluation with its saves) now: the latest steps, less the evaluations among
        them (the first steps of a run are slower than the rest), and the latest evaluation (step 0's has no saves;
        a run resumed between evaluations has none yet)."""
        now = time.perf_counter()
        self.clock.append((step, now))
        first_step, first_time = self.clock[0]
        evaluating_s = sum(seconds for ended, seconds in self.evaluations if ended > first_time)
        step_s = (now - first_time - evaluating_s) / (step - first_step)
        return step_s, self.evaluations[-1][1] if self.evaluations else 0.0

    def steps_that_fit(self, step: int, eval_interval: int) -> tuple[int, float, str]:
        """The last step that ends, with its evaluations, within planned_seconds() of the budget at the costs
        measured now; a step's cost; and what was measured, in words."""
        step_s, evaluation_s = self.costs(step)
        spent_s = time.perf_counter() - self.started_at
        fits = step + steps_within(planned_seconds(self.minutes * 60) - spent_s, step_s, evaluation_s, eval_interval,
                                   step)
        return fits, step_s, (f"{spent_s:.1f} s since the start, {step_s:.3g} s a step and {evaluation_s:.3g} s "
                              f"an evaluation with its saves")

    def late(self, step: int, due: bool) -> str | None:
        """Once the length is fixed: why the run must end at `step`, or None. It must when one more step and the
        final evaluation would end past the budget less EXIT_S (the process's exit), the machine having slowed down
        since the plan; due: this step evaluates anyway, and that evaluation comes first."""
        step_s, evaluation_s = self.costs(step)
        ahead = (2 if due else 1) * evaluation_s + step_s + EXIT_S
        if time.perf_counter() + ahead <= self.started_at + self.minutes * 60:
            return None
        return (f"one more step ({step_s:.3g} s now, {self.planned_step_s:.3g} s when planned) and the final "
                f"evaluation ({evaluation_s:.3g} s) would pass the budget")
