"""Attention sinks and the sliding window (model/caches/sinks.py, model/caches/window.py): cached decoding against a forward written out
here, with StreamingLLM's positions within the cache, past many wraps of the ring; the full budget against the
full cache; the settings that cannot work."""

import math

import pytest
import torch
import torch.nn.functional as F

from model import GREEDY, generate
from model.decoding.generate import generate_tokens
from model.caches.sinks import new_sink_cache
from model.caches.window import new_window_cache
from tiny_models import random_model, random_tokens
from tolerance import assert_forward_close
from model.caches.factory import new_kv_cache


def streaming_reference(model, seq: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """Logits (B, T, vocab) where token p attends tokens j <= p with j < sinks or j > p - window. Positions are the
    cache's: while p < sinks + window they are the tokens' own; after, token p sits at sinks + window - 1. Rotary:
    window keys keep their distance to it, and sink j sits at j, so p - j' = sinks + window - 1 - j. Learned: each
    token keeps the position it came in at."""
    c = model.config
    B, T = seq.shape
    hd = c.n_embd // c.n_head
    group = c.n_head // c.n_kv_head
    learned = c.pos_emb == "learned"
    x = model.wte(seq) + (model.wpe(torch.arange(T).clamp(max=sinks + window - 1)) if learned else 0)
    inv_freq = 10_000.0 ** -(torch.arange(0, hd, 2, dtype=torch.float64) / hd)

    def turn(v, position):  # v (..., hd) turned to position: pair (i, i + hd/2) by position * inv_freq[i]
        if learned:
            return v
        angle = position * inv_freq
        cos, sin = angle.cos().float(), angle.sin().float()
        a, b = v[..., :hd // 2], v[..., hd // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    for i, block in enumerate(model.blocks):
        out = F.linear(block.ln_1(x), block.attn.qkv.weight, block.attn.qkv.bias)
        kv_width = c.n_kv_head * hd
        q = out[..., :c.n_embd].view(B, T, c.n_head, hd)
        if i % c.kv_share == 0:  # shared layers: the group's first projects keys and values, the others read them
            k = out[..., c.n_embd:c.n_embd + kv_width].view(B, T, c.n_kv_head, hd)
            v = out[..., c.n_embd + kv_width:].view(B, T, c.n_kv_head, hd)
        y = torch.zeros(B, T, c.n_head, hd)
        for p in range(T):
            seen = [j for j in range(p + 1) if j < sinks or j > p - window]
            moved = max(p + 1 - (sinks + window), 0)
            for head in range(c.n_head):
                query = turn(q[:, p, head], p)  # (B, hd)
                keys = torch.stack([turn(k[:, j, head // group], j + (moved if j < sinks else 0)) for j in seen], 1)
                weights = ((keys @ query[..., None])[..., 0] / math.sqrt(hd)).softmax(dim=-1)  # (B, len(seen))
                y[:, p, head] = (weights[..., None] * v[:, seen, head // group]).sum(dim=1)
        x = x + block.attn.out_proj(y.reshape(B, T, c.n_embd))
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.ln_f(x))


class Recorder:
    """A Sampling that feeds given tokens and keeps each step's logits."""

    def __init__(self, targets):
        self.targets, self.logits = targets, []

    def next_token(self, logits, generator=None):
        self.logits.append(logits.clone())
        return self.targets[:, len(self.logits) - 1]


def cached_logits(model, seq, prompt_len, cache) -> torch.Tensor:
    """(B, T - prompt_len, vocab): the logits after each of tokens prompt_len - 1 .. T - 2, through cache."""
    recorder = Recorder(seq[:, prompt_len:])
    for _ in generate_tokens(model, seq[:, :prompt_len], seq.size(1) - prompt_len, sampling=recorder, cache=cache):
        pass
    return torch.stack(recorder.logits, dim=1)


@pytest.mark.parametrize("sinks, window, n_kv_head, kv_share, pos_emb", [
    (3, 9, 3, 1, "rope"), (1, 12, 1, 1, "rope"), (4, 4, 3, 1, "rope"), (0, 7, 3, 1, "rope"), (3, 9, 3, 1, "learned"),
    (2, 5, 1, 1, "learned"), (3, 9, 3, 2, "rope"), (0, 7, 1, 2, "learned")])
@torch.no_grad()
def test_sinks_and_window_equal_a_forward_with_streaming_positions_written_out(sinks, window, n_kv_head, kv_share,
                                                                              pos_emb):
    """Every step's logits, over 4 x block_size tokens (the ring wraps many times), prefilled in chunks; with
    shared layers too, whose later layers read the keys and values the group's first wrote."""
    model = random_model(pos_emb=pos_emb, n_kv_head=n_kv_head, kv_share=kv_share, n_layer=2 * kv_share)
    seq = random_tokens(2, 4 * model.config.block_size, seed=5)
    prompt_len = sinks + window - 2
    cached = cached_logits(model, seq, prompt_len, new_sink_cache(model, 2, sinks=sinks, window=window))
    reference = streaming_reference(model, seq, sinks, window)[:, prompt_len - 1:-1]
    assert_forward_close(cached, reference, model)
    if sinks == 0:  # the window cache of its own module keeps the same tokens, at the same positions
        windowed = cached_logits(model, seq, prompt_len, new_window_cache(model, 2, budget=window))
        assert_forward_close(windowed, reference, model)


@torch.no_grad()
def test_a_budget_that_holds_the_whole_context_is_the_full_cache():
    """sinks=0 and window=block_size is the full ring, past block_size; any split of block_size tokens is too, while
    the text fits."""
    model = random_model(pos_emb="rope")
    block = model.config.block_size
    seq = random_tokens(2, 3 * block, seed=6)
    full = cached_logits(model, seq, 5, new_kv_cache(model, 2))
    assert torch.equal(cached_logits(model, seq, 5, new_sink_cache(model, 2, sinks=0, window=block)), full)
    fits = cached_logits(model, seq[:, :block], 5, new_sink_cache(model, 2, sinks=4, window=block - 4))
    assert torch.equal(fits, full[:, :block - 5])


def test_many_samples_of_one_prompt_decode_as_one_row_does():
    model = random_model(pos_emb="rope")
    prompt = random_tokens(1, 7, seed=7)
    alone = generate(model, prompt, 40, sampling=GREEDY, cache=new_sink_cache(model, 1, sinks=2, window=6))
    shared = generate(model, prompt.expand(3, -1), 40, sampling=GREEDY,
                      cache=new_sink_cache(model, 3, sinks=2, window=6))
    assert torch.equal(shared, alone.expand(3, -1))


@pytest.mark.parametrize("overrides, kwargs, fragment", [
    (dict(kv_latent=8), dict(sinks=2, window=6), "neither latent attention nor local layers"),
    (dict(pos_emb="rope"), dict(sinks=-1, window=6), "sinks must be an integer >= 0"),
    (dict(pos_emb="rope"), dict(sinks=2, window=0), "window one >= 1"),
    (dict(pos_emb="rope"), dict(sinks=4, window=13), "sinks \\+ window = 17 is more than the block_size=16"),
])
def test_settings_that_cannot_work_are_refused(overrides, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        new_sink_cache(random_model(**overrides), 1, **kwargs)


def test_padding_rollback_compile_and_a_keep_are_refused():
    """keep says what a refilled cache's context keeps (learned positions); a budget keeps its own tokens and never
    refills, so a keep would be ignored."""
    learned = random_model()
    with pytest.raises(ValueError, match="keep applies to the float and low-bit caches, whose context jumps forward; "
                                         "a sink cache keeps its own tokens: drop keep"):
        generate(learned, random_tokens(1, 5), 3, cache=new_sink_cache(learned, 1, sinks=2, window=6), keep=4)
    model = random_model(pos_emb="rope")
    with pytest.raises(ValueError, match="no left padding"):
        generate(model, random_tokens(2, 5), 3, cache=new_sink_cache(model, 2, sinks=2, window=6), n_pad=[0, 2])
    cache = new_sink_cache(model, 1, sinks=2, window=6)
    model.decode_step(random_tokens(1, 5), cache)
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback(1)
    with pytest.raises(ValueError, match="decodes eagerly"):
        generate(model, random_tokens(1, 5), 3, cache=cache, compile=True)
