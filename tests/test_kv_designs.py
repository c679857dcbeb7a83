"""The cache designs that shrink it: grouped- and multi-query attention (n_kv_head), layers that share keys and
values (kv_share), and an int8 cache. Each is proven where it differs from plain attention: against a forward
written out here from the weights, against torch's own grouped-query attention, and through the cache at every
step, past block_size and with left padding, on both ways a step reads the cache."""

import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F

from model import GPT, GREEDY, MultiHeadAttention, Sampling, generate, kv_cache_bytes, kv_cache_bytes_per_token
from model.caches import int8 as int8_cache
from model.caches.local_ring import WindowedKVCache
from model.attention import rotary, rotate
from model.measuring.decoder_loss import decoder_loss, teacher_forced_loss
from model.decoding.generate import prefill
from model.caches.int8 import Int8KVCache, Quantized, int8_attention, quantize_int8
from tiny_models import BLOCK_SIZE, random_model, random_tokens
from tolerance import U, assert_forward_close, assert_within, attention_bound, forward_atol, mha_bound
from model.caches.factory import new_kv_cache
from model.caches.ring import Uncached

# 4 layers so that kv_share=2 makes two groups; 4 heads of 6 channels (even, for rope)
SHAPE = dict(n_layer=4, n_head=4, n_embd=24)
DESIGNS = {
    "gqa": dict(n_kv_head=2),
    "mqa": dict(n_kv_head=1),
    "share2": dict(kv_share=2),
    "gqa-share2": dict(n_kv_head=2, kv_share=2),
    "mqa-share4": dict(n_kv_head=1, kv_share=4),
    "local": dict(window_pattern="LLLG", local_window=5),  # Gemma's pattern, a window of 5 in a block of 16
    "sink": dict(learned_sink=True),
    "local-sink-gqa": dict(window_pattern="LG", local_window=3, learned_sink=True, n_kv_head=2),
    "local-mqa-share2": dict(window_pattern="GGLL", local_window=6, n_kv_head=1, kv_share=2),
    # with rotary positions, a rotary key of LATENT_ROPE beside the latent; no biases: decoding absorbs the
    # up-projections (with biases it expands the latents, as the forward pass does, and test_latent_local_sink.py
    # checks the two forms against each other)
    "mla": dict(kv_latent=8, bias=False),
    "mla-local-sink": dict(kv_latent=10, window_pattern="LLG", local_window=4, learned_sink=True, bias=False),
}
LATENT_ROPE = 4
N_NEW = 3 * BLOCK_SIZE


def design_model(design: str, pos_emb: str, seed=0) -> GPT:
    rope_key = dict(kv_latent_rope=LATENT_ROPE) if "kv_latent" in DESIGNS[design] and pos_emb == "rope" else {}
    model = random_model(seed=seed, **SHAPE, **DESIGNS[design], **rope_key, pos_emb=pos_emb)
    if model.config.learned_sink:  # trained sinks are far from their zero start: some heads rest, some do not
        with torch.no_grad():
            for block in model.blocks:
                block.attn.sink.copy_(torch.tensor([-3.0, 0.0, 2.0, 4.0]))
    if model.config.kv_latent is not None:  # a trained norm's gain is far from its start at one
        with torch.no_grad():
            for block in model.blocks:
                block.attn.latent_norm.weight.uniform_(0.5, 2.0)
    return model


def is_local(config, layer: int) -> bool:
    """window_pattern, tiled over the layers from the first."""
    return config.window_pattern[layer % len(config.window_pattern)] == "L"


