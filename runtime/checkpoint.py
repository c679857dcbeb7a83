"""The checkpoint format's one home: what a checkpoint holds, how it is written and read, and the model it
rebuilds.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, so it loads with
`torch.load(weights_only=True)`: loading one never runs code. Every checkpoint holds

    format, version   FORMAT and VERSION, so that other files and other versions are recognised
    model_config      dict of GPTConfig's fields
    vocab             the character vocabulary, as one string in id order
    model             the model's state_dict (no `_orig_mod.` or `module.` prefix)

and one that train.py writes adds `text`, what it was trained on ({"source": tiny_shakespeare or the file's path,
"sha256": the file's, "char_counts": how often its training split holds each character, in id order, absent from
files of earlier versions}), and `training`: optimizers, schedulers (one per optimiser), step, best_val_loss,
rng, config and run_id (the identity of the run directory it was saved in: a run continues in place only in
the directory whose checkpoints record its own; absent from files of earlier versions). A run with
train.ema_decay saves the moving average of its weights as `model`, and the weights it trains as
training["raw_model"].
"""

import argparse
import dataclasses
import json
import math
import pickle
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from data import (DATASETS, SHAKESPEARE, VAL_FRACTION, CharVocab, DataError, PreparedData,
                  prepare_training_text)
from model import GPT, GPTConfig, build_model
from model.checks import is_integer
from model.decoding.quantize import to_precision

from .errors import CheckpointError, OutputError, one_line
from .files import link_loop, special_kind, write_atomically
from .hf import is_export, read_export, unreadable_export

FORMAT = "kvgpt-checkpoint"
VERSION = 2  # bump when the layout changes; older files then get a clear error instead of a wrong model
# the layout above, entry by entry, beside format and version (checkpoint_contents puts it together, layout_damage
# checks it): text and training are there only where recorded
LAYOUT = {"model_config": dict, "vocab": str, "model": dict, "text": dict, "training": dict}
OPTIONAL = ("text", "training")
TEXT = {"source": str, "sha256": str}
COUNTING_CHUNK = 1 << 24  # tokens counted at once: np.bincount copies them into 64-bit integers
TRAINING_KEYS = ("optimizers", "schedulers", "step", "best_val_loss", "rng", "config")


def checkpoint_contents(config: GPTConfig, vocab: CharVocab, state: dict, *, source: str = "",
                        sha256: str | None = None, char_counts: list[int] | None = None,
                        training: dict | None = None) -> dict:
    """A checkpoint's contents in the layout above, the one place they are put together: a model's weights
    (state), its config and vocabulary; the text it was trained on where its sha256 is known, with its characters'
    counts where known; the training state."""
    contents = {"format": FORMAT, "version": VERSION, "model_config": dataclasses.asdict(config),
                "vocab": vocab.chars, "model": state}
    if sha256 is not None:
        contents["text"] = {"source": source, "sha256": sha256}
        if char_counts is not None:
            contents["text"]["char_counts"] = char_counts
    if training is not None:
        missing = set(TRAINING_KEYS) - training.keys()
        if missing:
            raise ValueError(f"training state lacks {sorted(missing)}")
        contents["training"] = training
    return contents


def build_checkpoint(model: GPT, vocab: CharVocab, training: dict | None = None,
                     text: PreparedData | None = None) -> dict:
    """A checkpoint's contents: the model and its vocabulary, what it was trained on, and for resuming, the
    training state."""
    recorded = {} if text is None else {"source": text.source, "sha256": text.sha256,
                                        "char_counts": char_counts(text.train, len(vocab))}
    return checkpoint_contents(model.config, vocab, model.state_dict(), **recorded, training=training)


def char_counts(tokens: np.ndarray, size: int) -> list[int]:
    """How often each of the ids 0..size-1 occurs in tokens, a chunk at a time."""
    counts = np.zeros(size, dtype=np.int64)
    for start in range(0, len(tokens), COUNTING_CHUNK):
        counts += np.bincount(tokens[start:start + COUNTING_CHUNK], minlength=size)
    return counts.tolist()


def save_checkpoint(contents: dict, path) -> Path:
    """Write a checkpoint atomically into an existing folder (a run directory removed while its run trains is not
    made again): a crash mid-write leaves the previous file intact. A failed write (a full disk, a folder gone) is
    an OutputError; an interruption during the write (a second Ctrl-C) stays a KeyboardInterrupt."""
    path = Path(path)
    try:
        return write_atomically(path, lambda file: torch.save(contents, file))
    except (OSError, RuntimeError) as e:  # torch.save turns what its writes raise into a RuntimeError
        cause = e.__context__ if isinstance(e, RuntimeError) and e.__context__ is not None else e
        if isinstance(cause, KeyboardInterrupt):
            raise cause from None
        kept = "the previous one is kept" if path.exists() else f"{path.name} was not written"
        raise OutputError(f"cannot save {path} ({one_line(cause)}); {kept}") from None


