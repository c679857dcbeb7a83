"""A training budget in wall-clock time (train.max_minutes): how many steps fit in it on the machine at hand.

The run measures what its steps, evaluations and checkpoint saves cost here as it trains, and fixes its length
when the learning rate must begin to decay (the rate before then does not depend on the length): to the most
steps that end, with their evaluations, within planned_seconds() of the budget, counted from the start of the
process. The machine's speed may change after that (other programs start or end). So before every step the run
checks its plan against the steps measured since its latest evaluation (Budget.replanned): a plan that would
end past the budget less half of EXIT_S, or at an evaluation, one that would end MARGIN short of its aim, is
planned again, and the rest of the decay refitted to the new end (optim.Schedule.replan). Between the two the
plan stands, so that the speed's noise changes nothing. Should even one more step not fit (Budget.late), the
run ends there, evaluated and saved.

A budget that cannot hold even the shortest run is refused at once (unheld): one spent by the start-up, or too
short for the evaluations every run takes, whose cost a few batches foresee before the first
(Clock.check)."""

import math
import os
import time
from collections import deque

# The run aims this far below its budget: the speed of the steps left after the length is fixed still varies
# (other processes, the processor's clock). At an evaluation, a plan that would end this share of the budget short
# of its aim is planned again; one that would end past the budget less half of EXIT_S, at any step.
MARGIN = 0.03
BUDGET_WINDOW = 100  # the latest steps that measure a step's cost (their evaluations left out)
# Seconds kept free at the budget's end for the process to exit after its final save (the event file closed, the
# interpreter torn down): a run that slows down ends early enough to leave them (Budget.late).
EXIT_S = 2.0
REPLAN_STEPS = 20  # the fewest steps since the latest evaluation that measure a plan (half an interval if fewer)
clock = time.perf_counter  # what a budget reads the time from (a test's stand-in clock replaces it)


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


def seconds_for(n: int, step_s: float, evaluation_s: float, eval_interval: int, step: int = 0) -> float:
    """What n steps after `step` cost with their evaluations: one after every step that is a multiple of
    eval_interval, and one after the last."""
    if n <= 0:
        return 0.0
    evaluations = (step + n) // eval_interval - step // eval_interval + ((step + n) % eval_interval != 0)
    return n * step_s + evaluations * evaluation_s


def steps_within(seconds: float, step_s: float, evaluation_s: float, eval_interval: int, step: int = 0) -> int:
    """The most steps n after `step` that fit in seconds with their evaluations (seconds_for); 0 if none fit."""
    fits, too_many = 0, max(1, math.floor(seconds / step_s) + 1)  # each step costs at least step_s
    while too_many - fits > 1:  # bisect: cost(fits) fits, cost(too_many) does not; the cost grows with n
        middle = (fits + too_many) // 2
        fitting = seconds_for(middle, step_s, evaluation_s, eval_interval, step) <= seconds
        fits, too_many = (middle, too_many) if fitting else (fits, middle)
    return fits


def more_time(resumed_at: int | None) -> str:
    """The advice that gives a run more time: a longer budget, or to a run resumed at step resumed_at, which keeps
    its budget, more steps."""
    if resumed_at is None:
        return "give a longer budget"
    return f"train the run on by steps instead: give train.max_iters=N (N above {resumed_at}) in place of " \
           f"train.max_minutes"


def unheld(minutes: float, spent_s: float, evaluations: int = 0, evaluation_s: float = 0.0,
           resumed_at: int | None = None) -> str | None:
    """Why a budget of `minutes` cannot hold what a run must still do however few steps it takes, or None: after
    spent_s, `evaluations` evaluations of about evaluation_s each, and the process's exit (EXIT_S). resumed_at: the
    step a resumed run continues from (it keeps its budget, but may train on by steps)."""
    budget_s = minutes * 60
    if spent_s + evaluations * evaluation_s + EXIT_S <= budget_s:
        return None
    about = f"of about {evaluation_s:.4g} s"
    evaluating = {0: "", 1: f", 1 evaluation (at its end) {about} here",
                  2: f", 2 evaluations (at its start and its end) {about} each here"}[evaluations]
    advice = "lower train.eval_iters, or " if evaluations and evaluations * evaluation_s + EXIT_S > budget_s else ""
    advice += more_time(resumed_at)
    return (f"train.max_minutes={minutes:g} ({budget_s:.4g} s) cannot hold this run: {spent_s:.1f} s are spent "
            f"already{evaluating}, and the exit needs {EXIT_S:g} s; {advice}")


