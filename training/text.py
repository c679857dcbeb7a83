"""The text a run trains on, obtained and checked against the settings before anything is built, and the memory
the model and its batch need."""

import dataclasses

import torch

from data import Batches, DataError, PreparedData, UnknownCharacterError, prepare_training_text
from runtime.checkpoint import trained_on
from runtime.devices import gib, memory_needed, memory_of
from runtime.errors import ConfigError

from .config import TrainConfig


OPENING = 80  # the most characters of a text's first line that sample a run when the default prompt cannot


def prepare_data(settings, resumed: dict | None = None) -> PreparedData:
    """The text data.text names (tiny_shakespeare when none), obtained and encoded, checked to fit the settings:
    splits longer than the model's context, and the text that a resumed checkpoint was trained on."""
    dc = settings.data
    try:
        data = prepare_training_text(dc.text, dc.root, val_fraction=dc.val_fraction)
    except DataError as e:
        raise ConfigError(str(e)) from None
    for split in ("train", "val"):  # found now rather than at the first evaluation
        try:
            Batches(getattr(data, split), settings.model.block_size, batch_size=1)
        except DataError as e:
            raise ConfigError(f"the {split} split of {data.source} is too short: {e}") from None
    if resumed is not None and resumed.get("text", {}).get("sha256") != data.sha256:
        raise ConfigError(f"train.resume: the checkpoint was trained on {trained_on(resumed)}, not on "
                          f"{data.source}; resume with the text it was trained on (data.text)")
    return data


def fit_sample_prompt(settings, data: PreparedData) -> tuple:
    """The settings with a sample prompt made of the text's characters, and why it changed (None if it did not).
    Where the default line of Romeo and Juliet is not, the text's own first line is (at most OPENING characters);
    a prompt of the user's own that is not is a ConfigError."""
    prompt = settings.train.sample_prompt
    try:
        data.vocab.encode(prompt)
        return settings, None
    except UnknownCharacterError as e:
        missing = ", ".join(map(repr, e.chars))
    if prompt != TrainConfig.sample_prompt:
        raise ConfigError(f"train.sample_prompt has characters not in the vocabulary of {data.source} ({missing}); "
                          f"set train.sample_prompt='...' to text made of its characters")
    opening = data.vocab.decode(data.train[:OPENING].tolist())
    line, newline, _ = opening.partition("\n")
    opening = line + newline if line else opening
    return settings.replaced({"train.sample_prompt": opening}), (
        f"train.sample_prompt: the default line of Romeo and Juliet has characters not in {data.source} "
        f"({missing}); each evaluation samples after the text's first line instead: {opening!r}")


def check_training_fits_memory(settings, vocab_size: int, device: torch.device) -> None:
    """Refuse a model and batch that the device's memory cannot hold, before either is built."""
    tc = settings.train
    model_config = dataclasses.replace(settings.model, vocab_size=vocab_size)
    needed, available = memory_needed(model_config, tc.batch_size), memory_of(device)
    if needed > available:
        raise ConfigError(f"the model and train.batch_size={tc.batch_size} need at least {gib(needed)} "
                          f"GiB, and the {device.type} device has {gib(available)} GiB; choose a "
                          f"smaller model or batch")
