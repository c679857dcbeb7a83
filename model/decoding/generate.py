"""What the real decoding loop adds to greedy_decode (model/kv_cache.py): how each token is drawn (Sampling, in
model/decoding/sampling.py), ragged batches, many samples of one prompt and contexts longer than block_size. The loop
stays outside the network; the cache it uses is model/caches/ring.py's ring.

    ids = generate(model, prompt, 200, sampling=Sampling(temperature=0.8, top_k=40))
    for next_ids in generate_tokens(model, prompt, 200, sampling=GREEDY):  # (B,) per step, as they come
        ...

Past block_size. The model attends at most block_size tokens back, so each row's context is seq[start:]:
- Rotary positions (pos_emb="rope"): cached keys stay valid as the sequence grows, so the cache rolls on
  (model/caches/ring.py) and every step feeds one token, with no prefill ever repeated. Each layer attends its
  last block_size tokens, so the last token still depends on up to n_layer * (block_size - 1) tokens before it,
  through the earlier layers: that is the context kept.
- Learned positions: cached keys carry their absolute positions and cannot slide. When the next token would not
  fit, start jumps forward so that only the last `keep` tokens remain (default block_size // 2, at least 1), and
  the cache is refilled with one prefill over them: O(1) forward passes per token, amortised. keep = block_size
  refills at every step, which is exactly the classic crop to the last block_size tokens.
use_cache=False runs a full forward over the very same context at every step.

Ragged batches. n_pad (B,) says how many tokens at the start of each row of idx are left padding. Each row's
context, and when it jumps forward, is the one it would have alone; with learned positions a batch whose rows
fill up at different steps refills the cache (for all rows) whenever one of them does.

Many samples of one prompt. When every row of idx holds the same tokens, the prompt goes through the model once,
at batch 1, and its cache is copied to every row (KVCache.fill_from).
"""

from collections.abc import Iterator, Sequence

import torch

from ..caches.factory import new_kv_cache
from ..caches.ring import Uncached
from ..checks import is_integer
from ..gpt import GPT, GPTConfig
from ..protocol import Cache, DecodeStep, Step
from .sampling import Sampling

GREEDY_RUN = 32  # the most greedy steps a step takes in one run: the tokens come out in runs of up to this many


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, *, sampling: Sampling = Sampling(),
             generator: torch.Generator | None = None, keep: int | None = None,
             n_pad: Sequence[int] | torch.Tensor | None = None, use_cache: bool = True,
             cache: Cache | None = None, compile: bool = False, step: Step | None = None) -> torch.Tensor:
    """idx (B, T) -> (B, T + max_new_tokens): the prompt followed by the new tokens. See generate_tokens."""
    new = list(generate_tokens(model, idx, max_new_tokens, sampling=sampling, generator=generator,
                               keep=keep, n_pad=n_pad, use_cache=use_cache, cache=cache, compile=compile,
                               step=step))
    return torch.cat([idx, torch.stack(new, dim=1)], dim=1) if new else idx


