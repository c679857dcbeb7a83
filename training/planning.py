"""A budget run's plan (train.max_minutes), as the Trainer keeps it: fixed when the learning rate must begin to
decay, then planned again where the machine's speed changes (training/budget.py measures; this decides and says)."""

from runtime.errors import ConfigError

from . import budget as clock
from .applies import check_patience_applies
from .budget import REPLAN_STEPS, more_time, unheld
from .distributed import gather
from .evaluation import evaluate
from .optim import decay_begins, set_step

FORESEEING_BATCHES = 2  # batches of each split timed, after an untimed one, to foresee an evaluation's cost
UNREPEATED = "the run goes on, but no command repeats it exactly now"  # a change of plan or of threads says so


def check_start(tc, named: set[str] | None, resumed: dict | None, started_at: float) -> None:
    """Refuse, before any work, a train.patience that can never end the run, and a budget (train.max_minutes)
    that the time spent so far has used up: the start-up, and a resumed run's earlier lives. tc: the run's
    TrainConfig; named: the keys the command line names; started_at: on budget.clock()."""
    check_patience_applies(tc, named, resumed is not None)
    if tc.max_minutes is None:
        return
    state = resumed["training"] if resumed is not None else {}
    why = unheld(tc.max_minutes, clock.clock() - started_at + state.get("seconds", 0.0), resumed_at=state.get("step"))
    if why is not None:
        raise ConfigError(why)


