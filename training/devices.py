"""Which torch device to run on: the one named, or with "auto" the best one present."""

import torch


def choose_device(name: str) -> torch.device:
    """'auto' picks cuda, then mps, then cpu. A named device that is absent is a ValueError whose
    one-line message starts with the name, so that callers can prefix their option: `--device cuda is ...`."""
    available = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
    if name == "auto":
        return torch.device(next(device for device, ok in available.items() if ok))
    if name not in available:
        raise ValueError(f"{name!r} is not a device: use auto, cuda, mps or cpu")
    if not available[name]:
        usable = ", ".join(device for device, ok in available.items() if ok)
        raise ValueError(f"{name} is not available on this machine (available: {usable}, or auto)")
    return torch.device(name)
