"""The KV cache: decoding through it gives the logits of a full forward over the same context, at every step.

Also: prefill in one go, in chunks, or prefill-then-continue agree; the cache is really used (one new token
per row and step goes through the blocks); its shapes, reset() and size in bytes; left-padded rows.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from model import CausalSelfAttention, GPT, GPTConfig, GREEDY, KVCache, RingKVCache, build_model, generate, generate_tokens
from model.attention import causal_mask
from tiny_models import BLOCK_SIZE, VOCAB, random_model, random_tokens, tiny_config, train_briefly
from tolerance import assert_forward_close, assert_within, projected_attention_bound
from model.caches.factory import new_kv_cache
from model.caches.ring import Uncached


# n_embd 24 is not a power of two, and 1, 3 and 4 heads divide it (head widths 24, 8, 6)
CONFIGS = {
    "1head-bias": dict(n_head=1, bias=True),
    "3heads-no_bias": dict(n_head=3, bias=False),
    "4heads-bias-dropout0.2": dict(n_head=4, bias=True, dropout=0.2),  # dropout 0.2, used in eval mode
    "4heads-no_bias": dict(n_head=4, bias=False),
}


# --- a briefly trained model -----------------------------------------------------------------------------

PATTERN = random_tokens(11, seed=123)  # the "text": 11 tokens over and over
TEXT = PATTERN.repeat(40)


@functools.cache
def trained_model(config_name: str):
    """(model in eval mode, training losses) after 30 Adam steps on TEXT, from GPT-2's own init."""
    torch.manual_seed(0)
    model = build_model(tiny_config(**CONFIGS[config_name]))
    losses = train_briefly(model, TEXT, steps=30, batch_size=8)
    return model.eval(), losses


@pytest.fixture(scope="module")
def trained():
    yield trained_model
    trained_model.cache_clear()


@pytest.mark.parametrize("config_name", CONFIGS)
def test_brief_training_lowers_the_loss(trained, config_name):
    _, losses = trained(config_name)
    assert losses[-1] < 0.6 * losses[0]


# --- every decode step equals a full forward -------------------------------------------------------------

@pytest.fixture(params=["filled slots", "all slots, masked"])
def attention_path(request, monkeypatch):
    """Both ways a cached forward attends: to the filled slots only (eager, on the CPU), and to all max_len
    slots through the cache's mask (static shapes: what a compiled step runs), forced here without compiling."""
    if request.param == "all slots, masked":
        monkeypatch.setattr(RingKVCache, "static_shapes", property(lambda self: True))
    yield request.param


def assert_every_step_matches_full_forward(model, prompt):
    """Prefill prompt, then decode greedily until the cache is full. At every step the cached logits must
    equal those of a full forward over exactly the same context."""
    cache = new_kv_cache(model, prompt.size(0))
    logits, _ = model(prompt, cache=cache)
    assert_forward_close(logits, model(prompt)[0], model)  # every prompt position
    assert len(cache) == prompt.size(1)
    seq, last = prompt, logits[:, -1]
    for step in range(BLOCK_SIZE - prompt.size(1)):
        new = last.argmax(dim=-1, keepdim=True)  # (B, 1)
        seq = torch.cat([seq, new], dim=1)
        # both ways into the cache: the generation step, and the public forward
        last = model.decode_step(new, cache) if step % 2 == 0 else model(new, cache=cache)[0][:, -1]
        assert len(cache) == seq.size(1)
        assert_forward_close(last, model(seq)[0][:, -1], model)


@pytest.mark.parametrize("prompt_len", [1, 7, BLOCK_SIZE])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("config_name", CONFIGS)
def test_cached_logits_equal_full_forward_at_every_step_random_model(config_name, batch, prompt_len, attention_path):
    model = random_model(**CONFIGS[config_name])
    assert_every_step_matches_full_forward(model, random_tokens(batch, prompt_len))


@pytest.mark.parametrize("prompt_len", [1, 7, BLOCK_SIZE])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("config_name", CONFIGS)
def test_cached_logits_equal_full_forward_at_every_step_trained_model(trained, config_name, batch, prompt_len):
    model, _ = trained(config_name)
    starts = torch.randint(0, len(TEXT) - BLOCK_SIZE, (batch,), generator=torch.Generator().manual_seed(prompt_len))
    prompt = torch.stack([TEXT[s:s + prompt_len] for s in starts])  # prompts cut from the training text
    assert_every_step_matches_full_forward(model, prompt)


