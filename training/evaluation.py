"""Evaluation: the mean loss of each split over a fixed set of batches."""

import torch
import torch.distributed as dist

from data import Batches, PreparedData


@torch.no_grad()
def evaluate(model, data: PreparedData, block_size: int, batch_size: int, eval_iters: int, seed: int,
             device: torch.device, autocast, world_size: int) -> dict[str, float]:
    """Mean loss over eval_iters batches of each split (and over the processes). The batches are the same at
    every evaluation, so that evaluations differ only by the weights."""
    model.eval()
    means = []
    for tokens in (data.train, data.val):
        batches = Batches(tokens, block_size, batch_size, device, seed=seed)
        losses = torch.empty(eval_iters, device=device)
        for i in range(eval_iters):
            x, y = batches.next()
            with autocast:
                losses[i] = model(x, y)[1]
        means.append(losses.mean())
    means = torch.stack(means)
    if world_size > 1:
        dist.all_reduce(means)
        means /= world_size
    model.train()
    train_loss, val_loss = means.tolist()
    return {"train": train_loss, "val": val_loss}
