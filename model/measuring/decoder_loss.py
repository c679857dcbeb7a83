"""Loss through the decoder: how well cached decoding itself predicts a text.

Teacher-forced evaluation scores a forward over windows of the text. Decoding computes its logits another way: a
prefill, then one token at a time through the KV cache (rolling for rotary positions, refilled for learned ones),
perhaps in int8. decoder_loss streams a text through that very loop and scores the logits it computed;
teacher_forced_loss computes, with full forwards, what the same contexts should give. For a cache that is exact
(any float design) the two agree; for a lossy one (int8) their difference is what the cache costs.

    tokens = val_ids[: 64 * 1024].view(64, 1024)  # 64 streams decoded side by side
    decoder_loss(model, tokens, prompt_len=128), teacher_forced_loss(model, tokens, prompt_len=128)
"""

import torch
import torch.nn.functional as F

from ..gpt import GPT
from ..checks import is_integer
from ..decoding.generate import check_arguments, default_keep, generate_tokens
from ..caches.ring import RingKVCache


class TeacherForcing:
    """In place of a Sampling, for generate_tokens: each step feeds the text's own next tokens and keeps the
    cross-entropy of the logits that the decoder computed for them."""

    def __init__(self, targets: torch.Tensor):
        self.targets = targets  # (B, N) the tokens the steps must predict, in order
        self.losses = []  # one (B,) per step

    def next_token(self, logits: torch.Tensor, generator=None) -> torch.Tensor:
        target = self.targets[:, len(self.losses)]
        self.losses.append(F.cross_entropy(logits.float(), target, reduction="none"))
        return target


def check_text(model: GPT, tokens, prompt_len, keep, longest_prompt: int | None) -> int:
    """Refuse arguments that cannot work, each in a ValueError naming it (as generate does); the text's length.
    tokens: (B, N) token ids of the model's vocabulary; prompt_len in [1, N - 1] (and at most longest_prompt)."""
    check_arguments(model, tokens, 0, keep)  # a (B, N) tensor of ids, the keep, a model in eval mode
    most = tokens.size(1) - 1 if longest_prompt is None else min(longest_prompt, tokens.size(1) - 1)
    if not (is_integer(prompt_len) and 1 <= prompt_len <= most):
        raise ValueError(f"prompt_len must be an integer in [1, {most}] for a text of {tokens.size(1)} tokens, got "
                         f"{prompt_len!r}")
    return tokens.size(1)


@torch.no_grad()
def decoder_loss(model: GPT, tokens: torch.Tensor, *, prompt_len: int, cache: RingKVCache | None = None,
                 keep: int | None = None) -> float:
    """Mean cross-entropy of tokens[:, prompt_len:] (B rows, each its own stream) as cached decoding predicts them:
    generate_tokens prefills the first prompt_len tokens, then feeds the text one token per step. cache: a RingKVCache
    to decode through (new_kv_cache(model, B) by default; dtype=torch.int8 for the int8 cache); keep: as in
    generate."""
    check_text(model, tokens, prompt_len, keep, longest_prompt=None)
    forcing = TeacherForcing(tokens[:, prompt_len:])
    for _ in generate_tokens(model, tokens[:, :prompt_len], tokens.size(1) - prompt_len, sampling=forcing,
                             cache=cache, keep=keep):
        pass
    return torch.stack(forcing.losses).mean().item()


@torch.no_grad()
def teacher_forced_loss(model: GPT, tokens: torch.Tensor, *, prompt_len: int, keep: int | None = None,
                        chunk: int = 256) -> float:
    """decoder_loss's mean cross-entropy computed with full forwards, no cache, under the context rule that
    generate_tokens follows (model/decoding/generate.py): with rotary positions each layer attends its last block_size
    tokens, so a logit depends on at most n_layer * (block_size - 1) tokens before it; with learned positions the
    context tokens[start:] jumps to the last `keep` tokens whenever it would pass block_size."""
    c = model.config
    N = check_text(model, tokens, prompt_len, keep, longest_prompt=c.block_size)
    if not is_integer(chunk) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
    losses = []

    def score(context_start, context_end, first_target):
        """Score tokens first_target..context_end from one forward over tokens[context_start:context_end]."""
        logits = model(tokens[:, context_start:context_end])[0][:, first_target - 1 - context_start:]
        targets = tokens[:, first_target:context_end + 1]
        losses.append(F.cross_entropy(logits.transpose(1, 2).float(), targets, reduction="none"))

    if c.pos_emb == "rope":
        reach = c.n_layer * (c.block_size - 1)
        for first in range(prompt_len, N, chunk):
            last = min(first + chunk, N) - 1
            score(max(0, first - 1 - reach), last, first)
    else:
        keep = default_keep(c.block_size) if keep is None else keep
        start, length = 0, prompt_len  # the context tokens[start:length] predicts tokens[length]
        while length < N:
            if length - start > c.block_size:
                start = length - keep
            end = min(start + c.block_size, N - 1)  # the longest context before the next jump
            score(start, end, length)
            length = end + 1
    return torch.cat(losses, dim=1).mean().item()
