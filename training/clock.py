"""A budget run's clock (train.max_minutes): what the time measured so far means for the run's length.

training/budget.py measures what steps and evaluations cost here and counts the steps that fit; the Clock decides
from that, and returns what the Trainer then does: a Plan (the run's new length with the line that says why; one
that ends at this step ends the run), or None where the plan stands. A budget it cannot hold is a ConfigError.
It reads nothing of the Trainer's: the step and the state of the plan come in as arguments. Its own module, not
part of budget.py: budget.py measures and decides nothing, and the two together would pass 250 lines."""

from collections.abc import Callable
from dataclasses import dataclass

from runtime.errors import ConfigError

from . import budget as timing
from .applies import check_patience_applies
from .budget import REPLAN_STEPS, Budget, more_time, unheld
from .config import OptimConfig, TrainConfig
from .distributed import gather
from .evaluation import evaluate
from .optim import decay_begins

FORESEEING_BATCHES = 2  # batches of each split timed, after an untimed one, to foresee an evaluation's cost
UNREPEATED = "the run goes on, but no command repeats it exactly now"  # a change of plan or of threads says so


def check_start(tc: TrainConfig, named: set[str] | None, resumed: dict | None, started_at: float) -> None:
    """Refuse, before any work, a train.patience that can never end the run, and a budget (train.max_minutes)
    that the time spent so far has used up: the start-up, and a resumed run's earlier lives. named: the keys the
    command line names; started_at: on budget.clock()."""
    check_patience_applies(tc, named, resumed is not None)
    if tc.max_minutes is None:
        return
    state = resumed["training"] if resumed is not None else {}
    why = unheld(tc.max_minutes, timing.clock() - started_at + state.get("seconds", 0.0),
                 resumed_at=state.get("step"))
    if why is not None:
        raise ConfigError(why)


def plan_changed(step: int) -> str:
    """Why no command repeats a budget run whose plan changed at `step`."""
    return (f"{UNREPEATED}: its plan changed at step {step}, and train.max_iters plans a run from step 0 (its "
            f"checkpoints record the change, and a resume follows it)")


def repeated_by(steps: int, threads_used: set[int], chosen: dict[str, object]) -> str:
    """How a run of fixed length repeats a budget run of `steps` steps whose plan has not changed: the settings that
    the same command names in place of train.max_minutes (the steps, and what the run chose for itself: `chosen`,
    the shape sizing chose, and the CPU threads its steps ran at), or why none does (more than one count)."""
    if len(threads_used) > 1:
        counts = " and ".join(map(str, sorted(threads_used)))
        return (f"{UNREPEATED}: its steps ran at {counts} threads, which round sums slightly differently, and "
                f"train.threads names one count")
    named = {"train.max_iters": steps, **chosen}  # a run of fixed length is not sized: it trains the shape named
    if threads_used:  # on a CPU: a run that times its threads may choose another count
        named["train.threads"] = next(iter(threads_used))
    overrides = " ".join(f"{key}={value}" for key, value in named.items())
    return f"to repeat this run exactly, give {overrides} in place of train.max_minutes"


@dataclass(frozen=True)
class Plan:
    """The run's length from this step on, and the line that says why (rank 0 says it)."""

    steps: int
    line: str
    first: bool = False  # the length fixed for the first time: planned from step 0 rather than refitted from here


