"""Checkpoints on disk: atomic writes, safe loads, and the lookup of the newest run's best checkpoint.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, so it loads with
`torch.load(weights_only=True)`: loading one never runs code. Every checkpoint holds at least

    format        FORMAT, so that other files are recognised as not ours
    model_config  dict of GPTConfig's fields
    vocab         the character vocabulary, as one string in id order
    model         the model's state_dict (no `_orig_mod.` prefix from torch.compile)

and a training checkpoint adds optimizer, scheduler, step, best_val_loss, rng and config.
"""

import pickle
from pathlib import Path

import torch

from data.atomic import write_atomically

FORMAT = "kvgpt-checkpoint-v1"
REQUIRED_KEYS = ("model_config", "vocab", "model")


class CheckpointError(Exception):
    """A checkpoint that is missing, unreadable, unsafe or not this project's. The message is one line."""


def save_checkpoint(state: dict, path) -> Path:
    """Write `state` to `path` atomically: a crash mid-write leaves the previous file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(path, lambda file: torch.save({"format": FORMAT, **state}, file))


def resolve_checkpoint(path, prefer: str = "best.pt") -> Path:
    """A checkpoint file as given, or inside a run directory `prefer` (falling back to the other of best/last)."""
    path = Path(path)
    if path.is_dir():
        fallback = "last.pt" if prefer == "best.pt" else "best.pt"
        for name in (prefer, fallback):
            if (path / name).is_file():
                return path / name
        raise CheckpointError(f"run directory {path} holds neither {prefer} nor {fallback}; "
                              f"train with `python train.py` or pass a checkpoint file")
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; train one with `python train.py` or pass an existing file")
    return path


def find_latest_checkpoint(runs_dir="runs", name: str = "best.pt") -> Path:
    """The most recently written `name` anywhere under `runs_dir` (single runs and multirun jobs alike)."""
    runs_dir = Path(runs_dir)
    found = [p for p in runs_dir.rglob(name) if p.is_file() and not p.is_symlink()] if runs_dir.is_dir() else []
    if not found:
        raise CheckpointError(f"no {name} found under {runs_dir.resolve()}/; "
                              f"run `python train.py` first, or pass --checkpoint")
    return max(found, key=lambda p: p.stat().st_mtime_ns)


def load_checkpoint(path, map_location="cpu") -> dict:
    """Load a checkpoint safely; every failure is a CheckpointError with a one-line message."""
    path = resolve_checkpoint(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" in str(e).lower():
            raise CheckpointError(f"refusing unsafe checkpoint {path}: it holds Python objects that would run code "
                                  f"when loaded (torch.load weights_only=True rejected it)") from None
        raise CheckpointError(f"{path} is corrupt or not a PyTorch checkpoint ({_first_line(e)})") from None
    except Exception as e:  # a damaged file can fail anywhere inside the unpickler
        raise CheckpointError(f"{path} is truncated or corrupt ({_first_line(e)}); "
                              f"use another checkpoint, e.g. the run's last.pt") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT or any(k not in ckpt for k in REQUIRED_KEYS):
        raise CheckpointError(f"{path} is not a kvgpt checkpoint (no '{FORMAT}' format marker with "
                              f"{', '.join(REQUIRED_KEYS)}); pass a best.pt or last.pt written by train.py")
    return ckpt


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    text = lines[0].split(". ")[0].rstrip(".") if lines else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
