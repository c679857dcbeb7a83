"""Log-probabilities as OpenAI's legacy completions give them (logprobs: N, and echo): for each token of a choice's
text, the token, its log-probability, the N likeliest tokens at its place, and where it starts in the text.

A log-probability is log_softmax of the model's raw logits at that place, before temperature, top-k or top-p, as
OpenAI and vLLM report by default. The engine keeps those logits from the very pass that drew the token, or that
computed the prompt (model/serving/request.py: Kept): nothing is computed twice.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Scored:
    """One token of a choice's text, scored."""
    token: str
    logprob: float | None  # None for the prompt's first token: nothing before it predicts it
    top: dict[str, float] | None  # the likeliest tokens at its place, in order, then the token itself if not among them


def score(logits: torch.Tensor, ids: list[int], top: int, decode: Callable[[list[int]], str]) -> list[Scored]:
    """Each token of ids scored by the raw logits (len(ids), vocab_size) of the place it stands at."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs[torch.arange(len(ids)), ids].tolist()
    best = logprobs.topk(min(top, logprobs.size(-1)), dim=-1)
    scored = []
    for token, logprob, values, indices in zip(ids, chosen, best.values.tolist(), best.indices.tolist()):
        listed = {decode([i]): value for i, value in zip(indices, values)}
        listed.setdefault(decode([token]), logprob)  # OpenAI always lists the token itself: up to N + 1 of them
        scored.append(Scored(decode([token]), logprob, listed))
    return scored


class ChoiceScores:
    """One choice's scored tokens, handed out with the text they belong to, which a stop string may hold back or
    cut. One token is one character."""

    def __init__(self, top: int, decode: Callable[[list[int]], str]):
        self.top, self.decode = top, decode
        self.held: list[Scored] = []  # drawn, their text not yet sent

    def prompt(self, ids: list[int], rows: torch.Tensor | None) -> list[Scored]:
        """The prompt's tokens scored by rows (len(ids) - 1, vocab_size): its first token has no log-probability."""
        rest = score(rows, ids[1:], self.top, self.decode) if rows is not None else []
        return [Scored(self.decode(ids[:1]), None, None), *rest]

    def sent(self, ids: list[int], logits: list[torch.Tensor], text: str) -> list[Scored]:
        """Score the tokens just drawn (ids, by their logits); those of the text now sent leave, the rest wait."""
        if ids:
            self.held += score(torch.stack(logits), ids, self.top, self.decode)
        out, self.held = self.held[:len(text)], self.held[len(text):]
        return out


def logprobs_json(scored: list[Scored], offset: int) -> dict:
    """OpenAI's choices[i].logprobs for these tokens, the first starting at offset in the choice's text."""
    starts = itertools.accumulate((len(s.token) for s in scored[:-1]), initial=offset)
    return {"tokens": [s.token for s in scored], "token_logprobs": [s.logprob for s in scored],
            "top_logprobs": [s.top for s in scored], "text_offset": list(starts) if scored else []}
