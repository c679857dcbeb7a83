"""Data-parallel training under torchrun: joining the process group, and which process speaks."""

import os

import torch
import torch.distributed as dist


def init_distributed(device: torch.device) -> tuple[int, int, torch.device]:
    """(rank, world size, this process's device); joins the process group that torchrun set up, if any."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world_size, device


def is_rank_zero() -> bool:
    """Whether this process is the one that writes files and talks to the user (before and after the group)."""
    return int(os.environ.get("RANK", 0)) == 0


def gather(obj, world_size: int) -> list:
    """Every process's obj, in rank order."""
    if world_size == 1:
        return [obj]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return gathered
