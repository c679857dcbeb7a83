"""A budget run stopped after its length was fixed and resumed: the new process's start-up spends time its plan
did not foresee, and the machine may run at another speed. The run plans again before its first step, and ends
its schedule (the rate at optim.min_lr) at its last step, within its budget. It was cut short instead, at a step
where the rate had not come down.

By tests/test_clock.py's stand-in clock: 0.75 s a step, 1 s an evaluation that saves, a budget of 60 s whose length
is fixed near step 35 at 68 steps."""

import re

import pytest
import torch

import train
import training.budget
import training.loop
from programs import data_root  # noqa: F401 (a fixture)
from test_clock import BUDGET, MIN_LR, StandInClock, budget_run
from test_train import config, sigterm_at
from training.config import OptimConfig
from training.loop import Stopped
from training.optim import Schedule


def resumed(tmp_path, data_root, run_dir, start_up_s: float, factor: float, stop_at: int | None = None) -> list:
    """Resume the run in run_dir in place, its process's start-up taking start_up_s on the stand-in clock, its
    steps `factor` times as long; SIGTERM after stop_at steps of this life, if given. What it printed."""
    printed = []
    with pytest.MonkeyPatch.context() as patch:
        clock = StandInClock(patch, factor)
        patch.setattr(training.loop, "write_line", printed.append)
        if stop_at is not None:
            sigterm_at(patch, stop_at)
        clock.now = start_up_s
        resuming = config(tmp_path, data_root, *BUDGET, f"train.resume={run_dir}")
        if stop_at is None:
            train.main(resuming, run_dir, started_at=0.0)
        else:
            with pytest.raises(Stopped):
                train.main(resuming, run_dir, started_at=0.0)
    return printed


@pytest.mark.parametrize("stops, start_up_s, factor", [([45], 12.0, 1), ([42, 4], 6.0, 1), ([45], 6.0, 2)],
                         ids=["after a long start-up", "stopped twice", "slower after the resume"])
def test_a_resumed_budget_run_ends_its_schedule_on_time(tmp_path, data_root, stops, start_up_s, factor):
    run_dir = tmp_path / "runs/budget"
    with pytest.MonkeyPatch.context() as patch, pytest.raises(Stopped):
        sigterm_at(patch, stops[0])
        budget_run(tmp_path, data_root, patch, 1, run_dir=run_dir)
    first = torch.load(run_dir / "last.pt", weights_only=True)["training"]
    assert first["config"]["train"]["max_iters"] == 68 and first["step"] == stops[0]  # stopped with its length fixed
    for again in stops[1:]:
        resumed(tmp_path, data_root, run_dir, start_up_s, factor, stop_at=again)
    printed = resumed(tmp_path, data_root, run_dir, start_up_s, factor)
    last = torch.load(run_dir / "last.pt", weights_only=True)["training"]
    assert last["step"] == last["config"]["train"]["max_iters"] == last["plan"][-1][1] < 68, printed
    assert not [line for line in printed if "ends the run at step" in line], printed  # never cut short
    adamw, muon = (o["param_groups"][0]["lr"] for o in last["optimizers"])
    assert (adamw, muon) == (pytest.approx(MIN_LR), pytest.approx(0.02 * MIN_LR / 1e-2)), printed
    assert re.search(rf", lr {MIN_LR:.2e}, [\d,]+ tokens/s$", printed[-1]), printed[-1]  # the schedule's floor
    assert last["seconds"] <= 60 - training.budget.EXIT_S / 2  # within the budget, every life counted


@pytest.mark.parametrize("decay", ["linear", "cosine"])
@pytest.mark.parametrize("cut_at", [30, 60], ids=["before the decay", "during it"])
def test_a_plan_that_ends_where_it_is_made_ends_at_the_floor(decay, cut_at):
    """A budget run that must end now (Budget.late) plans its end at this step: the rate after it is the floor."""
    oc = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_iters=5, decay=decay, decay_frac=0.5)
    schedule = Schedule(oc, 100)
    schedule.replan(cut_at, cut_at)
    assert schedule.factor(cut_at) == pytest.approx(0.1)
    assert schedule.factor(cut_at - 1) == Schedule(oc, 100).factor(cut_at - 1)  # the steps before it as planned
