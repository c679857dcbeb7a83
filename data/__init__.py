"""Data for kvgpt: tiny_shakespeare or a text of your own, obtained and encoded once, its character vocabulary,
and random batches.

    prepared = prepare_shakespeare("datasets/tiny_shakespeare")  # or prepare_text("my.txt", "datasets")
    batches = Batches(prepared.train, block_size=256, batch_size=64, device="cuda", seed=1337)
    x, y = batches.next()

Bad input raises DataError (UnknownCharacterError for text outside the vocabulary) with a one-line message.
"""

from .batches import Batches
from .errors import DataError, UnknownCharacterError
from .prepare import (DATASETS, SHA256, SHAKESPEARE, SOURCE_URL, VAL_FRACTION, PreparedData,
                      prepare_shakespeare, prepare_text, prepare_training_text, read_regular_file)
from .vocab import CharVocab

__all__ = ["Batches", "CharVocab", "DATASETS", "DataError", "PreparedData", "SHA256", "SHAKESPEARE", "SOURCE_URL",
           "UnknownCharacterError", "VAL_FRACTION", "prepare_shakespeare", "prepare_text",
           "prepare_training_text", "read_regular_file"]