def test_dropout_config_in_eval_mode_is_deterministic():
    """The dropout 0.2 model of the grid really is deterministic in eval, with and without the cache."""
    model = random_model(**CONFIGS["4heads-bias-dropout0.2"])
    prompt = random_tokens(2, 7)
    assert torch.equal(model(prompt)[0], model(prompt)[0])
    assert torch.equal(generate(model, prompt, 12, sampling=GREEDY), generate(model, prompt, 12, sampling=GREEDY))
    assert not torch.equal(model.train()(prompt)[0], model(prompt)[0])  # ...and does drop out in training


@pytest.mark.parametrize("ring", [False, True], ids=["plain cache", "ring, masked"])
def test_attention_block_with_a_layer_cache_equals_full_causal_attention(ring):
    """The bare block: a 4-token prefill, then one token at a time, then a 3-token chunk, all through one
    layer's cache (the plain one, or the ring with its own mask over every slot), equal full causal
    self-attention over the sequence, computed here by torch's SDPA from the block's own projections."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(GPTConfig(vocab_size=2, block_size=10, n_layer=1, n_head=3, n_embd=12), 0).eval()
    x = torch.randn(2, 10, 12)
    q, k, v = (t.view(2, 10, 3, 4).transpose(1, 2) for t in attn.qkv(x).split(12, dim=-1))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 10, 12)
    expected = attn.out_proj(y)
    shape = dict(n_kv_layer=1, batch_size=2, n_kv_head=3, max_len=10, head_dim=4)
    cache = RingKVCache(**shape, read_all_slots=True) if ring else KVCache(**shape)
    outs, t = [], 0
    for n in (4, 1, 1, 1, 3):
        step = cache.begin(n)
        assert (step.mask is not None) == ring
        outs.append(attn(x[:, t:t + n], step.mask, None, step.layer(0)))
        t += n
    bound = projected_attention_bound(x, x, attn.qkv, attn.widths, 3, 3, attn.out_proj, causal_mask(10, 10))[0]
    assert_within(torch.cat(outs, dim=1), expected, 2 * bound)  # two float32 evaluations of one formula


# --- prefill: one shot, continued, chunked ---------------------------------------------------------------

def prefill_in_chunks(model, tokens, chunks):
    """Feed tokens through a fresh cache in chunks of the given sizes: (logits (B, T, V), cache)."""
    cache = new_kv_cache(model, tokens.size(0))
    logits, t = [], 0
    for n in chunks:
        logits.append(model(tokens[:, t:t + n], cache=cache)[0])
        t += n
    assert t == tokens.size(1) and len(cache) == t
    return torch.cat(logits, dim=1), cache


def assert_same_cache(cache, expected, n_filled, model):
    """The two caches' keys and values, each an output of the model's forward up to its layer, within forward_atol."""
    assert len(cache) == len(expected) == n_filled
    for mine, theirs in zip(cache.k + cache.v, expected.k + expected.v, strict=True):
        assert_forward_close(mine[:, :, :n_filled], theirs[:, :, :n_filled], model)


def test_prefill_then_continue_equals_one_shot_prefill():
    model = random_model()
    tokens = random_tokens(2, 10)
    whole_logits, whole = prefill_in_chunks(model, tokens, [10])
    logits, continued = prefill_in_chunks(model, tokens, [6, 4])
    assert_forward_close(logits, whole_logits, model)
    assert_same_cache(continued, whole, 10, model)
    nxt = random_tokens(2, 1, seed=1)  # and both caches go on identically
    assert_forward_close(model.decode_step(nxt, continued), model.decode_step(nxt, whole), model)


@pytest.mark.parametrize("chunks", [[3, 4, BLOCK_SIZE - 7], [1] * 5 + [BLOCK_SIZE - 5]], ids=["3+4+rest", "1x5+rest"])
def test_chunked_prefill_equals_whole_prefill(chunks, attention_path):
    model = random_model()
    tokens = random_tokens(3, BLOCK_SIZE)
    whole_logits, whole = prefill_in_chunks(model, tokens, [BLOCK_SIZE])
    logits, chunked = prefill_in_chunks(model, tokens, chunks)
    assert_forward_close(logits, whole_logits, model)
    assert_forward_close(whole_logits, model(tokens)[0], model)
    assert_same_cache(chunked, whole, BLOCK_SIZE, model)


# --- the cache is really used ----------------------------------------------------------------------------

def count_tokens_into_blocks(model):
    """Record the (B, T) of every forward through the first block: a list, and the hook handle."""
    shapes = []
    handle = model.blocks[0].register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape[:2])))
    return shapes, handle


@pytest.mark.parametrize("batch", [1, 3])
def test_each_decode_step_sends_one_token_per_row_and_the_position_advances_by_one(batch):
    model = random_model()
    prompt = random_tokens(batch, 5)
    cache = new_kv_cache(model, batch)
    shapes, handle = count_tokens_into_blocks(model)
    try:
        for i, _ in enumerate(generate_tokens(model, prompt, 9, sampling=GREEDY, cache=cache)):
            # the token just yielded is fed on the next step: the cache holds the prompt and i earlier tokens
            assert len(cache) == 5 + i
            assert shapes[-1] == ((batch, 5) if i == 0 else (batch, 1))
    finally:
        handle.remove()
    assert shapes == [(batch, 5)] + [(batch, 1)] * 8  # the prompt once, then one token per row and step


def test_without_the_cache_every_step_recomputes_the_whole_context():
    """The hook's control: use_cache=False sends the full, growing context each step."""
    model = random_model()
    shapes, handle = count_tokens_into_blocks(model)
    try:
        generate(model, random_tokens(2, 5), 4, sampling=GREEDY, use_cache=False)
    finally:
        handle.remove()
    assert shapes == [(2, 5), (2, 6), (2, 7), (2, 8)]