class Budget:
    """A run's budget of train.max_minutes as it trains, counted from started_at (on clock()): what a step and an
    evaluation with its saves cost here now, how many steps fit, and whether the run must end early."""

    def __init__(self, minutes: float | None, started_at: float):
        self.minutes, self.started_at = minutes, started_at
        self.evaluations = []  # (when it ended, seconds) of each evaluation with its saves
        self.recent = deque(maxlen=BUDGET_WINDOW + 1)  # (step, when) of the latest steps
        self.since = None  # (step, when): the steps since then measure a plan (Budget.replanned)
        self.pace = None  # seconds a step, as the steps before the latest evaluation or plan measured it
        self.planned_step_s = None  # a step's cost when the length was fixed, in this life of the run
        self.foreseen_s = 0.0  # an evaluation's cost with its saves until one is measured (Clock.check)
        self.recorded_s = 0.0  # the latest evaluation's cost in the run's last life, for a resumed run

    def record(self) -> dict:
        """What a checkpoint keeps of the costs measured, for the life that resumes it (resumed)."""
        return {"step_s": self.pace if self.pace is not None else self.planned_step_s,
                "evaluation_s": self.evaluation_s() or None}

    def resumed(self, state: dict) -> None:
        """Take the costs that the run's last life measured (record) until this life measures its own: its
        start-up has spent time that its plan did not foresee, and the plan is checked before the first step."""
        def cost(value):
            return value if isinstance(value, float) and math.isfinite(value) and value > 0 else None
        self.pace = cost(state.get("step_s"))
        self.recorded_s = cost(state.get("evaluation_s")) or 0.0

    def spent(self) -> float:
        """The seconds of the budget spent so far, earlier lives of the run included."""
        return clock() - self.started_at

    def start(self, step: int) -> None:
        """The run trains from `step` now."""
        now = clock()
        self.recent.append((step, now))
        self.since = (step, now)

    def evaluated(self, step: int, started: float) -> None:
        """An evaluation with its saves at `step`, begun at `started` (on clock()), has just ended."""
        now = clock()
        self.evaluations.append((now, now - started))
        if self.since is not None and step > self.since[0]:
            self.pace = (started - self.since[1]) / (step - self.since[0])
        self.since = (step, now)

    def costs(self, step: int) -> tuple[float, float]:
        """(seconds a step, seconds an evaluation with its saves) now: the latest steps, less the evaluations among
        them (the first steps of a run are slower than the rest), and the latest evaluation (step 0's has no saves;
        a run resumed between evaluations has only the cost foreseen)."""
        now = clock()
        self.recent.append((step, now))
        first_step, first_time = self.recent[0]
        evaluating_s = sum(seconds for ended, seconds in self.evaluations if ended > first_time)
        step_s = (now - first_time - evaluating_s) / (step - first_step)
        return step_s, self.evaluation_s()

    def evaluation_s(self) -> float:
        """An evaluation's cost with its saves: the latest one's, else the cost foreseen before the first."""
        return self.evaluations[-1][1] if self.evaluations else max(self.foreseen_s, self.recorded_s)

    def steps_that_fit(self, step: int, eval_interval: int) -> tuple[int, float, str]:
        """The last step that ends, with its evaluations, within planned_seconds() of the budget at the costs
        measured now; a step's cost; and what was measured, in words."""
        step_s, evaluation_s = self.costs(step)
        return self.fit(step, step_s, evaluation_s, eval_interval, self.spent()), step_s, \
            self.measured(step_s, evaluation_s)

    def fit(self, step: int, step_s: float, evaluation_s: float, eval_interval: int, spent_s: float) -> int:
        return step + steps_within(planned_seconds(self.minutes * 60) - spent_s, step_s, evaluation_s,
                                   eval_interval, step)

    def measured(self, step_s: float, evaluation_s: float) -> str:
        return (f"{self.spent():.1f} s since the start, {step_s:.3g} s a step and {evaluation_s:.3g} s an "
                f"evaluation with its saves")

    def replanned(self, step: int, end: int, due: bool, eval_interval: int,
                  paced: bool = False) -> tuple[int | None, str]:
        """Once the length is fixed, at `step` of a plan that ends at `end`: the new end if the plan must change,
        else None; and what was measured, in words. It must when the steps since the latest evaluation (at least
        REPLAN_STEPS of them, or half an interval) say that it would end past the budget less half of EXIT_S, or,
        at an evaluation (due: this step evaluates, and that evaluation comes first), MARGIN short of its aim.
        paced: too few steps since then may measure by the pace before them (a resumed run's first check)."""
        measured = self.since_costs(step, eval_interval, paced)
        if measured is None:
            return None, ""
        (step_s, evaluation_s), now = measured, clock()
        spent_s = now - self.started_at + (evaluation_s if due else 0.0)
        budget_s = self.minutes * 60
        ends = spent_s + seconds_for(end - step, step_s, evaluation_s, eval_interval, step)
        if ends <= budget_s - EXIT_S / 2 and not (due and ends < planned_seconds(budget_s) - MARGIN * budget_s):
            return None, ""
        fits = self.fit(step, step_s, evaluation_s, eval_interval, spent_s)
        if fits == end:
            return None, ""
        self.since, self.pace = (step, now), step_s  # the next plan measures the steps after this one
        return fits, self.measured(step_s, evaluation_s)

    def since_costs(self, step: int, eval_interval: int, paced: bool = False) -> tuple[float, float] | None:
        """(seconds a step, seconds an evaluation with its saves) measured by the steps since the latest evaluation
        or plan, if there are enough of them (REPLAN_STEPS, or half an interval); else with paced, by the steps
        before them (pace); else None."""
        since_step, since = self.since
        evaluation_s = self.evaluation_s()
        if step - since_step >= min(REPLAN_STEPS, max(1, eval_interval // 2)):
            return (clock() - since) / (step - since_step), evaluation_s
        return (self.pace, evaluation_s) if paced and self.pace is not None else None

    def late(self, step: int, due: bool, eval_interval: int) -> str | None:
        """Once the length is fixed: why the run must end at `step`, or None. It must when one more step and the
        final evaluation would end past the budget less EXIT_S (the process's exit), the machine having slowed down
        beyond what a new plan can fit; due: this step evaluates anyway, and that evaluation comes first. The
        steps that measure a plan measure this too, where there are enough of them."""
        step_s, evaluation_s = self.since_costs(step, eval_interval, paced=True) or self.costs(step)
        ahead = (2 if due else 1) * evaluation_s + step_s + EXIT_S
        if clock() + ahead <= self.started_at + self.minutes * 60:
            return None
        planned = f", {self.planned_step_s:.3g} s when planned" if self.planned_step_s is not None else ""
        return (f"one more step ({step_s:.3g} s now{planned}) and the final evaluation ({evaluation_s:.3g} s) would "
                f"pass the budget")