def reference_logits(model: GPT, seq: torch.Tensor, n_pad: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, T, vocab) of a forward over seq written out from the weights, one head at a time. Key/value head
    h serves query heads h * g .. h * g + g - 1 (g = n_head / n_kv_head); a layer that projects no keys and values
    uses those of the last layer that did. Query i attends keys i - reach < j <= i that are not left padding (a
    padding query sees only itself), reach being block_size, or local_window in a local layer; positions count from
    each row's first real token. A learned sink is one more score per head in the softmax, whose weight is dropped."""
    c = model.config
    B, T = seq.shape
    n_pad = torch.zeros(B, dtype=torch.long) if n_pad is None else n_pad
    pos = (torch.arange(T)[None, :] - n_pad[:, None]).clamp(min=0)  # (B, T)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]

    def allowed(reach):  # (B, T, T)
        band = (j <= i) & (j > i - reach)  # (T, T)
        return (band[None] & (j[None] >= n_pad[:, None, None])) | (i == j)[None]
    hd, group = c.n_embd // c.n_head, c.n_head // c.n_kv_head
    x = model.wte(seq) + (model.wpe(pos) if c.pos_emb == "learned" else 0)
    cos, sin = rotary(pos, hd) if c.pos_emb == "rope" else (None, None)  # (B, 1, T, hd), proven in test_rope
    for layer, block in enumerate(model.blocks):
        h = block.ln_1(x)
        out = F.linear(h, block.attn.qkv.weight, block.attn.qkv.bias)
        q = out[..., :c.n_embd].view(B, T, c.n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
        if c.kv_latent is not None:
            q, k, v = latent_queries_keys_values(model, block, out, pos)
        elif layer % c.kv_share == 0:
            kv_width = c.n_kv_head * hd
            k = out[..., c.n_embd:c.n_embd + kv_width].view(B, T, c.n_kv_head, hd).transpose(1, 2)
            v = out[..., c.n_embd + kv_width:].view(B, T, c.n_kv_head, hd).transpose(1, 2)
            if cos is not None:
                k = rotate(k, cos, sin)
        else:
            assert out.size(-1) == c.n_embd  # a sharing layer projects queries only
        if cos is not None and c.kv_latent is None:
            q = rotate(q, cos, sin)
        heads = []
        seen = allowed(c.local_window if is_local(c, layer) else c.block_size)
        for head in range(c.n_head):
            kv = head // group
            scores = q[:, head] @ k[:, kv].transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, T, T)
            scores = scores.masked_fill(~seen, float("-inf"))
            if c.learned_sink:
                sink = block.attn.sink[head].expand(B, T, 1)
                weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
            else:
                weights = scores.softmax(dim=-1)
            heads.append(weights @ v[:, kv])
        x = x + block.attn.out_proj(torch.cat(heads, dim=-1))
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.ln_f(x))


def latent_queries_keys_values(model, block, out, pos):
    """Multi-head latent attention's queries, keys and values (B, nh, T, width) from the fused projection's output
    `out`: each head's query is a content part (head_dim) and a rotary part (kv_latent_rope); its key is the latent
    projected up (head_dim) beside the rotary key, which every head shares; its value is the latent projected up.
    The latent is layer-normalised first."""
    c = model.config
    B, T, _ = out.shape
    hd, d_c, d_r = c.head_dim, c.kv_latent, c.kv_latent_rope
    q_width = c.n_head * (hd + d_r)
    q = out[..., :q_width].view(B, T, c.n_head, hd + d_r).transpose(1, 2)
    latent, rotary_key = out[..., q_width:q_width + d_c], out[..., q_width + d_c:]
    assert out.size(-1) == q_width + d_c + d_r and rotary_key.size(-1) == d_r
    norm = block.attn.latent_norm
    mean, var = latent.mean(-1, keepdim=True), latent.var(-1, unbiased=False, keepdim=True)
    latent = (latent - mean) / torch.sqrt(var + norm.eps) * norm.weight + (0 if norm.bias is None else norm.bias)
    up = F.linear(latent, block.attn.up.weight, block.attn.up.bias)  # (B, T, 2 * n_embd): keys, then values
    keys, v = (t.view(B, T, c.n_head, hd).transpose(1, 2) for t in up.split(c.n_embd, dim=-1))
    rotary_key = rotary_key[:, None].expand(B, c.n_head, T, d_r)
    if c.pos_emb == "rope":
        cos, sin = rotary(pos, d_r)
        q = torch.cat([q[..., :hd], rotate(q[..., hd:], cos, sin)], dim=-1)
        rotary_key = rotate(rotary_key, cos, sin)
    return q, torch.cat([keys, rotary_key], dim=-1), v


# --- the forward pass --------------------------------------------------------------------------------------