def resolve_checkpoint(path, prefer: str = "best.pt") -> Path:
    """A checkpoint file as given, or inside a run directory `prefer` (falling back to the other of best/last)."""
    path = Path(path)
    if is_export(path):
        return path
    if path.is_dir():
        fallback = "last.pt" if prefer == "best.pt" else "best.pt"
        for name in (prefer, fallback):
            if (path / name).is_file():
                return path / name
        runs = sorted({p.parent for name in (prefer, fallback) for p in path.rglob(name)})
        if runs:  # a folder of runs, such as runs/
            raise CheckpointError(f"{path} is no run directory but holds {len(runs)} below it ({runs[0]}"
                                  f"{f' ... {runs[-1]}' if len(runs) > 1 else ''}); pass one of them")
        if kind := unreadable_export(path):
            raise CheckpointError(f"{path} is {kind}, which kvgpt does not read back; pass the checkpoint it was "
                                  f"exported from, or an export in the hf format (export.py's default)")
        raise CheckpointError(f"run directory {path} holds neither {prefer} nor {fallback}; "
                              f"train with `python train.py` or pass a checkpoint file")
    if loop := link_loop(path):
        raise CheckpointError(f"{path}: cannot follow its links ({one_line(loop)}); pass a checkpoint file")
    if kind := special_kind(path):
        raise CheckpointError(f"{path} is {kind}, not a checkpoint file; pass a checkpoint file or a run directory")
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; train one with `python train.py` or pass an existing file")
    return path


def existing_checkpoint(text: str) -> Path:
    """An argparse type: a checkpoint file, or a run directory's (resolve_checkpoint), found before any work."""
    try:
        return resolve_checkpoint(text)
    except CheckpointError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def load_checkpoint(path, prefer: str = "best.pt", map_location="cpu") -> dict:
    """Load a checkpoint file, or a run directory's `prefer`, safely; every failure is a CheckpointError with a
    one-line message."""
    path = resolve_checkpoint(path, prefer)
    if is_export(path):
        return load_export(path)
    try:
        with warnings.catch_warnings():  # e.g. about the pickle protocol of a file that is no checkpoint at all
            warnings.simplefilter("ignore")
            contents = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # weights_only=True refuses a pickle that names a function or class ("GLOBAL module.name"): loading it
        # would call that. Any other refusal is a file that is no pickle torch.load can read.
        unsafe = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if unsafe:
            raise CheckpointError(f"refusing unsafe checkpoint {path}: it names {unsafe[1]}, which would run "
                                  f"when loaded (torch.load weights_only=True rejected it)") from None
        raise CheckpointError(f"{path} is corrupt or not a PyTorch checkpoint; pass a best.pt or last.pt "
                              f"written by train.py") from None
    except Exception as e:  # a damaged file can fail anywhere inside the unpickler
        other = path.with_name("best.pt" if path.name == "last.pt" else "last.pt")
        raise CheckpointError(f"{path} is truncated or corrupt ({type(e).__name__}: {one_line(e)[:200]}); use another "
                              f"checkpoint{f', e.g. {other}' if other.is_file() else ''}") from None
    if not isinstance(contents, dict) or not str(contents.get("format", "")).startswith(FORMAT):
        raise CheckpointError(f"{path} is not a kvgpt checkpoint (no '{FORMAT}' format marker); "
                              f"pass a best.pt or last.pt written by train.py")
    version = contents.get("version", contents["format"].removeprefix(f"{FORMAT}-v"))
    if version != VERSION:
        raise CheckpointError(f"{path} is a kvgpt checkpoint of format version {version}, and this version of "
                              f"kvgpt reads version {VERSION}; train a new one with `python train.py`")
    damage = layout_damage(contents)
    if damage:
        raise CheckpointError(f"{path} is damaged ({damage}); use another checkpoint")
    return contents


def load_export(path: Path) -> dict:
    """An exported folder as a checkpoint's contents, its weights mapped back and the folder checked whole
    (runtime/hf.py: read_export). load_model checks the weights' names and shapes."""
    try:
        config, state, vocab, recorded = read_export(path)
        counts = recorded.get("data_char_counts")
        contents = checkpoint_contents(config, vocab, state, source=recorded.get("data", ""),
                                       sha256=recorded.get("data_sha256") or None,
                                       char_counts=json.loads(counts) if counts else None)
        if damage := layout_damage(contents):
            raise ValueError(damage)
    except Exception as e:  # a damaged file can fail anywhere in json, safetensors or the mapping
        raise CheckpointError(export_damaged(path, e)) from None
    return contents


def export_damaged(path: Path, error: Exception) -> str:
    return (f"{path} is no folder that export.py wrote, or is damaged ({type(error).__name__}: "
            f"{one_line(error)[:200]}); export the checkpoint again")


