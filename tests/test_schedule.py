"""The learning-rate schedule (training/optim.py) against its formula, written out here: a linear warm-up, the
peak held, and a linear or cosine decay over the last decay_frac of the steps."""

import math

import pytest
import torch

from training.config import OptimConfig
from training.optim import Schedule, decay_begins, make_scheduler

PEAK, FLOOR = 1e-2, 1e-3


def rate(step: int, oc: OptimConfig, max_iters: int) -> float:
    """The rate of the step after `step` steps taken, as torch's LinearLR and CosineAnnealingLR define them."""
    decay_iters = max(1, min(max_iters - oc.warmup_iters, round(oc.decay_frac * max_iters)))
    begins = max_iters - decay_iters
    if step < oc.warmup_iters:
        start = 1 / oc.warmup_iters
        return PEAK * (start + (1 - start) * step / oc.warmup_iters)
    if step <= begins:
        return PEAK
    done = (step - begins) / decay_iters
    if oc.decay == "linear":
        return PEAK + (FLOOR - PEAK) * done
    return FLOOR + (PEAK - FLOOR) * (1 + math.cos(math.pi * done)) / 2


def rates(oc: OptimConfig, max_iters: int | None, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=oc.lr)
    scheduler = make_scheduler(optimizer, Schedule(oc, max_iters))
    seen = []
    for _ in range(steps):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return seen


@pytest.mark.parametrize("decay", ["linear", "cosine"])
@pytest.mark.parametrize("warmup_iters, decay_frac, max_iters", [
    (5, 1.0, 40), (0, 1.0, 40), (5, 0.3, 40), (0, 0.5, 37), (5, 0.5, 37), (3, 0.9, 10), (5, 0.01, 40)])
def test_the_schedule_follows_its_formula(decay, warmup_iters, decay_frac, max_iters):
    oc = OptimConfig(lr=PEAK, min_lr=FLOOR, warmup_iters=warmup_iters, decay=decay, decay_frac=decay_frac)
    expected = [rate(step, oc, max_iters) for step in range(max_iters)]
    assert rates(oc, max_iters, max_iters) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("warmup_iters, decay_frac", [(5, 1.0), (5, 0.3), (0, 0.5)])
def test_an_open_schedule_gives_every_plan_its_rates_until_that_plan_decays(warmup_iters, decay_frac):
    """What a time budget relies on: before a plan's decay begins, its rates are those of the open schedule,
    bit for bit, whatever its length."""
    oc = OptimConfig(lr=PEAK, min_lr=FLOOR, warmup_iters=warmup_iters, decay="linear", decay_frac=decay_frac)
    open_rates = rates(oc, None, 200)
    assert open_rates[warmup_iters:] == [PEAK] * (200 - warmup_iters)
    for max_iters in (20, 57, 200):
        begins = decay_begins(oc, max_iters)
        assert rates(oc, max_iters, begins + 1) == open_rates[:begins + 1]
        assert rates(oc, max_iters, begins + 2)[-1] < PEAK
