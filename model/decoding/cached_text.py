"""One row of text and a model's KV cache over it, fed only as far as each call needs: what speculative decoding
(model/serving/speculative.py) and a conversation (model/serving/conversation.py) build on.

Past block_size it follows generate's rules (model/decoding/generate.py): a rotary model's ring rolls on, and a
learned-position model's context jumps forward to its last `keep` tokens, its cache refilled. The tokens
already fed stay in the cache until the text is cut back (truncate), which rolls the cache back past them.
"""

import math

import torch

from ..caches.factory import new_kv_cache
from ..gpt import GPT
from .generate import context_limits, moved_start, prefill
from ..protocol import Step


def text_cache(model: GPT, spare: int = 0):
    """The cache a CachedText keeps: one row of block_size + spare slots."""
    return new_kv_cache(model, 1, max_len=model.config.block_size + spare)


class CachedText:
    """tokens: the text, token ids, which callers extend; the cache holds tokens[start:fed].

    spare: slots beyond block_size, so that a chunk of up to spare + 1 tokens may cross the ring's end, and so
    many may be rolled back after it has wrapped (see model/caches/ring.py). cache: a text_cache(model,
    spare) made before, such as the one a CUDA graph was captured over (model/decoding/cuda_graph.py).
    """

    def __init__(self, model: GPT, *, spare: int = 0, keep: int | None = None, cache=None):
        self.model = model
        self.tokens: list[int] = []
        rows_and_slots = (1, model.config.block_size + spare)
        if cache is not None and (cache.batch_size, getattr(cache, "max_len", None)) != rows_and_slots:
            raise ValueError(f"cache must be text_cache(model, spare={spare}): one row of block_size + spare slots")
        self.cache = cache if cache is not None else text_cache(model, spare)
        self.rolling = model.config.pos_emb == "rope"  # the ring rolls on: the context never jumps
        self.span, self.keep = context_limits(model.config, keep)
        self.start = 0  # the context is tokens[start:]
        self.compiled: Step | None = None  # a Step for this cache (model/protocol.py): it takes every pass it fits

    @property
    def fed(self) -> int:
        """tokens[:fed] have gone through the model."""
        return self.start + len(self.cache)

    def prepare(self, length: int, fresh: bool = False) -> None:
        """Move the context's start where generate puts it before drawing the token after tokens[:length]:
        continuing from the current start, or as for a new prompt (fresh). A move empties the cache. A rotary
        model's context moves only when nothing it has cached can still matter."""
        if self.rolling:  # the ring rolls on, but a token span back or more no longer matters (generate's rule)
            if self.fed <= length - self.span:
                self.start = length - self.span
                self.cache.reset()
            return
        start = moved_start(0 if fresh else self.start, length, self.span, self.keep)
        if start != self.start:
            self.start = start
            self.cache.reset()

    def room(self, length: int) -> float:
        """How many tokens past tokens[:length] one pass may still predict from the same context."""
        return math.inf if self.rolling else self.start + self.span - length

    def logits(self, end: int, n: int = 1) -> torch.Tensor:
        """Feed tokens[fed:end] through the model, the last n of them in one pass; their logits (n, vocab_size),
        each the prediction of the token after it."""
        self.prepare(end - n + 1)
        if self.fed < end - n:  # what the cache lacks before them
            step = (self.compiled.decode_step, self.compiled.tokens) if self.compiled is not None else ()
            prefill(self.model, self._ids(self.fed, end - n), self.cache, *step)
        ids = self._ids(end - n, end)
        compiled = self.compiled is not None and self.compiled.takes(n)
        return (self.compiled(ids, self.cache) if compiled else self.model(ids, cache=self.cache)[0])[0]

    def truncate(self, length: int) -> None:
        """Keep tokens[:length] only, rolling the cache back past the rest."""
        del self.tokens[length:]
        excess = self.fed - length
        if excess <= 0:
            return
        if length >= self.start:
            self.cache.rollback(excess)
        else:  # the context had jumped past length: start again from the beginning
            self.start = 0
            self.cache.reset()

    def _ids(self, begin: int, end: int) -> torch.Tensor:
        return torch.tensor([self.tokens[begin:end]], device=self.cache.device)