def layout_damage(contents: dict) -> str | None:
    """What in a checkpoint's contents is not of the layout above (a key missing, a value of another type), or
    None. Whether the values fit one another (the weights the model, the optimiser the weights) is found when
    they are loaded."""
    def is_loss(value) -> bool:  # a float, inf included (no evaluation yet), never NaN
        return isinstance(value, float) and not math.isnan(value)

    for key, kind in LAYOUT.items():
        value = contents.get(key)
        if not (isinstance(value, kind) or (value is None and key in OPTIONAL)):
            return f"{key} is {type(value).__name__}, not {kind.__name__}"
    if not all(isinstance(name, str) and isinstance(value, torch.Tensor) for name, value in contents["model"].items()):
        return "model holds values that are not tensors"
    text = contents.get("text")
    if text is not None and not all(isinstance(text.get(key), kind) for key, kind in TEXT.items()):
        return "text is not a source and a sha256"
    counts = (text or {}).get("char_counts")
    if counts is not None and not (isinstance(counts, list) and len(counts) == len(contents["vocab"]) and
                                   all(is_integer(n) and n >= 0 for n in counts)):
        return "text's char_counts are not one count per character"
    state = contents.get("training")
    if state is None:
        return None
    missing = [key for key in TRAINING_KEYS if key not in state]
    if missing:
        return f"training lacks {', '.join(missing)}"
    checks = {"step": lambda v: is_integer(v) and v >= 0,
              "best_val_loss": is_loss, "config": lambda v: isinstance(v, dict),
              "optimizers": lambda v: isinstance(v, list), "schedulers": lambda v: isinstance(v, list),
              "rng": lambda v: isinstance(v, list) and all(isinstance(r, dict) and isinstance(r.get("torch"),
                                                                                                 torch.Tensor)
                                                          and isinstance(r.get("batches"), dict) for r in v),
              "run_id": lambda v: isinstance(v, str)}
    for key, ok in checks.items():
        if key in state and not ok(state[key]):
            return f"training's {key} is {state[key]!r:.40}, not of its kind"
    return None


def load_model(path, device="cpu", prefer: str = "best.pt", precision: str = "fp32") -> tuple[GPT, CharVocab, dict]:
    """The model (in eval mode, on `device`, converted to `precision` for decoding: model/decoding/quantize.py) and
    vocabulary of a checkpoint file or run directory, and the checkpoint's contents."""
    contents = load_checkpoint(path, prefer)
    try:
        model = build_model(GPTConfig(**contents["model_config"]))
        model.load_state_dict(contents["model"])
        vocab = CharVocab(contents["vocab"])
        if len(vocab) > model.config.vocab_size:
            raise ValueError(f"{len(vocab)} characters for vocab_size {model.config.vocab_size}")
    except (KeyError, TypeError, ValueError, RuntimeError, DataError) as e:
        path = resolve_checkpoint(path, prefer)
        if is_export(path):  # weights missing or of other shapes than config.json's model has
            raise CheckpointError(export_damaged(path, e)) from None
        # A kvgpt checkpoint, but one this version of the code cannot rebuild a model from.
        raise CheckpointError(f"{path} does not fit this version of the model ({one_line(e)[:200]})") from None
    broken = [name for name, weight in model.named_parameters() if not weight.isfinite().all()]
    if broken:
        raise CheckpointError(f"{resolve_checkpoint(path, prefer)} holds NaN or infinite weights (in "
                              f"{', '.join(broken[:3])}{', ...' if len(broken) > 3 else ''}); use another checkpoint")
    return to_precision(model.to(device), precision), vocab, contents


def training_text(contents: dict) -> PreparedData:
    """The text a checkpoint's model was trained on, prepared where its run prepared it (tiny_shakespeare is
    downloaded if absent). A DataError when the checkpoint does not record one, or the text has changed since."""
    text = contents.get("text")
    if not text:
        raise DataError("the checkpoint does not record the text it was trained on")
    data_settings = contents.get("training", {}).get("config", {}).get("data", {})
    data = prepare_training_text(None if text["source"] == SHAKESPEARE else text["source"],
                                 data_settings.get("root", DATASETS),
                                 val_fraction=data_settings.get("val_fraction", VAL_FRACTION))
    if data.sha256 != text["sha256"]:
        raise DataError(f"{text['source']} has changed since the checkpoint was trained on it")
    return data


def trained_on(contents: dict) -> str:
    """The text a checkpoint's model was trained on, as a checkpoint records it."""
    text = contents.get("text")
    return f"{text['source']} (sha256 {text['sha256'][:12]})" if text else "an unrecorded text"


def find_latest_checkpoint(runs_dir="runs", name: str = "best.pt") -> Path:
    """The most recently written `name` anywhere under `runs_dir` (single runs and multirun jobs alike)."""
    runs_dir = Path(runs_dir)
    found = [p for p in runs_dir.rglob(name) if p.is_file() and not p.is_symlink()] if runs_dir.is_dir() else []
    if not found:
        raise CheckpointError(f"no {name} found under {runs_dir.resolve()}/; "
                              f"run `python train.py` first, or pass --checkpoint")
    return max(found, key=lambda p: p.stat().st_mtime_ns)
