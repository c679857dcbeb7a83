"""Speculative decoding: a cheap draft proposes k tokens, the model scores all of them in one cached forward pass,
keeps the longest prefix it agrees with and rolls its cache back past the rest.

    stats = SpeculativeStats()
    for next_id in speculative_generate(model, prompt, 500, draft=PromptLookup(), k=4, stats=stats):  # (1,) each
        ...
    stats.acceptance_rate, stats.tokens_per_pass

At batch 1 a decoding step reads every weight to make one token; a verification pass reads them once for up to
k + 1 tokens: the draft's proposals that the model keeps, and one token of the model's own after them.

Drafts: another GPT with the same vocabulary (smaller, so cheaper; it keeps its own cache, rolled back alike),
an NGramTable of a text's counts (model/serving/ngram_draft.py: a table lookup per token, with a distribution), or
PromptLookup, which proposes what followed the latest earlier occurrence of the text's last few tokens and costs
nothing. Greedy (temperature 0) keeps draft tokens while they equal the model's argmax: the text is the model's
own greedy text. Sampling keeps draft token x, drawn from the draft's q, with probability min(1, p(x) / q(x)),
and on the first rejection draws from max(p - q, 0) normalised; when all are kept it draws one more token from p.
Every token then has exactly the model's distribution p (Leviathan et al. 2023, Chen et al. 2023), with
temperature, top-k and top-p applied to p and q alike. PromptLookup's q is a point mass on its proposal.

Caches. The model's cache holds every token of the text but the last; a round feeds that one and the k drafts as
one chunk, then rolls back the rejected ones. Past block_size a rotary model's ring has k spare slots, so that
the chunk may cross its end without overwriting a key still in view, and the rollback is exact; a
learned-position model refills as generate does, and a round never drafts past the point where generate would
refill, so that greedy text is generate's, token for token.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..gpt import GPT
from ..checks import is_integer
from ..decoding.cached_text import CachedText
from ..decoding.generate import check_arguments
from .ngram_draft import NGramDraft, NGramTable
from ..decoding.sampling import GREEDY, Sampling, check_sampling
from ..protocol import Step


@dataclass
class SpeculativeStats:
    """Counts of one generation, filled as it runs."""

    drafted: int = 0  # tokens the draft proposed
    accepted: int = 0  # of them, kept
    passes: int = 0  # verification passes of the model (prompt prefills and refills not counted)
    new_tokens: int = 0
    cache_bytes: int = 0  # the KV caches' bytes: the model's and a draft model's

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.new_tokens / self.passes if self.passes else 0.0


class PromptLookup:
    """A draft that needs no model: the tokens that followed the latest earlier occurrence of the text's last
    max_ngram tokens, or failing that of fewer, down to one. Good where text repeats itself (names, code, quotes,
    a greedy loop). When that occurrence is fewer than k tokens back, the copy runs on into its own proposals, as
    the repeat would."""

    def __init__(self, max_ngram: int = 3):
        if not (is_integer(max_ngram) and max_ngram >= 1):
            raise ValueError(f"max_ngram must be an integer >= 1, got {max_ngram!r}")
        self.max_ngram = max_ngram
        self.text: list[int] = []  # the text indexed so far
        self.latest = [{} for _ in range(max_ngram + 1)]  # latest[n][n-gram]: where its latest occurrence ends

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], None]:
        """Up to k tokens to follow `tokens` (none when its ending never occurred before), and no distribution: a
        point mass on each."""
        self.index(tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            end = self.latest[n].get(tuple(tokens[-n:]))  # the latest occurrence ending before the last token
            if end is not None:
                proposals = tokens[end:end + k]
                while len(proposals) < k:  # the repeat goes on: copy what was just proposed
                    proposals.append(proposals[len(proposals) - (len(tokens) - end)])
                return proposals, None
        return [], None

    def index(self, tokens: list[int]) -> None:
        """Index the n-grams that end before tokens' last token, extending the index of the text it continues (a
        text that does not continue it is indexed afresh), so that a long prompt is read once."""
        if len(tokens) < len(self.text) or tokens[:len(self.text)] != self.text:
            self.text, self.latest = [], [{} for _ in range(self.max_ngram + 1)]
        for end in range(max(len(self.text) - 1, 1), len(tokens)):  # the occurrences that end at `end`
            for n in range(1, min(self.max_ngram, end) + 1):
                self.latest[n][tuple(tokens[end - n:end])] = end
        self.text = list(tokens)

    def keep(self, length: int) -> None:
        """Nothing to roll back."""

    @property
    def cache_bytes(self) -> int:
        return 0


class ModelDraft:
    """A draft GPT, its own cache over the text and its proposals: after each round it rolls back what the model
    did not keep."""

    def __init__(self, model: GPT, k: int, sampling: Sampling, generator: torch.Generator | None,
                 step: Step | None = None):
        self.text = CachedText(model, spare=k, cache=step.cache if step is not None else None)
        if step is not None:
            if not step.fits(self.text.cache):
                raise ValueError(f"draft_step must be a one-token step compiled for text_cache(draft, {k}) "
                                 f"(model/decoding/cached_text.py)")
            self.text.compiled = step
        self.sampling, self.generator = sampling, generator

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """k tokens to follow `tokens`, and the distributions they were drawn from (k, vocab_size) (None when
        greedy)."""
        text = self.text
        text.tokens += tokens[len(text.tokens):]  # after keep(), its text is a prefix of the model's
        proposals, dists = [], []
        for _ in range(k):
            logits = text.logits(len(text.tokens))  # (1, vocab_size)
            if self.sampling.greedy:
                token = int(logits.argmax())
            else:
                dists.append(self.sampling.probs(logits))
                token = int(torch.multinomial(dists[-1], 1, generator=self.generator))
            proposals.append(token)
            text.tokens.append(token)
        return proposals, torch.cat(dists) if dists else None

    def keep(self, length: int) -> None:
        """The model kept the text it was shown and its proposals up to `length` tokens."""
        self.text.truncate(length)

    @property
    def cache_bytes(self) -> int:
        return self.text.cache.nbytes


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The probability of keeping a draft token: min(1, p / q), from the model's p and the draft's q of it."""
    return (p / q).clamp(max=1.0)


