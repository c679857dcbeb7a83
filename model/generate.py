"""The decoding loop, outside the network: prefill the KV cache, then one token per step.

    ids = generate(model, prompt, 200, sampling=Sampling(temperature=0.8, top_k=40))
    for next_ids in generate_tokens(model, prompt, 200, sampling=GREEDY):  # (B,) per step, as they come
        ...

Past block_size. Positions are learned, so cached keys cannot slide along: the model sees a context
seq[start:] of at most block_size tokens, and when the next token would make it longer, start jumps forward
so that only the last `window` tokens remain (default block_size // 2), and the cache is rebuilt with one
prefill over them. A rebuild every block_size - window + 1 tokens keeps the cost at O(1) forward passes per
token, amortised. window = block_size rebuilds at every step, which is exactly the classic crop to the last
block_size tokens. use_cache=False runs a full forward over the very same context at every step.

Ragged batches. n_pad (B,) says how many tokens at the start of each row of idx are left padding. Each
row's context, and when its window moves, is the one it would have alone; a batch whose rows fill up at
different steps rebuilds the cache (for all rows) whenever one of them does.
"""

from collections.abc import Iterator, Sequence

import torch

from .gpt import GPT
from .kv_cache import KVCache
from .sampling import Sampling


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, *, sampling: Sampling = Sampling(),
             generator: torch.Generator | None = None, window: int | None = None,
             n_pad: Sequence[int] | torch.Tensor | None = None, use_cache: bool = True,
             cache: KVCache | None = None, compile: bool = False) -> torch.Tensor:
    """idx (B, T) -> (B, T + max_new_tokens): the prompt followed by the new tokens. See generate_tokens."""
    new = list(generate_tokens(model, idx, max_new_tokens, sampling=sampling, generator=generator,
                               window=window, n_pad=n_pad, use_cache=use_cache, cache=cache, compile=compile))
    return torch.cat([idx, torch.stack(new, dim=1)], dim=1) if new else idx


@torch.no_grad()
def generate_tokens(model: GPT, idx: torch.Tensor, max_new_tokens: int, *, sampling: Sampling = Sampling(),
                    generator: torch.Generator | None = None, window: int | None = None,
                    n_pad: Sequence[int] | torch.Tensor | None = None, use_cache: bool = True,
                    cache: KVCache | None = None, compile: bool = False) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,), max_new_tokens times.

    sampling: how each token is drawn (model/sampling.py); generator: a torch.Generator, for reproducible
    sampling. window: context tokens kept when the context passes block_size (see the module's docstring).
    n_pad: left padding per row. use_cache=False recomputes the whole context at every step; cache is a
    KVCache to reuse (from model.new_kv_cache), and compile torch.compiles the one-token step: both need the
    cache. Arguments that cannot work are a ValueError naming the argument.
    """
    block_size = model.config.block_size
    window = block_size // 2 if window is None else window
    start = _check(model, idx, max_new_tokens, window, n_pad, use_cache, cache, compile)
    if use_cache:
        cache = cache if cache is not None else model.new_kv_cache(idx.size(0))
        one_token_step = torch.compile(model.decode_step, fullgraph=True) if compile else model.decode_step
    # the whole sequence, filled as it grows: seq = buffer[:, :length]
    buffer = torch.cat([idx, idx.new_empty(idx.size(0), max_new_tokens)], dim=1)
    length = idx.size(1)
    # row b's context is seq[b, start[b]:]: it starts after the row's left padding, and each row's window
    # moves on its own schedule, exactly as if the row were generated alone
    n_cached = 0  # how many of the (padded) context's tokens the cache holds
    for _ in range(max_new_tokens):
        seq = buffer[:, :length]
        if seq.size(1) - min(start) > block_size:  # some row's context would pass block_size
            start = [s if seq.size(1) - s <= block_size else seq.size(1) - window for s in start]
            n_cached = 0
        first = min(start)  # the batch's context is seq[:, first:], each row left-padded to it
        context_pad = None if max(start) == first else torch.tensor([s - first for s in start], device=seq.device)
        if use_cache:
            if n_cached == 0:  # (re)fill the cache
                cache.reset(context_pad)
            new_tokens = seq[:, first + n_cached:]
            step = one_token_step if new_tokens.size(1) == 1 else model.decode_step
            logits = step(new_tokens, cache)
            n_cached += new_tokens.size(1)
        else:
            logits = model(seq[:, first:], n_pad=context_pad)[0][:, -1]
        next_ids = sampling.next_token(logits, generator)  # (B,)
        buffer[:, length] = next_ids
        length += 1
        yield next_ids


def _check(model: GPT, idx, max_new_tokens, window, n_pad, use_cache, cache, compile) -> list[int]:
    """Refuse arguments that cannot work; each row's left padding as a list of ints."""
    block_size = model.config.block_size
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.long, torch.int):
        raise ValueError(f"idx must be a (B, T) tensor of token ids (int64), got "
                         f"{tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__}"
                         f"{' ' + str(idx.dtype) if isinstance(idx, torch.Tensor) else ''}")
    B, T = idx.shape
    if B == 0 or T == 0:
        raise ValueError(f"idx must hold at least one row of at least one token, got shape {(B, T)}")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 0):
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not (isinstance(window, int) and 1 <= window <= block_size):
        raise ValueError(f"window must be in [1, block_size={block_size}], got {window!r}")
    if not use_cache and (cache is not None or compile):
        raise ValueError("cache and compile apply to cached decoding: pass use_cache=True, or neither of them")
    if cache is not None and (cache.batch_size != B or cache.max_len < block_size):
        raise ValueError(f"cache holds {cache.batch_size} rows of {cache.max_len} tokens; this generation "
                         f"needs {B} rows of block_size={block_size}: use model.new_kv_cache({B})")
    if n_pad is None:
        return [0] * B
    pads = n_pad.tolist() if isinstance(n_pad, torch.Tensor) else list(n_pad)
    if len(pads) != B or not all(isinstance(p, int) and 0 <= p < T for p in pads):
        raise ValueError(f"n_pad must give each of the {B} rows its count of left-padding tokens, "
                         f"each in [0, {T - 1}], got {pads}")
    return pads