def generate_tokens(model: GPT, idx: torch.Tensor, max_new_tokens: int, *, sampling: Sampling = Sampling(),
                    generator: torch.Generator | None = None, keep: int | None = None,
                    n_pad: Sequence[int] | torch.Tensor | None = None, use_cache: bool = True,
                    cache: Cache | None = None, compile: bool = False,
                    step: Step | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,), max_new_tokens times.

    sampling: how each token is drawn; generator: a torch.Generator, for reproducible sampling. keep: context
    tokens kept when the context passes block_size, for learned positions (see the module's docstring). n_pad:
    left padding per row. use_cache=False recomputes the whole context at every step; cache: a cache to reuse
    (model/protocol.py: Cache; new_kv_cache by default), and compile torch.compiles the one-token step; step: a
    Step to take one-token steps through instead (model/protocol.py: compiled or captured), and the prompt too
    where its chunks are at most step.tokens: it says which caches it fits(), and its `cache` is the one it serves
    (None: any it fits). Each needs the cache. Greedy through a step, the steps run GREEDY_RUN at a time and
    their tokens are yielded after each run: a loop that stops early leaves the cache up to GREEDY_RUN - 1 tokens
    past the last token it took.
    Arguments that cannot work are a ValueError naming the argument.
    """
    block_size = model.config.block_size
    start = check_arguments(model, idx, max_new_tokens, keep, n_pad, use_cache, cache, compile, step)
    # the cache rolls on past block_size: with rotary positions, or a budget that places tokens itself
    rolling = model.config.pos_emb == "rope" or (cache is not None and cache.abilities.budgeted)
    span, keep = context_limits(model.config, keep)
    if use_cache:
        cache = cache if cache is not None else new_kv_cache(model, idx.size(0))
        if step is not None and not step.fits(cache):
            raise ValueError("step was compiled for another cache, or for passes of more than one token: compile "
                             "a one-token step for this cache")
        one_token_step = step.decode_step if step else compiled_step(model) if compile else model.decode_step
        # greedy through a step: runs of steps, each row's token picked inside the step and fed back, with no
        # operation in Python between two steps, not even the no_grad context that the model's own passes run in
        runs = step is not None and sampling.greedy
        pick = torch.no_grad()(lambda tokens, cache: sampling.next_token(one_token_step(tokens, cache), generator))
    # the whole sequence, filled as it grows: seq = buffer[:, :length]
    buffer = torch.cat([idx, idx.new_empty(idx.size(0), max_new_tokens)], dim=1)
    length = idx.size(1)
    # row b's context is seq[b, start[b]:]: it starts after the row's left padding, and each row's context
    # moves on its own schedule, exactly as if the row were generated alone. The batch's context is
    # seq[:, first:], each row left-padded to it by context_pad.
    first, context_pad = min(start), padding(start, idx.device)
    fed = None  # seq[:, :fed] has gone through the cache; None: (re)fill it
    drawn = None  # the last tokens drawn, (B, 1): fed back as they are, where a slice of seq would be copied first
    while length < buffer.size(1):
        if length - first > span:  # some row's context would pass span
            start = [moved_start(s, length, span, keep) for s in start]
            first, context_pad = min(start), padding(start, idx.device)
            if not rolling:
                fed = None
        if use_cache:
            if fed is None:
                cache.reset(context_pad)
                fed = first
                if length == idx.size(1) and _same_rows(idx) and length - first <= block_size:
                    logits = _prefill_once(model, buffer[:1, first:length], cache)  # every row the same prompt
                    fed = length
            if length - fed == 1:
                unfed = buffer[:, fed:length] if drawn is None else drawn  # (B, 1)
                if runs:  # as many steps as keep the context within span, at most GREEDY_RUN
                    new = step.greedy_steps(unfed, cache, min(buffer.size(1) - length, first + span - length + 1,
                                                              GREEDY_RUN))
                else:
                    new = pick(unfed, cache)[:, None]
            else:
                if fed < length:
                    logits = prefill(model, buffer[:, fed:length], cache, one_token_step, step.tokens if step else 1)
                new = sampling.next_token(logits, generator)[:, None]
            fed = length + new.size(1) - 1  # the last token drawn is not fed yet
        else:
            ragged = context_pad is not None or length - first > block_size  # the ring's rule, without a cache
            context = Uncached(block_size, context_pad, idx.device) if ragged else None
            with torch.no_grad():
                logits = model(buffer[:, first:length], cache=context)[0][:, -1]
            new = sampling.next_token(logits, generator)[:, None]
        # new: the tokens drawn, (B, n), n = 1 but for a step's greedy run
        buffer[:, length:length + new.size(1)] = new
        drawn = new[:, -1:]
        length += new.size(1)
        yield from new.unbind(1)


def padding(start: list[int], device: torch.device) -> torch.Tensor | None:
    """Each row's left padding (B,) to the batch's context, seq[:, min(start):]; None where no row is padded."""
    first = min(start)
    return None if max(start) == first else torch.tensor([s - first for s in start], device=device)


def compiled_step(model: GPT) -> DecodeStep:
    """model.decode_step compiled for one token per row. It is fed a copy of its tokens: a slice of generate's buffer
    has the buffer's strides, for which the step would be compiled again whenever max_new_tokens changes."""
    step = torch.compile(model.decode_step, fullgraph=True)
    return lambda idx, cache: step(idx.clone(memory_format=torch.contiguous_format), cache)


def default_keep(block_size: int) -> int:
    """Context tokens that learned positions keep when the context passes block_size: half of it, at least one."""
    return max(block_size // 2, 1)


def context_limits(config: GPTConfig, keep: int | None) -> tuple[int, int]:
    """(span, keep): the longest context that can still change the next token, and how much of it a jump
    forward keeps (see the module's docstring)."""
    if config.pos_emb == "rope":
        span = config.n_layer * (config.block_size - 1) + 1
        return span, span
    return config.block_size, default_keep(config.block_size) if keep is None else keep


def moved_start(start: int, length: int, span: int, keep: int) -> int:
    """Where a context that starts at `start` starts before the token after seq[:length] is drawn: where it did,
    or, when it would pass span, `keep` tokens back."""
    return start if length - start <= span else length - keep


def _same_rows(idx: torch.Tensor) -> bool:
    return idx.size(0) > 1 and bool((idx == idx[:1]).all())


@torch.no_grad()
def prefill(model: GPT, tokens: torch.Tensor, cache: Cache, step: DecodeStep | None = None,
            step_tokens: int = 1) -> torch.Tensor:
    """Feed tokens (B, T) through cache in the longest chunks it takes (local layers' rings take shorter ones);
    the last token's logits, (B, vocab_size). step: a compiled decode_step for chunks of up to step_tokens tokens,
    which a full local ring takes a few at a time."""
    fed = 0
    while fed < tokens.size(1):
        n = min(tokens.size(1) - fed, cache.longest_chunk())
        feed = step if step is not None and n <= step_tokens else model.decode_step
        logits = feed(tokens[:, fed:fed + n], cache)
        fed += n
    return logits


@torch.no_grad()
def _prefill_once(model: GPT, prompt: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Prefill prompt (1, T) into a one-row cache like `cache`, copy it to all of cache's rows; the last logits,
    (B, vocab_size)."""
    one = cache.one_row()
    logits = prefill(model, prompt, one)
    cache.fill_from(one)
    return logits.expand(cache.batch_size, -1)


def check_arguments(model: GPT, idx, max_new_tokens, keep=None, n_pad=None, use_cache=True, cache=None,
                    compile=False, step: Step | None = None) -> list[int]:
    """Refuse generate's arguments that cannot work, each in a ValueError naming it; each row's left padding as a
    list of ints."""
    c = model.config
    block_size = c.block_size
    if model.training:
        raise ValueError("model is in training mode, where dropout would change every token: call model.eval() "
                         "before generating")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.long, torch.int):
        raise ValueError(f"idx must be a (B, T) tensor of token ids (int64), got "
                         f"{tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__}"
                         f"{' ' + str(idx.dtype) if isinstance(idx, torch.Tensor) else ''}")
    B, T = idx.shape
    if B == 0 or T == 0:
        raise ValueError(f"idx must hold at least one row of at least one token, got shape {(B, T)}")
    if idx.min() < 0 or idx.max() >= c.vocab_size:
        raise ValueError(f"idx holds token ids outside the vocabulary [0, {c.vocab_size - 1}]: "
                         f"{idx.min().item()} .. {idx.max().item()}")
    if not (is_integer(max_new_tokens) and max_new_tokens >= 0):
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if c.pos_emb == "rope" and keep not in (None, block_size):
        raise ValueError(f"keep applies to learned positions: a rotary-position model's cache rolls, and every "
                         f"token sees the last block_size={block_size} tokens; drop keep")
    if keep is not None and not (is_integer(keep) and 1 <= keep <= block_size):
        raise ValueError(f"keep must be an integer in [1, block_size={block_size}], got {keep!r}")
    if not use_cache and (cache is not None or compile or step is not None):
        raise ValueError("cache, compile and step apply to cached decoding: pass use_cache=True, or none of them")
    if compile and step is not None:
        raise ValueError("step is a compiled step already: drop compile")
    if cache is not None:
        check_cache(model, cache, B)
        abilities, name = cache.abilities, type(cache).__name__
        if (compile or step is not None) and not abilities.compiles:
            raise ValueError(f"a {name} decodes eagerly: drop {'compile' if compile else 'step'}")
        if keep is not None and abilities.budgeted:
            raise ValueError(f"keep applies to the float and low-bit caches, whose context jumps forward; "
                             f"{getattr(cache, 'kind', 'a ' + name)} keeps its own tokens: drop keep")
        if c.pos_emb == "rope" and not (abilities.slides or abilities.budgeted) and T + max_new_tokens > block_size + 1:
            raise ValueError(f"cache: a {name} does not slide (its abilities), and a rotary model past "
                             f"block_size={block_size} sees only the last block_size tokens; ask for at most "
                             f"{max(block_size + 1 - T, 0)} new tokens, or use new_kv_cache(model, {B})")
    if n_pad is None:
        return [0] * B
    pads = n_pad.tolist() if isinstance(n_pad, torch.Tensor) else list(n_pad)
    if len(pads) != B or not all(is_integer(p) and 0 <= p < T for p in pads):
        raise ValueError(f"n_pad must give each of the {B} rows its count of left-padding tokens, "
                         f"each in [0, {T - 1}], got {pads}")
    if any(pads) and cache is not None and not cache.abilities.takes_padding:
        raise ValueError(f"n_pad: a {type(cache).__name__} takes no left padding, its rows must start together: "
                         f"drop n_pad, or decode the rows one by one")
    return pads


def check_cache(model: GPT, cache, batch_size: int) -> None:
    """A cache passed in must serve batch_size rows; one that says its shape (model/caches/ring.py: CacheShape), as
    the project's caches do, must be one that new_kv_cache(model, batch_size) (or model/caches/factory.py's
    new_cache) could make for this model."""
    c = model.config
    if not all(hasattr(cache, name) for name in ("begin", "abilities", "batch_size")):
        raise ValueError(f"cache must be a KV cache (model/protocol.py: Cache), got {type(cache).__name__}")
    shape = getattr(cache, "shape", None)
    if shape is None:  # a cache written from the protocol alone: its rows are what it says
        if cache.batch_size != batch_size:
            raise ValueError(f"cache holds {cache.batch_size} rows; this generation needs {batch_size}")
        return
    budgeted = cache.abilities.budgeted
    layers, heads, head_dim, reach, window, max_len, dtype = shape
    reach = None if budgeted else reach
    if (layers, heads, head_dim, reach, window) != (c.n_kv_layer, *c.kv_cache_heads,
                                                    None if budgeted else c.block_size, c.local_window):
        raise ValueError(f"cache was made for another model shape ({layers} layers of {heads} key/value heads "
                         f"of {head_dim}, reach {reach}, local window {window}); use "
                         f"new_kv_cache(model, {batch_size})")
    if not dtype.is_floating_point:
        raise ValueError(f"cache holds {dtype}: keys and values are floating point, or int8 through "
                         f"new_kv_cache(model, {batch_size}, dtype=torch.int8)")
    if cache.batch_size != batch_size or (not budgeted and max_len < c.block_size):
        raise ValueError(f"cache holds {cache.batch_size} rows of {max_len} tokens; this generation needs "
                         f"{batch_size} rows of at least block_size={c.block_size}: use "
                         f"new_kv_cache(model, {batch_size})")
