"""The optimiser and its learning-rate schedule, from torch.optim."""

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from .config import OptimConfig


def make_optimizer(model: torch.nn.Module, oc: OptimConfig, fused: bool) -> torch.optim.AdamW:
    # Decay pulls matrices and embeddings towards zero; biases and LayerNorm gains (1-D) keep their scale.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": oc.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=oc.lr, betas=(oc.beta1, oc.beta2), fused=fused)


def make_scheduler(optimizer: torch.optim.Optimizer, oc: OptimConfig, max_iters: int):
    """Linear warmup from lr / warmup_iters to lr, then a cosine decay to min_lr at max_iters."""
    cosine = CosineAnnealingLR(optimizer, T_max=max_iters - oc.warmup_iters, eta_min=oc.min_lr)
    if oc.warmup_iters == 0:
        return cosine
    warmup = LinearLR(optimizer, start_factor=1 / oc.warmup_iters, total_iters=oc.warmup_iters)
    return SequentialLR(optimizer, [warmup, cosine], milestones=[oc.warmup_iters])