def verify(logits: torch.Tensor, proposals: list[int], q: torch.Tensor | None, sampling: Sampling,
           generator: torch.Generator | None) -> tuple[int, int]:
    """The model's logits (n + 1, vocab_size) after the text and after each of its n proposals; the draft's
    distributions q (n, vocab_size), None for point masses -> (proposals kept, the model's token after them)."""
    if sampling.greedy:
        best = logits.argmax(dim=-1).tolist()
        kept = 0
        while kept < len(proposals) and proposals[kept] == best[kept]:
            kept += 1
        return kept, best[kept]
    p = sampling.probs(logits)  # (n + 1, vocab_size)
    n = len(proposals)
    tokens = torch.tensor(proposals, dtype=torch.long, device=p.device)
    q = q if q is not None else torch.nn.functional.one_hot(tokens, p.size(-1)).float()  # point masses
    rows = torch.arange(n, device=p.device)
    # every draft's own uniform draw at once: the same law as drawing each after the one before it is kept
    keep = torch.rand(n, generator=generator, device=p.device) < acceptance_probability(p[rows, tokens],
                                                                                      q[rows, tokens])
    kept = int(keep.cumprod(dim=0).sum())  # the drafts before the first rejection
    if kept == n:
        return n, int(torch.multinomial(p[-1], 1, generator=generator))
    residual = (p[kept] - q[kept]).clamp(min=0)  # what p has beyond q: a rejection draws from it alone
    if not residual.sum() > 0:  # p and q equal up to rounding: nothing beyond q, so p itself
        residual = p[kept]
    return kept, int(torch.multinomial(residual, 1, generator=generator))