@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("design", DESIGNS)
def test_forward_equals_the_written_out_reference(design, pos_emb):
    model = design_model(design, pos_emb)
    seq = random_tokens(2, BLOCK_SIZE)
    assert_forward_close(model(seq)[0], reference_logits(model, seq), model)
    n_pad = torch.tensor([0, 5])
    got = model(seq, cache=Uncached(model.config.block_size, n_pad))[0]
    assert_forward_close(got[1, 5:], reference_logits(model, seq, n_pad)[1, 5:], model)


def test_the_designs_do_change_the_model():
    """The reference is not vacuous: a layer that shares keys and values computes something else than one that
    projects its own, and fewer key/value heads something else than n_head of them."""
    seq = random_tokens(2, BLOCK_SIZE)
    plain = random_model(**SHAPE)
    for design in ("share2", "gqa"):
        model = design_model(design, "learned")
        model.load_state_dict({**model.state_dict(), **{k: v for k, v in plain.state_dict().items()
                                                        if model.state_dict()[k].shape == v.shape}})
        assert (model(seq)[0] - plain(seq)[0]).abs().max() > 1e-2


@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("n_kv_head", [1, 2])
def test_grouped_query_attention_equals_torch_sdpa_with_enable_gqa(n_kv_head, need_weights):
    torch.manual_seed(0)
    mha = MultiHeadAttention(24, 4, n_kv_head=n_kv_head).eval()
    x = torch.randn(2, 7, 24)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[0, :2] = True
    out, _ = mha(x, is_causal=True, key_padding_mask=padding, need_weights=need_weights)
    q, k, v = mha.qkv(x).split([24, 6 * n_kv_head, 6 * n_kv_head], dim=-1)
    q = q.view(2, 7, 4, 6).transpose(1, 2)
    k, v = (t.view(2, 7, n_kv_head, 6).transpose(1, 2) for t in (k, v))
    allowed = torch.ones(7, 7, dtype=torch.bool).tril() & ~padding[:, None, None, :]  # (B, 1, 7, 7)
    allowed = allowed | torch.eye(7, dtype=torch.bool)  # rows 0-1 of batch 0 see no key: give them one, ignored
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    expected = mha.out_proj(y.transpose(1, 2).reshape(2, 7, 24))
    bound = 2 * mha_bound(mha, x, allowed=allowed)[0]  # two float32 evaluations of one formula
    assert_within(out[0, 2:], expected[0, 2:], bound[0, 2:])
    assert_within(out[1], expected[1], bound[1])


@pytest.mark.parametrize("mask", ["none", "rows", "2-d"])
@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_a_one_token_step_of_grouped_queries_equals_torch_sdpa_with_enable_gqa(n_kv_head, mask):
    torch.manual_seed(0)
    model = random_model(**SHAPE, n_kv_head=n_kv_head)
    attention = model.blocks[0].attn
    q, k, v = torch.randn(3, 4, 1, 6), torch.randn(3, n_kv_head, 9, 6), torch.randn(3, n_kv_head, 9, 6)
    allowed = {"none": None, "rows": torch.rand(3, 1, 1, 9) < 0.7, "2-d": torch.rand(1, 9) < 0.7}[mask]
    if allowed is not None:
        allowed[..., -1] = True  # the new token sees itself
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=n_kv_head < 4)
    assert_within(attention.attend(q, k, v, allowed), expected, 2 * attention_bound(q, k, v, allowed)[0])


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("n_kv_head", [1, 2])
def test_a_plain_model_with_each_key_value_head_repeated_gives_the_same_logits(n_kv_head, pos_emb):
    gqa = random_model(**SHAPE, n_kv_head=n_kv_head, pos_emb=pos_emb)
    plain = random_model(seed=1, **SHAPE, pos_emb=pos_emb)
    state = dict(gqa.state_dict())
    hd, group = 6, 4 // n_kv_head
    for name, weight in gqa.state_dict().items():
        if name.endswith("attn.qkv.weight"):
            q, k, v = weight.split([24, n_kv_head * hd, n_kv_head * hd])
            k, v = (t.view(n_kv_head, hd, 24).repeat_interleave(group, dim=0).reshape(24, 24) for t in (k, v))
            state[name] = torch.cat([q, k, v])
        elif name.endswith("attn.qkv.bias"):
            q, k, v = weight.split([24, n_kv_head * hd, n_kv_head * hd])
            k, v = (t.view(n_kv_head, hd).repeat_interleave(group, dim=0).reshape(24) for t in (k, v))
            state[name] = torch.cat([q, k, v])
    plain.load_state_dict(state)
    seq = random_tokens(3, BLOCK_SIZE)
    assert_forward_close(plain(seq)[0], gqa(seq)[0], plain)


