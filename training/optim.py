"""The optimisers and their learning-rate schedules, from torch.optim.

adamw: AdamW on every parameter. muon: Muon on the blocks' hidden 2-D weights (attention and MLP
matrices), AdamW on everything else (embeddings and the tied head, LayerNorm gains, biases), each with its
own peak learning rate and the same schedule.
"""

import math
import warnings

import torch
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR

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


def make_scheduler(optimizer: torch.optim.Optimizer, oc: OptimConfig, max_iters: int | None):
    """Linear warmup from peak / warmup_iters to the optimiser's peak lr, held there until the decay's last
    decay_steps() steps, a cosine or linear decay to peak * min_lr / lr at max_iters: every optimiser follows the
    same curve, scaled to its own peak. max_iters None: the length is still open (a budget fixes it as the run
    goes), and the rate holds at its peak after the warm-up."""
    peak = optimizer.param_groups[0]["lr"]
    hold_iters = OPEN if max_iters is None else decay_begins(oc, max_iters) - oc.warmup_iters
    phases, milestones = [], []
    if oc.warmup_iters:
        phases.append(LinearLR(optimizer, start_factor=1 / oc.warmup_iters, total_iters=oc.warmup_iters))
        milestones.append(oc.warmup_iters)
    if hold_iters:
        phases.append(ConstantLR(optimizer, factor=1.0, total_iters=hold_iters))
        milestones.append(oc.warmup_iters + hold_iters)
    if max_iters is not None:
        decay_iters = decay_steps(oc, max_iters)
        phases.append(CosineAnnealingLR(optimizer, T_max=decay_iters, eta_min=peak * oc.min_lr / oc.lr)
                      if oc.decay == "cosine" else
                      LinearLR(optimizer, start_factor=1.0, end_factor=oc.min_lr / oc.lr, total_iters=decay_iters))
    # a milestone where each phase but the last ends (an open schedule's hold is its last)
    return SequentialLR(optimizer, phases, milestones[:len(phases) - 1]) if len(phases) > 1 else phases[0]


OPEN = 10**9  # steps an open schedule holds its peak: more than any budget buys


def decay_steps(oc: OptimConfig, max_iters: int) -> int:
    """How many of max_iters steps the decay takes: the last decay_frac of them, and none of the warm-up's."""
    return max(1, min(max_iters - oc.warmup_iters, round(oc.decay_frac * max_iters)))


def decay_begins(oc: OptimConfig, max_iters: int) -> int:
    """The step from which a plan of max_iters steps decays; before it, the rate is the same for any length."""
    return max_iters - decay_steps(oc, max_iters)


def advance(scheduler, steps: int) -> None:
    """Take a scheduler just made to `steps` steps into its plan, as a run planned so from the start would have
    stepped it, leaving its optimiser's learning rates there (a resumed run taking a plan of another length)."""
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr  # the plan's first rate: each step's rate follows from the one before
    with warnings.catch_warnings():  # about stepping it before the optimiser, as this does on purpose
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before")
        for _ in range(steps):
            scheduler.step()