@torch.no_grad()
def speculative_generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, *,
                         draft: "GPT | NGramTable | PromptLookup",
                         k: int, sampling: Sampling = GREEDY, generator: torch.Generator | None = None,
                         keep: int | None = None, stats: SpeculativeStats | None = None,
                         verify_pass: Step | None = None, draft_step: Step | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token, (1,), max_new_tokens times, as generate_tokens does for one row, drafting k tokens
    per model pass. draft: a GPT with the model's vocabulary (in eval mode, on its device), an NGramTable of its
    vocabulary, or PromptLookup().
    keep: as in generate, for learned positions (the model's; a draft model keeps its default). stats: a
    SpeculativeStats to fill. verify_pass: a Step (model/protocol.py) of up to k + 1 tokens for caches like
    text_cache(model, k) (model/decoding/cached_text.py), compiled or captured over one: it takes every pass after
    the prompt's, shorter drafts' too. draft_step: a draft model's one-token Step, for text_cache(draft, k).
    Arguments that cannot work are a ValueError naming the argument.
    """
    check_arguments(model, idx, max_new_tokens, keep)
    check_sampling(sampling)
    if idx.size(0) != 1:
        raise ValueError(f"speculative decoding decodes one row: idx has {idx.size(0)} rows; decode each alone, "
                         f"or use generate_tokens for a batch")
    if not (is_integer(k) and k >= 1):
        raise ValueError(f"k, the tokens drafted per model pass, must be an integer >= 1, got {k!r}")
    if isinstance(draft, GPT):
        _check_draft(model, draft)
        proposer = ModelDraft(draft, k, sampling, generator, draft_step)
    elif draft_step is not None:
        raise ValueError("draft_step applies to a draft model: an NGramTable or PromptLookup drafts with no model pass")
    elif isinstance(draft, NGramTable):
        if draft.vocab_size != model.config.vocab_size:
            raise ValueError(f"draft counts {draft.vocab_size} tokens, the model has {model.config.vocab_size}: "
                             f"build the NGramTable with the model's vocab_size")
        proposer = NGramDraft(draft, sampling, generator, idx.device)
    elif isinstance(draft, PromptLookup):
        proposer = draft
    else:
        raise ValueError(f"draft must be a GPT with the model's vocabulary, an NGramTable or PromptLookup(), got "
                         f"{type(draft).__name__}")
    stats = stats if stats is not None else SpeculativeStats()
    target = CachedText(model, spare=k, keep=keep, cache=verify_pass.cache if verify_pass is not None else None)
    target.tokens = idx[0].tolist()
    if verify_pass is not None:
        if not verify_pass.fits(target.cache, k + 1):
            raise ValueError(f"verify_pass must be compiled for passes of up to k + 1 = {k + 1} tokens through "
                             f"text_cache(model, {k}) (model/decoding/cached_text.py)")
        target.compiled = verify_pass
    stats.cache_bytes = target.cache.nbytes + proposer.cache_bytes
    made = 0
    while made < max_new_tokens:
        length = len(target.tokens)
        target.prepare(length)
        # no more than are wanted, nor past the point where a learned-position model must refill
        n_draft = int(min(k, max_new_tokens - made - 1, target.room(length)))
        proposals, q = proposer.propose(target.tokens, n_draft) if n_draft else ([], None)
        target.tokens += proposals
        logits = target.logits(length + len(proposals), n=len(proposals) + 1)
        kept, next_token = verify(logits, proposals, q, sampling, generator)
        target.truncate(length + kept)
        proposer.keep(length + kept)
        target.tokens.append(next_token)
        new = proposals[:kept] + [next_token]
        made += len(new)
        stats.drafted += len(proposals)
        stats.accepted += kept
        stats.passes += 1
        stats.new_tokens += len(new)
        for token in new:
            yield torch.tensor([token], device=idx.device)


def _check_draft(model: GPT, draft: GPT) -> None:
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"draft has a vocabulary of {draft.config.vocab_size} tokens, the model "
                         f"{model.config.vocab_size}: a draft must share the model's vocabulary")
    if draft.training:
        raise ValueError("draft is in training mode, where dropout would change every token: call draft.eval()")
    if draft.wte.weight.device != model.wte.weight.device:
        raise ValueError(f"draft is on {draft.wte.weight.device}, the model on {model.wte.weight.device}: move "
                         f"the draft to the model's device")
