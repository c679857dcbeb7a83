"""The random state a resumed run needs to draw exactly what the uninterrupted run would have drawn."""

import torch

from data import Batches


def rng_state(batches: Batches, device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "batches": batches.state_dict()}
    if device.type != "cpu":
        state["device"] = torch.get_device_module(device).get_rng_state()
    return state


def restore_rng(states: list, batches: Batches, rank: int, world_size: int, device: torch.device) -> bool:
    """Restore this process's state from every process's states; False (nothing restored) when the run had
    another number of processes, whose batches and dropout then draw afresh from the seed."""
    if len(states) != world_size:
        return False
    load_rng_state(states[rank], batches, device)
    return True


def load_rng_state(state: dict, batches: Batches, device: torch.device) -> None:
    """Restore what rng_state() returned in this process."""
    torch.set_rng_state(state["torch"])
    batches.load_state_dict(state["batches"])
    if "device" in state and device.type != "cpu":
        torch.get_device_module(device).set_rng_state(state["device"])