class BudgetPlan:
    """The Trainer's methods that fix and change its length. They use its settings, schedule, budget, step and
    summaries."""

    def start_session(self) -> None:
        """The run's HParams session, once its length is known (rank 0)."""
        if self.is_master:
            self.summaries.start_session(self.settings.config, self.device.type, self.precision)

    def end_session(self, status: int) -> None:
        """status: TensorBoard's STATUS_SUCCESS or STATUS_FAILURE (rank 0). A budget run that ends before its length
        is fixed (train.patience, a divergence) starts its session first: the dashboard shows every run that ended."""
        if self.tc.max_iters is None:
            self.start_session()
        if self.is_master:
            self.summaries.end_session(status)

    def check_budget(self) -> None:
        """Before a budget run's first evaluation: foresee an evaluation's cost here from a few of its batches, and
        refuse the budget if it cannot hold the evaluations that the run takes however few steps it trains (one
        now, at a multiple of train.eval_interval, and one at its end) after the time spent (budget.unheld)."""
        tc = self.tc

        def batches(n: int) -> None:
            evaluate(self.evaluated, self.data, self.raw_model.config.block_size, tc.batch_size, n,
                     tc.seed + self.rank, self.device, self.autocast, self.world_size)

        batches(1)  # the first batches pay for allocations and the kernels' choice
        started = clock.clock()
        batches(FORESEEING_BATCHES)
        self.budget.foreseen_s = (clock.clock() - started) * tc.eval_iters / FORESEEING_BATCHES
        why = unheld(tc.max_minutes, self.budget.spent(), 1 + (self.step % tc.eval_interval == 0),
                     self.budget.foreseen_s, self.step if self.resumed else None)
        why = gather(why, self.world_size)[0]  # rank 0's clock decides
        if why is not None:
            raise ConfigError(why)

    def plan_to_budget(self) -> None:
        """With a budget (train.max_minutes) whose length is still open: once the decay must begin, fix max_iters,
        and the schedule with it, to the most steps that end within the budget at the speed measured so far (the
        steps, the evaluations with their saves, the start-up). Until then the rate follows the warm-up and holds
        at its peak, as in a run planned for those steps from the start: the command repeated_by prints repeats
        this run exactly, unless the speed changes later (keep_to_budget). A warm-up that cannot fit is refused
        once REPLAN_STEPS steps have measured the speed."""
        tc, oc = self.tc, self.settings.optim
        fits, step_s, measured = self.budget.steps_that_fit(self.step, tc.eval_interval)
        fits = gather(fits, self.world_size)[0]  # rank 0's plan
        settled = self.step - self.start_step >= REPLAN_STEPS  # enough steps to refuse a warm-up that cannot fit
        if decay_begins(oc, fits) > self.step and not (settled and fits <= oc.warmup_iters):
            return  # the rate holds until then whatever the length: measure on
        if fits <= oc.warmup_iters:
            raise ConfigError(f"train.max_minutes={tc.max_minutes:g} leaves time for {fits} step{'s' * (fits != 1)} "
                              f"here ({measured}), no more than optim.warmup_iters={oc.warmup_iters}; "
                              f"{more_time(self.step if self.resumed else None)}")
        steps = fits
        while decay_begins(oc, steps) < self.step:  # the steps taken at the peak rate stay so in the plan
            steps += 1
        self.budget.planned_step_s = step_s
        self.schedule.set(steps)  # this step's rate is the open schedule's: the plan's decay begins here or later
        self.change_plan(steps, f"train.max_minutes={tc.max_minutes:g} fits {steps} steps ({measured}); "
                                f"{self.repeated_by(steps)}")
        self.start_session()

    def repeated_by(self, steps: int) -> str:
        """How a run of fixed length repeats this budget run of `steps` steps: the settings that the same command
        names in place of train.max_minutes (the steps, and what the run chose for itself: the shape sizing chose,
        the CPU threads), or why none does."""
        if len(self.schedule.plan) > 1:
            return (f"{UNREPEATED}: its plan changed at step {self.schedule.plan[-1][0]}, and train.max_iters plans a "
                    f"run from step 0 (its checkpoints record the change, and a resume follows it)")
        if len(self.threads_used) > 1:
            counts = " and ".join(map(str, sorted(self.threads_used)))
            return (f"{UNREPEATED}: its steps ran at {counts} threads, which round sums slightly differently, and "
                    f"train.threads names one count")
        named = {"train.max_iters": steps}
        for key in self.chosen:  # a run of fixed length is not sized: it trains the shape named
            section, name = key.split(".")
            named[key] = self.settings.config[section][name]
        if self.threads_used:  # on a CPU: a run that times its threads may choose another count
            named["train.threads"] = next(iter(self.threads_used))
        overrides = " ".join(f"{key}={value}" for key, value in named.items())
        return f"to repeat this run exactly, give {overrides} in place of train.max_minutes"

    def keep_to_budget(self, due: bool) -> None:
        """Once the budget has fixed the length: plan it again where the machine's speed has changed (Budget.replanned),
        the rest of the decay refitted to the new end; or end the run at this step where even one more step would
        pass the budget (Budget.late). Rank 0's clock decides. due: this step evaluates anyway."""
        tc = self.tc
        why = self.budget.late(self.step, due, tc.eval_interval)
        end, measured = self.budget.replanned(self.step, tc.max_iters, due, tc.eval_interval)
        end, why = gather((end, why), self.world_size)[0]
        if why is not None:
            self.replan(self.step)  # the rate after this last step is the plan's end, as in any run
            self.change_plan(self.step, f"train.max_minutes={tc.max_minutes:g} ends the run at step {self.step}, "
                                        f"not {tc.max_iters} as planned: {why}{self.unrepeated(self.step)}")
        elif end is not None:
            self.plan_again(end, measured)

    def check_resumed_plan(self) -> None:
        """Before a resumed budget run's first step, its length fixed: plan it again at once where the time left
        cannot hold the rest of its plan at the speed its last life measured (its start-up has spent some), so that
        the decay ends at the budget's end rather than being cut short there (Budget.late)."""
        end, measured = self.budget.replanned(self.step, self.tc.max_iters, False, self.tc.eval_interval, paced=True)
        end = gather(end, self.world_size)[0]
        if end is not None:
            self.plan_again(end, measured)

    def plan_again(self, end: int, measured: str) -> None:
        """The rest of the decay refitted to end at `end` (at least the next step), and said."""
        tc = self.tc
        end = max(end, self.step + 1)  # the step that fits before the budget's end, if none fits before the aim
        self.replan(end)
        self.change_plan(end, f"train.max_minutes={tc.max_minutes:g} plans the run again at step {self.step}: "
                              f"{end} steps, not {tc.max_iters} ({measured}); the learning rate reaches "
                              f"optim.min_lr={self.settings.optim.min_lr:g} at step {end}{self.unrepeated(end)}")

    def replan(self, end: int) -> None:
        """The schedule from this step on ends at `end`, the optimisers' rates with it from the next step."""
        self.schedule.replan(self.step, end)
        for scheduler in self.schedulers:
            set_step(scheduler, self.step)

    def unrepeated(self, steps: int) -> str:
        """Once the plan has changed for the first time: what the line that says so adds, that the command printed
        when the length was fixed no longer repeats the run."""
        return f"; {self.repeated_by(steps)}" if len(self.schedule.plan) == 2 else ""

    def change_plan(self, steps: int, line: str) -> None:
        """The run's length is now `steps` (the schedule has changed with it): record it, say so (rank 0)."""
        self.settings = self.settings.planned(steps, self.tc.max_minutes)
        self.tc = self.settings.train
        if self.is_master:
            self.say(line)
            self.summaries.plan(self.step, steps)
