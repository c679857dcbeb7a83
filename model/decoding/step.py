"""What every decoding step does: a pass of the model through a KV cache (model/kv_cache.py: Cache), given as
the model gives it.

Three kinds of step decode. The model's own decode_step runs eagerly through any cache. A step compiled ahead of
time (aot_step.py: AotStep) serves any cache shaped like the one it was exported with, and a step captured as CUDA
graphs (cuda_graph.py: CapturedStep) serves the one cache it was captured over. generate takes its one-token steps
through a Step's decode_step; speculative decoding verifies its drafts through a Step, and a CachedText feeds its
text through one (model/decoding/cached_text.py).

    if step.fits(cache):                          # its own cache, or one of its shape, for one token per row
        logits = step.decode_step(idx, cache)     # (B, vocab_size): what model.decode_step(idx, cache) gives

Step lives beside the loop, not beside Cache in the core, which keeps to its 430 lines.
"""

from typing import Callable, Protocol

import torch

from ..kv_cache import Cache

# tokens (B, t) through a cache -> the last position's logits (B, vocab_size): GPT.decode_step, or a Step's
DecodeStep = Callable[[torch.Tensor, Cache], torch.Tensor]


class Step(Protocol):
    """A pass of the model of 1 to `tokens` tokens per row, made ahead of time for the caches it fits."""

    cache: Cache | None  # the one cache it serves; None: any cache it fits
    tokens: int  # the most tokens per row one pass takes
    def __call__(self, idx: torch.Tensor, cache: Cache) -> torch.Tensor: ...  # (B, t) -> logits (B, t, vocab_size)
    def decode_step(self, idx: torch.Tensor, cache: Cache) -> torch.Tensor: ...  # GPT.decode_step's logits
    def fits(self, cache: Cache, tokens: int = 1) -> bool: ...  # whether it takes passes of `tokens` through cache
    def takes(self, tokens: int) -> bool: ...  # whether it takes passes of `tokens` through the caches it fits
