"""A draft for speculative decoding that costs a table lookup, not a model: how often each token followed each
context of up to `order` tokens in a text (the training text). It carries its distribution q, so sampled text
can be speculated as well as greedy text (model/serving/speculative.py).

    table = NGramTable(train_tokens, vocab_size=65)
    speculative_generate(model, prompt, 500, draft=table, k=4, sampling=Sampling(temperature=0.8))

q after a text: the counts of the tokens that followed its last n tokens, normalised, for the longest n <= order
whose context occurred at least min_count times (n = 0: every token's own count). Temperature, top-k and top-p
apply to q as to the model's p, through log q. Greedy decoding proposes q's likeliest token.
"""

import math
from collections.abc import Sequence

import numpy as np
import torch

from ..checks import is_integer
from ..decoding.sampling import Sampling


class NGramTable:
    """Counts of every n-gram of 1 to order + 1 tokens in a text. An n-gram of L tokens is one integer: V^L plus
    its tokens as the digits of a number in base V (V = vocab_size), so that n-grams of every length sort into
    one array, and a context's followers are one range of it, found by one binary search for all lengths."""

    def __init__(self, tokens: Sequence[int] | torch.Tensor, vocab_size: int, order: int = 5, min_count: int = 3):
        if not (is_integer(vocab_size) and vocab_size >= 2):
            raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
        if not (is_integer(order) and order >= 0):
            raise ValueError(f"order, the longest context counted, must be an integer >= 0, got {order!r}")
        if 2 * vocab_size ** (order + 1) >= 2 ** 63:  # an n-gram's integer must fit in int64
            raise ValueError(f"order {order} is too long for {vocab_size} tokens: at most "
                             f"{int(62 * math.log(2) / math.log(vocab_size) - 1e-9) - 1}")
        if not (is_integer(min_count) and min_count >= 1):
            raise ValueError(f"min_count must be an integer >= 1, got {min_count!r}")
        tokens = torch.as_tensor(tokens).long().flatten().cpu()
        if tokens.numel() == 0 or tokens.min() < 0 or tokens.max() >= vocab_size:
            raise ValueError(f"tokens must hold at least one token id, each in [0, {vocab_size - 1}]")
        self.vocab_size, self.order, self.min_count = vocab_size, order, min_count
        number, codes = tokens, []
        for length in range(1, order + 2):
            if length > 1:
                number = number[:-1] * vocab_size + tokens[length - 1:]  # the n-grams one token longer
            codes.append(vocab_size ** length + number)
        keys, counts = torch.unique(torch.cat(codes), return_counts=True)  # sorted
        # numpy arrays: a lookup makes a dozen small reads, each several times faster in numpy than in torch
        self.keys, self.counts = keys.numpy(), counts.numpy()
        self.cumulative = np.concatenate([[0], self.counts.cumsum()])  # counts of keys[:i] at [i]

    def distribution(self, context: Sequence[int]) -> torch.Tensor:
        """q (vocab_size,): the next token's distribution after context (see the module)."""
        counts = self.follower_counts(context)
        return torch.from_numpy(counts / counts.sum()).float()

    def follower_counts(self, context: Sequence[int]) -> np.ndarray:
        """(vocab_size,) float64: how often each token followed the ending of context that q counts."""
        V, longest = self.vocab_size, min(self.order, len(context))
        number, bounds = 0, [V, 2 * V]  # the followers of the last n tokens: codes in [V (V^n + number), + V)
        for n in range(1, longest + 1):
            number += context[-n] * V ** (n - 1)
            bounds += [V * (V ** n + number), V * (V ** n + number) + V]
        ends = np.searchsorted(self.keys, bounds)  # (2 (longest + 1),)
        totals = self.cumulative[ends[1::2]] - self.cumulative[ends[::2]]  # followers of each n
        n = next(n for n in range(longest, -1, -1) if n == 0 or totals[n] >= self.min_count)
        lo, hi = ends[2 * n], ends[2 * n + 1]
        return np.bincount(self.keys[lo:hi] % V, weights=self.counts[lo:hi], minlength=V)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.keys, self.counts, self.cumulative))


class NGramDraft:
    """An NGramTable proposing k tokens at a time for one generation, drawn as `sampling` draws."""

    def __init__(self, table: NGramTable, sampling: Sampling, generator: torch.Generator | None, device):
        self.table, self.sampling, self.generator, self.device = table, sampling, generator, device
        self.known = {}  # follower counts by context: a text, greedy text above all, meets its contexts again

    def follower_counts(self, text: list[int]) -> np.ndarray:
        """The table's follower counts after text, looked up once per ending of `order` tokens (all they read)."""
        context = tuple(text[max(len(text) - self.table.order, 0):])
        if context not in self.known:
            self.known[context] = self.table.follower_counts(context)
        return self.known[context]

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """k tokens to follow `tokens`, and the distributions they were drawn from (k, vocab_size) (None when
        greedy)."""
        text, dists = list(tokens), []
        for _ in range(k):
            counts = self.follower_counts(text)
            if self.sampling.greedy:
                text.append(int(counts.argmax()))
                continue
            with np.errstate(divide="ignore"):  # log 0 = -inf: a token never seen after this context
                log_q = torch.from_numpy(np.log(counts)).to(self.device, torch.float32)  # log q, plus a constant
            q = self.sampling.probs(log_q[None])  # (1, vocab_size), where the model's p and the generator are
            dists.append(q)
            # an exponential race, argmax q / E with each E ~ Exp(1), wins token i with probability q_i, in a
            # third of multinomial's time; E is kept above 0 so that a token of q = 0 never wins
            race = torch.empty_like(q).exponential_(generator=self.generator).clamp_(min=torch.finfo(q.dtype).tiny)
            text.append(int((q / race).argmax()))
        return text[len(tokens):], torch.cat(dists) if dists else None

    def keep(self, length: int) -> None:
        """Nothing to roll back."""

    @property
    def cache_bytes(self) -> int:
        return 0
