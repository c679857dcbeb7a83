"""One request in the engine (model/serving/engine.py), and what the engine keeps of its passes for whoever added it."""

from dataclasses import dataclass, field

import torch

from ..decoding.sampling import Sampling


@dataclass(eq=False)
class Kept:
    """What the engine keeps of one request's passes for its caller, who hands it to engine.add and takes what it
    holds after each step (take()): a CUDA graph writes its logits again at the next. The logits are the model's
    raw ones, before any sampling setting."""
    draws: bool = False  # the logits each token is drawn from
    prompt: bool = False  # the logits at every prompt position: then no prompt token is read from the cache
    cached_tokens: int | None = None  # prompt tokens read from cached blocks when it first ran
    logits: list[torch.Tensor] = field(default_factory=list)  # (vocab_size,) each: one per drawn token, in order
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # (rows, vocab_size): row i predicts prompt[i + 1]

    def take(self) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The prompt's rows kept since the last take (rows, vocab_size), else None: all of them by the step that
        computes its last prompt token. And the drawn tokens' logits since the last take. Both leave this record."""
        rows = torch.cat(self.prompt_logits) if self.prompt_logits else None
        logits, self.logits, self.prompt_logits = self.logits, [], []
        return rows, logits


@dataclass(eq=False)  # a request is itself: the engine's queues find it by identity, not by comparing fields
class Request:
    name: object
    tokens: list[int]  # the prompt, then what it has drawn
    max_new_tokens: int  # 0: only its prompt is computed
    prompt_len: int
    blocks: list[int] = field(default_factory=list)  # the block table
    names: list[bytes] = field(default_factory=list)  # the chain hash of each full block
    fed: int = 0  # tokens[:fed] are in the pool
    cached: int = 0  # of those, read from cached blocks when it last joined
    logits: list[torch.Tensor] = field(default_factory=list)  # each draw's, when the engine keeps them
    generator: torch.Generator | None = None  # its own draws' (else the engine's): its text as if alone
    sampling: Sampling | None = None  # its own (else the engine's)
    kept: Kept | None = None  # what its caller asked to keep
    preemptions: int = 0
    scored: int = 0  # prompt positions whose logits are kept (Kept.prompt)

    @property
    def drawn(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def unfed(self) -> bool:
        """A running request not yet fed since it joined: each pass moves fed on past what it read from the cache."""
        return self.fed == self.cached

    @property
    def prefilling(self) -> bool:
        """A running request not yet fed since it joined, or with more than its last token still to feed. Decoding
        passes take only requests that have run: none is preempted holding cached blocks it has not read."""
        return self.unfed or self.fed < len(self.tokens) - 1

    @property
    def scores_prompt(self) -> bool:
        """Its caller keeps the logits at every prompt position, so every one is computed, none read from the cache."""
        return self.kept is not None and self.kept.prompt


def check_servable(model) -> None:
    """ValueError unless the pool can hold what model's layers attend: blocks of every key, not a local window."""
    if model.config.local_window is not None:
        raise ValueError("the engine's pool serves layers that attend everything, and this model has local layers "
                         "(window_pattern)")