# --- through the cache, at every step ----------------------------------------------------------------------

def cached_steps(model, prompt, n_pad, n_new, read_all_slots):
    """Greedy decoding straight through one cache (a prefill in the chunks it takes, then a token per step, the ring
    rolling past block_size): the sequence and each step's last logits."""
    cache = new_kv_cache(model, prompt.size(0), read_all_slots=read_all_slots)
    cache.reset(n_pad)
    seq, logits = prompt, [prefill(model, prompt, cache)]
    for _ in range(n_new):
        seq = torch.cat([seq, logits[-1].argmax(dim=-1, keepdim=True)], dim=1)
        logits.append(model.decode_step(seq[:, -1:], cache))
    return seq, logits


@pytest.mark.parametrize("read_all_slots", [False, True], ids=["filled slots", "all slots, masked"])
@pytest.mark.parametrize("design", DESIGNS)
def test_rolling_cache_equals_the_reference_at_every_step_for_3_blocks(design, read_all_slots):
    model = design_model(design, "rope")
    n_pad = torch.tensor([0, 3, 6])
    seq, logits = cached_steps(model, random_tokens(3, 9, seed=2), n_pad, N_NEW, read_all_slots)
    reference = reference_logits(model, seq, n_pad)  # the band of block_size over the whole sequence
    for step, got in enumerate(logits):
        assert_forward_close(got, reference[:, 8 + step], model)


@pytest.mark.parametrize("read_all_slots", [False, True], ids=["filled slots", "all slots, masked"])
@pytest.mark.parametrize("design", DESIGNS)
def test_learned_positions_cache_equals_the_reference_inside_the_block(design, read_all_slots):
    model = design_model(design, "learned")
    n_pad = torch.tensor([0, 3, 6])
    seq, logits = cached_steps(model, random_tokens(3, 9, seed=2), n_pad, BLOCK_SIZE - 9, read_all_slots)
    reference = reference_logits(model, seq, n_pad)
    for step, got in enumerate(logits):
        assert_forward_close(got, reference[:, 8 + step], model)


def recorded_logits(model, monkeypatch, **kwargs):
    """generate's tokens and the logits every step drew them from."""
    logits = []
    original = Sampling.next_token

    def recording(self, step_logits, generator=None):
        logits.append(step_logits.clone())
        return original(self, step_logits, generator)

    monkeypatch.setattr(Sampling, "next_token", recording)
    out = generate(model, **kwargs)
    monkeypatch.undo()
    return out, logits


@pytest.mark.parametrize("read_all_slots", [False, True], ids=["filled slots", "all slots, masked"])
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("design", DESIGNS)
def test_generation_past_block_size_equals_recomputation_step_by_step(design, pos_emb, read_all_slots, monkeypatch):
    """3 x block_size new tokens, left-padded rows: every step's logits through the cache equal those of a full
    forward over the same context (refills for learned positions, the rolling ring for rotary ones), and greedy
    and seeded sampling give the same tokens with and without the cache."""
    model = design_model(design, pos_emb)
    prompt, n_pad = random_tokens(3, 7, seed=3), [0, 2, 4]
    cache = new_kv_cache(model, 3, read_all_slots=read_all_slots)
    cached, cached_logits = recorded_logits(model, monkeypatch, idx=prompt, max_new_tokens=N_NEW, sampling=GREEDY,
                                            n_pad=n_pad, cache=cache)
    full, full_logits = recorded_logits(model, monkeypatch, idx=prompt, max_new_tokens=N_NEW, sampling=GREEDY,
                                        n_pad=n_pad, use_cache=False)
    assert torch.equal(cached, full)
    for got, want in zip(cached_logits, full_logits, strict=True):
        assert_forward_close(got, want, model)
    sampling = Sampling(temperature=1.0, top_k=8)
    with_cache, without = (generate(model, prompt, N_NEW, sampling=sampling, n_pad=n_pad, use_cache=use,
                                    generator=torch.Generator().manual_seed(7)) for use in (True, False))
    assert torch.equal(with_cache, without)


