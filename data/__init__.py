"""Data for kvgpt: tiny_shakespeare obtained and encoded once, its character vocabulary, and random batches.

    prepared = prepare_shakespeare("datasets/tiny_shakespeare")
    batches = Batches(prepared.train, block_size=256, batch_size=64, device="cuda", seed=1337)
    x, y = batches.next()

Bad input raises DataError (UnknownCharacterError for text outside the vocabulary) with a one-line message.
"""

from .batches import Batches
from .errors import DataError, UnknownCharacterError
from .shakespeare import SHA256, SOURCE_URL, PreparedData, prepare_shakespeare
from .vocab import CharVocab

__all__ = ["Batches", "CharVocab", "DataError", "PreparedData", "SHA256", "SOURCE_URL", "UnknownCharacterError",
           "prepare_shakespeare"]
