"""The optimisers and their learning-rate schedules, from torch.optim.

adamw: AdamW on every parameter. muon: Muon on the blocks' hidden 2-D weights (attention and MLP
matrices), AdamW on everything else (embeddings and the tied head, LayerNorm gains, biases), each with its
own peak learning rate and the same schedule.
"""

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

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
        optimizers.append(torch.optim.Muon([params[name] for name in sorted(hidden)], lr=oc.muon_lr,
                                           momentum=oc.muon_momentum, weight_decay=oc.muon_weight_decay,
                                           adjust_lr_fn="original"))
    return optimizers


def make_scheduler(optimizer: torch.optim.Optimizer, oc: OptimConfig, max_iters: int):
    """Linear warmup from peak / warmup_iters to the optimiser's peak lr, then a cosine decay to
    peak * min_lr / lr at max_iters: every optimiser follows the same curve, scaled to its own peak."""
    peak = optimizer.param_groups[0]["lr"]
    cosine = CosineAnnealingLR(optimizer, T_max=max_iters - oc.warmup_iters, eta_min=peak * oc.min_lr / oc.lr)
    if oc.warmup_iters == 0:
        return cosine
    warmup = LinearLR(optimizer, start_factor=1 / oc.warmup_iters, total_iters=oc.warmup_iters)
    return SequentialLR(optimizer, [warmup, cosine], milestones=[oc.warmup_iters])