# --- the int8 cache ----------------------------------------------------------------------------------------

INT8_ATOL = 0.05  # the int8 cache's logits against the fp32 cache's, on these random models (|logits| ~ 5)


def test_int8_quantizer_follows_the_absmax_formula():
    x = torch.randn(3, 4, 5, 8) * torch.logspace(-3, 2, 8)  # rows of very different magnitudes
    q, scale = quantize_int8(x, torch.float32)
    expected_scale = x.abs().amax(dim=-1, keepdim=True) / 127
    torch.testing.assert_close(scale, expected_scale, atol=0, rtol=1e-6)
    assert q.dtype == torch.int8 and torch.equal(q, torch.round(x / expected_scale).to(torch.int8))
    assert (q.abs().amax(dim=-1) == 127).all()  # each row's largest value maps to +-127
    assert ((q * scale - x).abs() <= scale / 2 + 1e-7).all()  # within half a step of the original


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("design", ["mha", "gqa-share2", "local-sink-gqa", "mla-local-sink"])
def test_int8_cache_logits_stay_within_tolerance_of_fp32_and_greedy_agrees_where_it_must(design, pos_emb):
    """Teacher-forced through both caches, left-padded rows, past block_size for rope: the int8 cache's logits
    stay within INT8_ATOL of the fp32 cache's, and the argmax agrees wherever fp32's top two logits are further
    apart than twice that."""
    model = random_model(**SHAPE, pos_emb=pos_emb) if design == "mha" else design_model(design, pos_emb)
    n_new = N_NEW if pos_emb == "rope" else BLOCK_SIZE - 7
    n_pad = torch.tensor([0, 2, 4])
    seq, fp32_logits = cached_steps(model, random_tokens(3, 7, seed=4), n_pad, n_new, read_all_slots=False)
    int8 = new_kv_cache(model, 3, dtype=torch.int8)
    rings = [int8.ring, int8.local] if isinstance(int8, WindowedKVCache) else [int8]  # local layers: two rings
    assert int8.dtype == torch.int8 and all(isinstance(r, Int8KVCache) and r.k[0].dtype == torch.int8 for r in rings)
    int8.reset(n_pad)
    int8_logits = [prefill(model, seq[:, :7], int8)] + [model.decode_step(seq[:, t:t + 1], int8)
                                                           for t in range(7, seq.size(1) - 1)]
    decisive = 0
    for got, want in zip(int8_logits, fp32_logits[:-1], strict=True):
        assert (got - want).abs().max() < INT8_ATOL
        assert (got - want).abs().max() > 0  # really quantized
        top2 = want.topk(2).values
        clear = top2[:, 0] - top2[:, 1] > 2 * INT8_ATOL
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
        decisive += int(clear.sum())
    assert decisive > 0


@pytest.mark.parametrize("rows_at_a_time", [False, True], ids=["all rows", "a row at a time"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["output", "weights"])
@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_int8_attention_folds_the_scales_and_equals_sdpa_on_the_dequantized_keys_and_values(
        n_kv_head, need_weights, rows_at_a_time, monkeypatch):
    """Attention over int8 keys and values with their scales (an int8 cache's) equals torch's SDPA over the keys and
    values dequantized beforehand, with a padding mask that leaves one row no key at all (zeros, never NaN), eagerly
    in blocks of rows or all at once."""
    monkeypatch.setattr(int8_cache, "FLOAT_BLOCK_BYTES", 1 if rows_at_a_time else 2**30)
    B, T_q, T_k, hs = 3, 2, 9, 6
    torch.manual_seed(0)
    q = torch.randn(B, 4, T_q, hs)
    (k, k_scale), (v, v_scale) = (quantize_int8(torch.randn(B, n_kv_head, T_k, hs), torch.float32) for _ in "kv")
    mask = torch.rand(B, 1, T_q, T_k) > 0.3
    mask[1] = False  # a row that may see no key
    y, weights = int8_attention(q, Quantized(k, k_scale), Quantized(v, v_scale), mask, need_weights)
    expected = F.scaled_dot_product_attention(q, k * k_scale, v * v_scale, attn_mask=mask, enable_gqa=n_kv_head < 4)
    expected[1] = 0
    # each path rounds a key or value times its scale once, or folds the scale in with a rounding or two: 2 u of each
    k_exact, v_exact = k.double() * k_scale.double(), v.double() * v_scale.double()
    bounds = attention_bound(q, k_exact, v_exact, mask, dk=2 * U * k_exact.abs(), dv=2 * U * v_exact.abs())
    out_bound, weights_bound = (2 * bound for bound in bounds)  # two float32 evaluations
    assert_within(y, expected, out_bound)
    if need_weights:
        group = 4 // n_kv_head
        scores = q @ (k * k_scale).repeat_interleave(group, dim=1).transpose(-2, -1) / math.sqrt(hs)
        expected_weights = scores.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)
        assert_within(weights, expected_weights, weights_bound)
    else:
        assert weights is None


