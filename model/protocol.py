"""What the decoding loop and the caches agree on, beside the core (model/kv_cache.py), which asks a cache only for
CachePass: what a cache can do (Abilities), what every cache does (Cache), and what every step made ahead of time
does (Step).

Three kinds of step decode. The model's own decode_step runs eagerly through any cache. A step compiled ahead of
time (decoding/aot_step.py: AotStep) serves any cache shaped like the one it was exported with, and a step captured
as CUDA graphs (decoding/cuda_graph.py: CapturedStep) serves the one cache it was captured over. generate takes its
one-token steps through a Step's decode_step, or, greedy, runs of them through its greedy_steps; speculative
decoding verifies its drafts through a Step, and a CachedText feeds its text through one (decoding/cached_text.py).

    if step.fits(cache):                          # its own cache, or one of its shape, for one token per row
        logits = step.decode_step(idx, cache)     # (B, vocab_size): what model.decode_step(idx, cache) gives
        # or, greedy: ids = step.greedy_steps(idx, cache, n), (B, n): n steps, each fed the last one's argmax
"""

from typing import Callable, NamedTuple, Protocol

import torch

from .kv_cache import CachePass


class Abilities(NamedTuple):
    """What a cache can do, which the decoding loop and sample.py read before they use it."""

    rolls_back: bool = True  # rollback(n) forgets the last n tokens (speculative decoding)
    takes_padding: bool = True  # rows may start with left padding: reset(n_pad)
    compiles: bool = True  # a step through it compiles into one graph: static shapes, no read back to the host
    budgeted: bool = False  # it keeps fewer tokens than block_size and places them itself: never refilled
    slides: bool = False  # each query sees only its last block_size keys (the ring): rope decodes past block_size


class Cache(Protocol):
    """What the model (begin) and the decoding loop ask of a KV cache; one may say its shape too (caches/ring.py)."""

    abilities: Abilities
    batch_size: int
    def begin(self, t: int) -> CachePass: ...  # the next t tokens, counted as fed from here on
    def reset(self, n_pad: torch.Tensor | None = None) -> None: ...  # empty; n_pad (B,): rows' left padding
    def longest_chunk(self) -> int: ...  # the most tokens the next pass may feed
    def rollback(self, n: int) -> None: ...  # forget the last n tokens fed
    def one_row(self) -> "Cache": ...  # an empty cache like this one, of one row
    def fill_from(self, other: "Cache") -> None: ...  # copy a one-row cache into every row


# tokens (B, t) through a cache -> the last position's logits (B, vocab_size): GPT.decode_step, or a Step's
DecodeStep = Callable[[torch.Tensor, Cache], torch.Tensor]


class Step(Protocol):
    """A pass of the model of 1 to `tokens` tokens per row, made ahead of time for the caches it fits."""

    cache: Cache | None  # the one cache it serves; None: any cache it fits
    tokens: int  # the most tokens per row one pass takes
    # (B, t) -> logits (B, t, vocab_size), which the step's next pass may overwrite: read them first
    def __call__(self, idx: torch.Tensor, cache: Cache) -> torch.Tensor: ...
    def decode_step(self, idx: torch.Tensor, cache: Cache) -> torch.Tensor: ...  # GPT.decode_step's logits
    # n one-token steps from idx (B, 1), each fed the argmax of the one before: the argmaxes (B, n)
    def greedy_steps(self, idx: torch.Tensor, cache: Cache, n: int) -> torch.Tensor: ...
    def fits(self, cache: Cache, tokens: int = 1) -> bool: ...  # whether it takes passes of `tokens` through cache
    def takes(self, tokens: int) -> bool: ...  # whether it takes passes of `tokens` through the caches it fits
