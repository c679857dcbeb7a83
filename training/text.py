"""The text a run trains on, obtained and checked against the settings before anything is built, and the memory
the model and its batch need."""

import dataclasses

import torch

from data import Batches, DataError, PreparedData, UnknownCharacterError, prepare_training_text
from runtime.checkpoint import trained_on
from runtime.devices import memory_needed, memory_of
from runtime.errors import ConfigError

from .config import TrainConfig


def prepare_data(settings, resumed: dict | None = None) -> PreparedData:
    """The text data.text names (tiny_shakespeare when none), obtained and encoded, checked to fit the settings:
    splits longer than the model's context, a sample prompt made of the text's characters, and the text that a
    resumed checkpoint was trained on."""
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
    try:
        data.vocab.encode(settings.train.sample_prompt)
    except UnknownCharacterError as e:
        default = " (by default a line of Romeo and Juliet)" \
            if settings.train.sample_prompt == TrainConfig.sample_prompt else ""
        raise ConfigError(f"train.sample_prompt{default} has characters not in the vocabulary of {data.source} "
                          f"({', '.join(map(repr, e.chars))}); set train.sample_prompt='...' to text made of its "
                          f"characters") from None
    if resumed is not None and resumed.get("text", {}).get("sha256") != data.sha256:
        raise ConfigError(f"train.resume: the checkpoint was trained on {trained_on(resumed)}, not on "
                          f"{data.source}; resume with the text it was trained on (data.text)")
    return data


def check_memory(settings, vocab_size: int, device: torch.device) -> None:
    """Refuse a model and batch that the device's memory cannot hold, before either is built."""
    tc = settings.train
    model_config = dataclasses.replace(settings.model, vocab_size=vocab_size)
    needed, available = memory_needed(model_config, tc.batch_size), memory_of(device)
    if needed > available:
        raise ConfigError(f"the model and train.batch_size={tc.batch_size} need at least {needed / 2**30:,.1f} "
                          f"GiB, and the {device.type} device has {available / 2**30:,.1f} GiB; choose a "
                          f"smaller model or batch")