def test_int8_cache_decodes_a_batch_in_blocks_of_rows_as_it_does_all_at_once(monkeypatch):
    """Eagerly on the CPU an int8 cache is read a block of rows at a time; one row per block gives the logits of
    all rows at once, ragged rows included."""
    model = design_model("gqa", "rope")
    prompt, n_pad = random_tokens(3, 7, seed=5), torch.tensor([0, 2, 4])
    logits = {}
    for rows_at_a_time in (False, True):
        monkeypatch.setattr(int8_cache, "FLOAT_BLOCK_BYTES", 1 if rows_at_a_time else 2**30)
        cache = new_kv_cache(model, 3, dtype=torch.int8)
        cache.reset(n_pad)
        steps = [model.decode_step(prompt, cache)]
        steps += [model.decode_step(steps[-1].argmax(-1, keepdim=True), cache) for _ in range(BLOCK_SIZE + 3)]
        logits[rows_at_a_time] = torch.stack(steps)
    assert_forward_close(logits[True], logits[False], model)


@pytest.mark.parametrize("design", ["gqa-share2", pytest.param("local-sink-gqa", marks=pytest.mark.slow),
                                    pytest.param("mla-local-sink", marks=pytest.mark.slow)])  # compiling takes long
def test_compiled_step_through_an_int8_cache_equals_the_eager_one(design):
    """torch.compile fuses the int8 keys' conversion into attention's kernels: the same logits at every step, past
    block_size, with ragged rows, grouped-query attention and layers that share keys and values, or local layers and
    a learned sink."""
    model = design_model(design, "rope")
    prompt, n_pad = random_tokens(2, 7, seed=6), torch.tensor([0, 3])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    logits = {}
    for name, step in (("eager", model.decode_step), ("compiled", torch.compile(model.decode_step, fullgraph=True))):
        cache = new_kv_cache(model, 2, dtype=torch.int8)
        cache.reset(n_pad)
        out = [prefill(model, prompt, cache)]
        out += [step(out[-1].argmax(-1, keepdim=True), cache) for _ in range(BLOCK_SIZE + 3)]
        logits[name] = torch.stack(out)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the step did go through the compiler
    assert_forward_close(logits["compiled"], logits["eager"], model)


@pytest.mark.parametrize("read_all_slots", [False, True], ids=["filled slots", "all slots, masked"])
def test_int8_cache_generates_with_ragged_rows_past_block_size_for_both_position_kinds(read_all_slots):
    for pos_emb in ("learned", "rope"):
        model = design_model("gqa", pos_emb)
        prompt = random_tokens(2, 7)
        cache = new_kv_cache(model, 2, dtype=torch.int8, read_all_slots=read_all_slots)
        out = generate(model, prompt, N_NEW, sampling=GREEDY, n_pad=[0, 3], cache=cache)
        assert out.shape == (2, 7 + N_NEW) and len(cache) > 0