@pytest.mark.parametrize("keep", [None, 5, BLOCK_SIZE], ids=["default_keep", "keep=5", "keep=block_size"])
def test_past_block_size_the_cache_is_rebuilt_with_one_prefill_of_keep_tokens(keep):
    """Prompt 4, block 16, keep W: 4, then 1 per step up to a full context of 16, then W (the rebuild),
    then 1 per step up to 16 again, and so on: a rebuild every 16 - W + 1 tokens."""
    model = random_model()
    w = BLOCK_SIZE // 2 if keep is None else keep
    shapes, handle = count_tokens_into_blocks(model)
    try:
        generate(model, random_tokens(1, 4), 50, sampling=GREEDY, keep=keep)
    finally:
        handle.remove()
    cycle = [w] + [1] * (BLOCK_SIZE - w)
    expected = ([4] + [1] * (BLOCK_SIZE - 4) + cycle * 50)[:50]
    assert [t for _, t in shapes] == expected


# --- the cache object ------------------------------------------------------------------------------------

@pytest.mark.parametrize("config_name", ["1head-bias", "4heads-no_bias"])
@pytest.mark.parametrize("max_len", [None, 20])
def test_cache_buffers_have_shape_b_heads_max_len_head_dim_per_layer(config_name, max_len):
    model = random_model(**CONFIGS[config_name])
    c = model.config
    cache = new_kv_cache(model, 3, max_len)
    length = max_len or c.block_size
    assert cache.max_len == length and len(cache) == 0
    assert len(cache.k) == len(cache.v) == c.n_layer
    for i in range(c.n_layer):
        assert cache.k[i].shape == cache.v[i].shape == (3, c.n_head, length, c.n_embd // c.n_head)
        assert cache.k[i].dtype == cache.v[i].dtype == cache.dtype == model.wte.weight.dtype
    # each layer a buffer of its own, not a view of a larger one (which a compiled step would copy whole to write)
    assert len({t.untyped_storage().data_ptr() for t in cache.k + cache.v}) == 2 * c.n_layer


def test_layer_view_writes_in_place_into_the_cache_buffers():
    cache = KVCache(n_kv_layer=2, batch_size=1, n_kv_head=2, max_len=6, head_dim=3)
    k_new, v_new = torch.randn(1, 2, 2, 3), torch.randn(1, 2, 2, 3)
    k, v = cache.layer(1, torch.arange(2), n_read=None).update(k_new, v_new)
    assert k.data_ptr() == cache.k1.data_ptr()  # the whole layer buffer, not a copy
    assert torch.equal(cache.k1[:, :, :2], k_new) and torch.equal(cache.v1[:, :, :2], v_new)
    assert (cache.k0 == 0).all() and (cache.k1[:, :, 2:] == 0).all()


def test_reset_empties_the_cache_and_a_fresh_prefill_equals_a_brand_new_cache():
    model = random_model()
    cache = new_kv_cache(model, 2)
    model(random_tokens(2, 12, seed=5), cache=cache)  # fill it with something else first
    assert len(cache) == 12
    cache.reset()
    assert len(cache) == 0
    prompt = random_tokens(2, 7)
    new = new_kv_cache(model, 2)
    torch.testing.assert_close(model(prompt, cache=cache)[0], model(prompt, cache=new)[0], atol=0, rtol=0)
    assert_same_cache(cache, new, 7, model)
    torch.testing.assert_close(model.decode_step(prompt[:, :1], cache), model.decode_step(prompt[:, :1], new), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_size_in_bytes_is_two_layers_batch_max_len_width_itemsize(dtype):
    model = random_model(n_head=4).to(dtype)
    c = model.config
    cache = new_kv_cache(model, 3, max_len=20, dtype=dtype)  # by default bf16 gets float32 on the CPU
    assert cache.dtype == dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert cache.nbytes == 2 * c.n_layer * 3 * 20 * c.n_embd * itemsize


def test_the_cache_is_scratch_space_not_part_of_any_checkpoint():
    model = random_model()
    keys = set(model.state_dict())
    cache = new_kv_cache(model, 2)
    model(random_tokens(2, 4), cache=cache)
    assert cache.state_dict() == {}
    assert set(model.state_dict()) == keys


# --- left-padded rows ------------------------------------------------------------------------------------

def test_a_left_padded_row_gets_the_logits_it_gets_alone_with_and_without_the_cache(attention_path):
    model = random_model()
    lengths = [3, 7, 5]
    prompts = [random_tokens(1, n, seed=n) for n in lengths]
    t = max(lengths)
    batch = torch.full((3, t), VOCAB - 1)  # padding with a real token id: it must be masked, not ignored
    padding = torch.ones(3, t, dtype=torch.bool)
    for b, p in enumerate(prompts):
        batch[b, t - p.size(1):], padding[b, t - p.size(1):] = p[0], False
    cache = new_kv_cache(model, 3)
    cache.reset(padding.sum(dim=1))
    cached, _ = model(batch, cache=cache)
    uncached, _ = model(batch, cache=Uncached(model.config.block_size, padding.sum(dim=1)))
    nxt = random_tokens(3, 1, seed=9)
    step = model.decode_step(nxt, cache)
    for b, p in enumerate(prompts):
        alone, _ = model(p)
        assert_forward_close(cached[b, t - p.size(1):], alone[0], model)
        assert_forward_close(uncached[b, t - p.size(1):], alone[0], model)
        assert_forward_close(step[b], model(torch.cat([p, nxt[b:b + 1]], dim=1))[0][0, -1], model)


# --- which rule runs where ---------------------------------------------------------------------------------

def count_cache_paths(monkeypatch):
    """Count the calls of the ring's masked rule (RingKVCache.attn_mask) and of the plain cache's rule
    (KVCache.begin), which the ring runs eagerly on the CPU while no token has left the window."""
    calls = {"attn_mask": 0, "plain_rule": 0}
    for key, cls, name in (("attn_mask", RingKVCache, "attn_mask"), ("plain_rule", KVCache, "begin")):
        original = getattr(cls, name)

        def counting(self, *args, _key=key, _original=original):
            calls[_key] += 1
            return _original(self, *args)

        monkeypatch.setattr(cls, name, counting)
    return calls


def test_read_all_slots_runs_the_masked_rule_at_every_step_and_gives_the_same_tokens(monkeypatch):
    """The ring's rule (every slot, through attn_mask) runs when asked for, on the CPU too; by default an eager CPU
    step runs the plain cache's rule. Both give the same tokens."""
    model = random_model()
    prompt = random_tokens(2, 5)
    calls = count_cache_paths(monkeypatch)
    default = generate(model, prompt, 20, sampling=GREEDY)
    passes = calls["plain_rule"]  # a prefill, one-token steps and a refill past block_size
    assert passes >= 20 and calls["attn_mask"] == 0
    calls.update(attn_mask=0, plain_rule=0)
    masked = generate(model, prompt, 20, sampling=GREEDY, cache=new_kv_cache(model, 2, read_all_slots=True))
    assert calls == {"attn_mask": passes, "plain_rule": 0}  # the same passes, each through the mask
    assert torch.equal(masked, default)
