"""How each next token is drawn from the model's logits: greedy, or sampled after temperature, top-k and top-p.

    sampling = Sampling(temperature=0.8, top_k=40)
    next_ids = sampling.next_token(logits)  # (B, vocab_size) -> (B,)
"""

import math
from dataclasses import dataclass

import torch

from ..checks import FLOAT32_TINY, is_integer, is_number


# The logits are divided in float32: a smaller temperature loses precision there or rounds to 0.
MIN_TEMPERATURE = FLOAT32_TINY


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (argmax); top_k keeps the k likeliest tokens; top_p keeps the fewest likeliest
    tokens whose probabilities sum to at least p. Invalid values are a ValueError naming the argument."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        t = self.temperature
        if not (is_number(t) and math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE)):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:.3g} (float32's "
                             f"smallest normal number), got {t!r}")
        if self.top_k is not None and not (is_integer(self.top_k) and self.top_k >= 1):
            raise ValueError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        if self.top_p is not None and not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if t == 0 and (self.top_k is not None or self.top_p is not None):
            raise ValueError("top_k and top_p apply to sampled text: temperature 0 takes the likeliest token whatever "
                             "they keep; drop them, or give a temperature")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def next_token(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """logits (B, vocab_size) -> next token ids (B,)."""
        if self.greedy:
            return logits.argmax(dim=-1)
        return draw(self.probs(logits), generator)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (..., vocab_size) -> the distribution a token is drawn from, after temperature, top-k and top-p
        (not for greedy)."""
        logits = logits.float()
        # below the best logit first, so that no quotient overflows to inf, whatever the temperature
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / self.temperature
        if self.top_k is not None:
            kth_best = torch.topk(logits, min(self.top_k, logits.size(-1))).values[:, -1:]
            logits = logits.masked_fill(logits < kth_best, float("-inf"))
        if self.top_p is not None and self.top_p < 1:  # 1 keeps every token, however float32 rounds their sum
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # drop a token when the likelier ones before it already reach top_p
            drop_sorted = probs.cumsum(dim=-1) - probs >= self.top_p
            drop_sorted[..., 0] = False  # the likeliest stays, even where top_p rounds to 0 in float32
            logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        return logits.softmax(dim=-1)


GREEDY = Sampling(temperature=0)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probs (B, vocab_size), drawn with those probabilities: the first of independent
    exponential clocks, one per token, each running at its token's rate. torch.multinomial draws the same way,
    but first checks the probabilities on the host, which makes a GPU wait at every token."""
    clocks = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / clocks).argmax(dim=-1)


def check_sampling(sampling) -> None:
    if not isinstance(sampling, Sampling):
        raise ValueError(f"sampling must be a Sampling (GREEDY, or Sampling(temperature=..., top_k=..., top_p=...)), "
                         f"got {type(sampling).__name__}")
