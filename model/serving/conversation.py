"""A conversation: a text that grows by turns, and the model's KV cache over it, kept between turns.

    chat = Conversation(model, sampling=GREEDY)
    for token in chat.reply(new_ids, 200, stop=blank_line_ids):  # ints, as they are drawn
        ...
    state = chat.state()  # the text and its cache, as tensors: sample.py --session saves them
    later = Conversation(model, sampling=GREEDY).restore(state)  # goes on with nothing read again

Each turn appends the new tokens to the text and continues it, and only the tokens not yet read go through the
model: the new ones, and the previous reply's last token. Each reply is what generate would continue the whole
text with: a rotary model's cache rolls on past block_size, with nothing read twice; a learned-position model's
context starts where generate's would for the whole text as a prompt, so that once the text passes block_size each
turn starts by refilling the cache with its last `keep` tokens, as generate does.
"""

from collections.abc import Iterator, Sequence

import torch

from ..gpt import GPT
from ..decoding.cached_text import CachedText
from ..checks import is_integer
from ..decoding.generate import check_arguments
from ..decoding.sampling import GREEDY, Sampling, check_sampling
from ..protocol import Step


class Conversation:
    """sampling, generator, keep: as in generate."""

    def __init__(self, model: GPT, *, sampling: Sampling = GREEDY, generator: torch.Generator | None = None,
                 keep: int | None = None):
        check_arguments(model, torch.zeros(1, 1, dtype=torch.long), 0, keep)  # keep, eval mode
        check_sampling(sampling)
        self.sampling, self.generator, self.keep = sampling, generator, keep
        self.text = CachedText(model, keep=keep)

    @property
    def tokens(self) -> list[int]:
        """The whole text so far: every turn's tokens and every reply."""
        return self.text.tokens

    def decode_through(self, step: Step) -> None:
        """Take each one-token step through a Step (model/protocol.py) made for text_cache(model)."""
        if not step.fits(self.text.cache):
            raise ValueError("step must be a one-token step compiled for text_cache(model) (model/decoding/cached_text.py)")
        self.text.compiled = step

    def state(self) -> dict:
        """The text, where its context starts, and the cache's buffers: tensors and ints, for torch.save."""
        text = self.text
        return {"tokens": torch.tensor(text.tokens, dtype=torch.long), "start": text.start,
                "cache": {name: t.cpu() for name, t in text.cache.named_buffers()}}

    def restore(self, state: dict) -> "Conversation":
        """Take up a state() of a conversation with the same model: its text, and its cache as it was. A state
        that cannot be one (another design's cache, ids outside the vocabulary, ...) is a ValueError naming what is
        wrong, and leaves the conversation as it was."""
        text, cache = self.text, self.text.cache
        buffers = dict(cache.named_buffers())
        tokens, start, saved = state.get("tokens"), state.get("start"), state.get("cache")
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.long or tokens.dim() != 1:
            got = f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"state['tokens'] must be a 1-D tensor of token ids (int64), got {got}")
        vocab_size = text.model.config.vocab_size
        if len(tokens) and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size:
            outside = sorted({t for t in tokens.tolist() if not 0 <= t < vocab_size})
            raise ValueError(f"state['tokens'] holds ids outside the vocabulary (0..{vocab_size - 1}): "
                             f"{', '.join(map(str, outside[:5]))}")
        if not isinstance(saved, dict) or saved.keys() != buffers.keys() or any(
                not isinstance(saved[n], torch.Tensor) or saved[n].shape != t.shape or saved[n].dtype != t.dtype
                for n, t in buffers.items()):
            raise ValueError("the saved cache does not fit this model's cache: another design, size or dtype")
        if not is_integer(start):
            raise ValueError(f"state['start'] must be an int, got {type(start).__name__}")
        before = {name: t.clone() for name, t in buffers.items()}
        for name, t in buffers.items():
            t.copy_(saved[name])
        if not 0 <= start <= start + len(cache) <= len(tokens):
            fed = start + len(cache)
            for name, t in buffers.items():
                t.copy_(before[name])
            raise ValueError(f"the saved cache holds tokens {start} to {fed} of a text of {len(tokens)}")
        text.tokens, text.start = tokens.tolist(), start
        return self

    @torch.no_grad()
    def reply(self, new_tokens: Sequence[int], max_new_tokens: int, stop: Sequence[int] = ()) -> Iterator[int]:
        """Append new_tokens to the text and continue it: yield each new token as it is drawn, up to
        max_new_tokens, or until the reply ends with `stop` (which it then includes). Stopping early (closing the
        iterator) keeps what was yielded in the text."""
        text, model = self.text, self.text.model
        for name, ids in (("new_tokens", new_tokens), ("stop", stop)):
            if isinstance(ids, (torch.Tensor, str)) or not all(is_integer(t) for t in ids):
                raise ValueError(f"{name} must be a list of token ids (ints); got {type(ids).__name__}"
                                 f"{': pass ids.tolist()' if isinstance(ids, torch.Tensor) else ''}")
        new_tokens = list(new_tokens)
        if not text.tokens and not new_tokens:
            raise ValueError("a conversation starts from at least one token: new_tokens is empty")
        ids = torch.tensor([[*text.tokens[-1:], *new_tokens]], device=text.cache.device)
        check_arguments(model, ids, max_new_tokens, self.keep)
        text.tokens += new_tokens
        text.prepare(len(text.tokens), fresh=True)
        stop = list(stop)
        reply = []
        for _ in range(max_new_tokens):
            logits = text.logits(len(text.tokens))
            token = int(self.sampling.next_token(logits, self.generator))
            text.tokens.append(token)
            reply.append(token)
            yield token
            if stop and reply[-len(stop):] == stop:
                return