# --- the cache's size -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("spare", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("design", ["mha", *DESIGNS])
def test_cache_bytes_follow_the_formula_and_shrink_as_the_design_says(design, dtype, spare):
    overrides = {} if design == "mha" else DESIGNS[design]
    model = random_model(**SHAPE, **overrides)
    c = model.config
    cache = new_kv_cache(model, 3, max_len=BLOCK_SIZE + spare, dtype=dtype)
    assert cache.nbytes == 3 * kv_cache_bytes(c, dtype, BLOCK_SIZE + spare)
    held = [b for name, b in cache.named_buffers() if re.fullmatch(r"((ring|local)\.)?(k|v|k_scale|v_scale)\d+", name)]
    assert len(held) == c.n_kv_layer * (4 if dtype == torch.int8 else 2)
    assert cache.nbytes == sum(b.nbytes for b in held)
    # slots per cache layer: block_size (and the spare ones), or a local layer's window (and the spare ones)
    slots = sum(BLOCK_SIZE + spare if not is_local(c, layer) else c.local_window + spare
                for layer in range(0, c.n_layer, c.kv_share))
    if c.kv_latent is not None:  # the latent alone (learned positions), in two halves, each with its int8 scale
        expected = 3 * slots * (c.kv_latent * dtype.itemsize + (2 * 4 if dtype == torch.int8 else 0))
    elif dtype == torch.int8:  # a byte per value, and a float32 scale per token, head and layer, for keys and values
        expected = 2 * 3 * slots * c.n_kv_head * (6 + 4)
    else:
        expected = 2 * 3 * slots * c.n_kv_head * 6 * dtype.itemsize
    assert cache.nbytes == expected
    assert kv_cache_bytes_per_token(c, dtype) == kv_cache_bytes(c, dtype) / BLOCK_SIZE
    if c.local_window is not None:  # what the local layers save
        assert kv_cache_bytes(c, dtype) < kv_cache_bytes(dataclasses.replace(c, window_pattern="G",
                                                                             local_window=None), dtype)


# --- settings that cannot work ----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, fragment", [
    (dict(n_kv_head=3), "n_kv_head 3 must divide n_head 4"),
    (dict(n_kv_head=0), "n_kv_head must be an integer of at least 1"),
    (dict(kv_share=3), "kv_share 3 must divide n_layer 4"),
    (dict(kv_share=True), "kv_share must be an integer"),
])
def test_designs_that_cannot_work_are_refused(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        random_model(**SHAPE, **overrides)


def test_a_cache_of_another_design_is_refused():
    model = design_model("gqa", "learned")
    other = design_model("mqa", "learned")
    with pytest.raises(ValueError, match="another model shape"):
        generate(model, random_tokens(1, 3), 2, cache=new_kv_cache(other, 1))


# --- loss through the decoder -------------------------------------------------------------------------------------

@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("design", ["mha", "gqa-share2", "local-sink-gqa", "mla"])
def test_loss_through_the_decoder_equals_teacher_forced_loss_for_an_exact_cache(design, pos_emb):
    model = random_model(**SHAPE, pos_emb=pos_emb) if design == "mha" else design_model(design, pos_emb)
    tokens = random_tokens(3, 5 * BLOCK_SIZE, seed=5)
    through_cache = decoder_loss(model, tokens, prompt_len=5)
    # -log softmax moves at most twice as far as the logits it reads: twice forward_atol of their magnitude
    tol = 2 * forward_atol(model.config, model(tokens[:, :BLOCK_SIZE])[0])
    assert through_cache == pytest.approx(teacher_forced_loss(model, tokens, prompt_len=5, chunk=13), abs=tol)
    assert through_cache == pytest.approx(teacher_forced_loss(model, tokens, prompt_len=5, chunk=64), abs=tol)
    if pos_emb == "learned":
        assert decoder_loss(model, tokens, prompt_len=5, keep=3) == pytest.approx(
            teacher_forced_loss(model, tokens, prompt_len=5, keep=3), abs=tol)
    # the int8 cache's logits are not the same: its loss differs, by a little
    int8 = decoder_loss(model, tokens, prompt_len=5, cache=new_kv_cache(model, 3, dtype=torch.int8))
    assert 0 < abs(int8 - through_cache) < 0.01


def test_teacher_forced_loss_is_not_vacuous_the_context_rule_matters():
    """A plain forward over whole block_size windows (another context rule) gives another loss."""
    model = random_model(**SHAPE)
    tokens = random_tokens(2, 4 * BLOCK_SIZE, seed=6)
    rule = teacher_forced_loss(model, tokens, prompt_len=BLOCK_SIZE)
    windows = tokens.unfold(1, BLOCK_SIZE + 1, BLOCK_SIZE).reshape(-1, BLOCK_SIZE + 1)
    assert abs(model(windows[:, :-1], windows[:, 1:])[1].item() - rule) > 1e-3