class Clock:
    """Decides a budget run's length from what its Budget measures. Rank 0's clock decides for every process."""

    def __init__(self, budget: Budget, tc: TrainConfig, oc: OptimConfig, world_size: int, start_step: int,
                 resumed: bool):
        """start_step: the step this life of the run trains from; resumed: from a checkpoint."""
        self.budget, self.optim, self.world_size = budget, oc, world_size
        self.minutes, self.eval_interval, self.eval_iters = tc.max_minutes, tc.eval_interval, tc.eval_iters
        self.start_step, self.is_resumed = start_step, resumed

    def check(self, step: int, evaluation: Callable[[int], tuple]) -> None:
        """Before a budget run's first evaluation: foresee an evaluation's cost here from a few of its batches, and
        refuse the budget if it cannot hold the evaluations that the run takes however few steps it trains (one
        now, at a multiple of train.eval_interval, and one at its end) after the time spent (budget.unheld).
        evaluation(n): evaluate()'s arguments for n batches of each split."""
        evaluate(*evaluation(1))  # the first batches pay for allocations and the kernels' choice
        started = timing.clock()
        evaluate(*evaluation(FORESEEING_BATCHES))
        self.budget.foreseen_s = (timing.clock() - started) * self.eval_iters / FORESEEING_BATCHES
        why = unheld(self.minutes, self.budget.spent(), 1 + (step % self.eval_interval == 0),
                     self.budget.foreseen_s, self.resumed_at(step))
        why = gather(why, self.world_size)[0]
        if why is not None:
            raise ConfigError(why)

    def fix(self, step: int, threads_used: set[int], chosen: dict[str, object]) -> Plan | None:
        """While the length is open: once the decay must begin, the most steps that end within the budget at the
        speed measured so far (the steps, the evaluations with their saves, the start-up); None until then, the
        rate following the warm-up and holding at its peak, as in a run planned for those steps from the start. The
        line names the command that repeats the run (repeated_by). A warm-up that cannot fit is refused once
        REPLAN_STEPS steps have measured the speed."""
        oc = self.optim
        fits, step_s, measured = self.budget.steps_that_fit(step, self.eval_interval)
        fits = gather(fits, self.world_size)[0]
        settled = step - self.start_step >= REPLAN_STEPS  # enough steps to refuse a warm-up that cannot fit
        if decay_begins(oc, fits) > step and not (settled and fits <= oc.warmup_iters):
            return None  # the rate holds until then whatever the length: measure on
        if fits <= oc.warmup_iters:
            raise ConfigError(f"train.max_minutes={self.minutes:g} leaves time for {fits} step{'s' * (fits != 1)} "
                              f"here ({measured}), no more than optim.warmup_iters={oc.warmup_iters}; "
                              f"{more_time(self.resumed_at(step))}")
        steps = fits
        while decay_begins(oc, steps) < step:  # the steps taken at the peak rate stay so in the plan
            steps += 1
        self.budget.planned_step_s = step_s
        return Plan(steps, f"train.max_minutes={self.minutes:g} fits {steps} steps ({measured}); "
                           f"{repeated_by(steps, threads_used, chosen)}", first=True)

    def kept(self, step: int, max_iters: int, due: bool, changed: bool) -> Plan | None:
        """Once the length is fixed at max_iters: a new plan where the machine's speed has changed (Budget.replanned),
        the rest of the decay refitted to the new end; or one that ends at this step where even one more step would
        pass the budget (Budget.late). due: this step evaluates anyway; changed: the plan has changed before."""
        why = self.budget.late(step, due, self.eval_interval)
        end, measured = self.budget.replanned(step, max_iters, due, self.eval_interval)
        end, why = gather((end, why), self.world_size)[0]
        if why is not None:  # the rate after this last step is the plan's end, as in any run
            return Plan(step, f"train.max_minutes={self.minutes:g} ends the run at step {step}, not {max_iters} as "
                              f"planned: {why}{self.unrepeated(step, changed)}")
        return self.again(step, max_iters, end, measured, changed) if end is not None else None

    def resumed(self, step: int, max_iters: int, changed: bool) -> Plan | None:
        """Before a resumed run's first step, its length fixed at max_iters: a new plan at once where the time left
        cannot hold the rest of it at the speed its last life measured (its start-up has spent some), so that the
        decay ends at the budget's end rather than being cut short there (Budget.late)."""
        end, measured = self.budget.replanned(step, max_iters, False, self.eval_interval, paced=True)
        end = gather(end, self.world_size)[0]
        return self.again(step, max_iters, end, measured, changed) if end is not None else None

    def again(self, step: int, max_iters: int, end: int, measured: str, changed: bool) -> Plan:
        """The rest of the decay refitted to end at `end` (at least the next step)."""
        end = max(end, step + 1)  # the step that fits before the budget's end, if none fits before the aim
        return Plan(end, f"train.max_minutes={self.minutes:g} plans the run again at step {step}: {end} steps, not "
                         f"{max_iters} ({measured}); the learning rate reaches optim.min_lr={self.optim.min_lr:g} at "
                         f"step {end}{self.unrepeated(step, changed)}")

    def resumed_at(self, step: int) -> int | None:
        """The step a resumed run's advice to train on by steps names (more_time): this one; None for a new run."""
        return step if self.is_resumed else None

    @staticmethod
    def unrepeated(step: int, changed: bool) -> str:
        """What the line of the plan's first change at `step` adds: the command printed when the length was fixed
        no longer repeats the run."""
        return "" if changed else f"; {plan_changed(step)}"
