"""The optimisers and their learning-rate schedules, from torch.optim.

adamw: AdamW on every parameter. muon: Muon on the blocks' hidden 2-D weights (attention and MLP
matrices), AdamW on everything else (embeddings and the tied head, LayerNorm gains, biases), each with its
own peak learning rate and the same schedule.
"""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from model import GPT

from .config import OptimConfig


def make_optimizers(model: GPT, oc: OptimConfig, fused: bool) -> list[torch.optim.Optimizer]:
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    hidden = {name for name, p in params.items() if name.startswith("blocks.") and p.dim() == 2}
    rest = [p for name, p in params.items() if oc.name == "adamw" or name not in hidden]
    # Decay pulls matrices and embeddings towards zero; biases and LayerNorm gains (1-D) keep their scale.
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": oc.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    optimizers = [torch.optim.AdamW(groups, lr=oc.lr, betas=(oc.beta1, oc.beta2), fused=fused)]
    if oc.name == "muon":
        optimizers.append(Muon([params[name] for name in sorted(hidden)], lr=oc.muon_lr, momentum=oc.muon_momentum,
                               weight_decay=oc.muon_weight_decay))
    return optimizers


class Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iteration in float32. torch's runs it in bfloat16, which a CPU
    without native bf16 matrix products (AVX2 alone, as on many laptops) computes far slower than float32
    (docs/benchmarks.md). The settings, the update and the state (a momentum buffer per matrix, as torch's) are
    otherwise torch's own."""

    def __init__(self, params, **settings):
        if settings.get("adjust_lr_fn") not in (None, "original"):
            raise ValueError("this Muon scales the learning rate as adjust_lr_fn='original' does, and only so")
        super().__init__(params, **settings)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                scale = math.sqrt(max(1, p.size(0) / p.size(1)))  # torch's adjust_lr_fn="original"
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"] * scale)


def orthogonalize(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration in float32: g (rows, cols) mapped to about U V^T of its SVD."""
    a, b, c = coefficients
    x = g.float()
    wide = x.T if x.size(0) > x.size(1) else x  # (short side, long side): the Gram matrix is the small one
    wide = wide / wide.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = wide @ wide.T
        wide = torch.addmm(wide, torch.addmm(gram, gram, gram, beta=b, alpha=c), wide, beta=a)
    return wide.T if x.size(0) > x.size(1) else wide


def make_scheduler(optimizer: torch.optim.Optimizer, schedule: "Schedule") -> LambdaLR:
    """The optimiser's learning rate at each step: its peak times schedule.factor(step), in closed form, so that a
    plan changed mid-run (Schedule.replan) takes effect from the next step."""
    return LambdaLR(optimizer, lambda step: schedule.factor(step))


def decay_steps(oc: OptimConfig, max_iters: int) -> int:
    """How many of max_iters steps the decay takes: the last decay_frac of them, and none of the warm-up's."""
    return max(1, min(max_iters - oc.warmup_iters, round(oc.decay_frac * max_iters)))


def decay_begins(oc: OptimConfig, max_iters: int) -> int:
    """The step from which a plan of max_iters steps decays; before it, the rate is the same for any length."""
    return max_iters - decay_steps(oc, max_iters)


class Schedule:
    """One curve for every optimiser, scaled to its own peak: a linear warm-up (warmup_iters), the peak held, a
    cosine or linear decay to min_lr / lr at the plan's end. The plan is a list of (from step, end step): the
    first from step 0, as planned from the start; each later one refits what is left of the decay to a new end
    (a budget run whose speed changed), from the share of the decay done when it was made. No plan: the length
    is still open, and the rate holds at its peak after the warm-up."""

    def __init__(self, oc: OptimConfig, plan: list | int | None = None):
        self.oc = oc
        self.set(plan)

    def set(self, plan: list | int | None) -> None:
        """Follow `plan`: a record's [[from step, end step], ...], max_iters steps planned from the start, or None
        (open)."""
        self.plan = []  # (from step, end step, share of the decay done at from step, step the decay runs from)
        for start, end in ([(0, plan)] if isinstance(plan, int) else plan or []):
            self.replan(start, end)

    @property
    def end(self) -> int | None:
        return self.plan[-1][1] if self.plan else None

    def record(self) -> list[list[int]]:
        """The plan as a checkpoint keeps it: [[from step, end step], ...]."""
        return [[start, end] for start, end, _, _ in self.plan]

    def replan(self, step: int, end: int) -> None:
        """From `step` on, end at `end` (at least step): the decay's share done so far is kept, and the rest of it
        spread over the steps left; a decay not yet begun begins where a plan of `end` steps begins it."""
        if self.plan and not self.plan[-1][0] <= step <= end:
            raise ValueError(f"a plan changed at step {step} must end at or after it, and after the plan's last "
                             f"change (step {self.plan[-1][0]}); got end {end}")
        done = self.progress(step) if self.plan else 0.0
        begins = step if done > 0 else max(step, decay_begins(self.oc, end))
        self.plan.append((step, end, done, begins))

    def progress(self, step: int) -> float:
        """The share of the decay done after `step` steps: 0 until it begins, 1 at the plan's end."""
        segment = next((s for s in reversed(self.plan) if s[0] <= step), None)
        if segment is None:
            return 0.0
        _, end, done, begins = segment
        if step >= end:  # a plan cut short where it is made (a budget run that must end now) ends at its end too
            return 1.0
        return done if step <= begins else done + (1 - done) * (step - begins) / (end - begins)

    def factor(self, step: int) -> float:
        """The rate after `step` steps, as a share of the peak."""
        oc = self.oc
        if step < oc.warmup_iters:
            start = 1 / oc.warmup_iters
            return start + (1 - start) * step / oc.warmup_iters
        done = self.progress(step)
        left = (1 + math.cos(math.pi * done)) / 2 if oc.decay == "cosine" else 1 - done  # of the way down
        floor = oc.min_lr / oc.lr
        return floor + (1 - floor) * left


def set_step(scheduler: LambdaLR, step: int) -> None:
    """Put a scheduler at `step` of its plan, its optimiser's rates with it (a resumed run)."""
    scheduler.last_epoch = step
    for group, base, lr_lambda in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                      strict=True):
        group["lr"] = base * lr_lambda(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
