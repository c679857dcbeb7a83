"""Rotary positions, and the KV cache that rolls past block_size with them.

RoPE is checked against the rotation written out with complex numbers. The rolling cache is checked against a
full forward over the last block_size tokens at every step, for 3 x block_size new tokens: the context slides one
token per step, the cache feeds one token per step, and nothing is ever prefilled twice.
"""

import math

import pytest
import torch

from model import GREEDY, RingKVCache, generate
from model.attention import rotary, rotate
from tiny_models import BLOCK_SIZE, VOCAB, random_model, random_tokens, train_briefly
from tolerance import assert_forward_close, assert_within, gamma
from model.caches.factory import new_kv_cache

N_NEW = 3 * BLOCK_SIZE
# head widths 24, 8 and 6: every one even, as rope needs; 24 wide is not a power of two
CONFIGS = {
    "1head-bias": dict(n_head=1, bias=True),
    "3heads-no_bias": dict(n_head=3, bias=False),
    "4heads-bias-dropout0.2": dict(n_head=4, bias=True, dropout=0.2),  # dropout 0.2, used in eval mode
}


def rope_model(seed=0, **overrides):
    return random_model(seed, pos_emb="rope", **overrides)


# --- RoPE itself -----------------------------------------------------------------------------------------

def test_rotary_turns_each_channel_pair_by_position_times_its_frequency():
    """Channel i and i + d/2 form the complex number x_i + j x_{i+d/2}; position p multiplies it by
    exp(j p 10000^(-2i/d)). Written here with Python's own math and complex arithmetic."""
    d, positions = 8, [0, 1, 5, 1000, 123_456]
    x = torch.randn(1, 1, len(positions), d, generator=torch.Generator().manual_seed(0))
    got = rotate(x, *rotary(torch.tensor(positions), d))
    for t, p in enumerate(positions):
        for i in range(d // 2):
            a, b = x[0, 0, t, i].item(), x[0, 0, t, i + d // 2].item()
            turn = complex(math.cos(p * 10000 ** (-2 * i / d)), math.sin(p * 10000 ** (-2 * i / d)))
            z = complex(a, b) * turn
            # float32 cos and sin, two products and a sum: 3 roundings of |a| + |b|; float64's angle: 1e-16 of p
            bound = gamma(3) * (abs(a) + abs(b)) + 1e-15 * p * (abs(a) + abs(b))
            assert got[0, 0, t, i].item() == pytest.approx(z.real, rel=0, abs=bound)
            assert got[0, 0, t, i + d // 2].item() == pytest.approx(z.imag, rel=0, abs=bound)


def test_rotated_scores_depend_only_on_the_distance_between_query_and_key():
    d = 16
    q, k = torch.randn(2, 1, 1, d), torch.randn(2, 1, 1, d)

    def score(p_q, p_k):
        return (rotate(q, *rotary(torch.tensor([p_q]), d)) * rotate(k, *rotary(torch.tensor([p_k]), d))).sum(-1)

    # equal in exact arithmetic; each rotated channel is within gamma(3) of |x_i| + |x_(i+d/2)| (r), a score within
    # gamma(d + 6) of sum r_q r_k, and float64's angles within 1e-16 of 1e5: two scores apart by at most twice that
    r_q, r_k = (t.abs() + t.abs().roll(d // 2, -1) for t in (q, k))
    bound = 2 * (gamma(d + 6) + 1e-15 * 100_009) * (r_q * r_k).double().sum(-1)
    assert_within(score(9, 4), score(100_009, 100_004), bound)
    assert not torch.allclose(score(9, 4), score(9, 5), atol=1e-3)  # the distance does matter


def test_per_row_positions_turn_each_row_by_its_own_angles():
    d, x = 8, torch.randn(2, 3, 4, 8)
    per_row = rotate(x, *rotary(torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]]), d))
    # each within gamma(3) (x_i cos - x_j sin: cos or sin rounded, a product, the sum) of the exact turn
    bound = 2 * gamma(3) * (x.abs() + x.abs().roll(d // 2, -1))[1:]
    assert_within(per_row[1:], rotate(x[1:], *rotary(torch.arange(5, 9), d)), bound)


def test_a_rope_model_has_no_position_table_and_its_output_depends_on_order():
    model = rope_model()
    assert model.wpe is None and "wpe.weight" not in model.state_dict()
    tokens = random_tokens(1, 8)
    assert not torch.allclose(model(tokens)[0][:, -1], model(tokens.flip(1))[0][:, -1], atol=1e-3)


def test_rope_needs_an_even_head_width():
    with pytest.raises(ValueError, match="even"):
        rope_model(n_embd=15, n_head=5)


# --- the rolling cache equals a full forward over the sliding window -------------------------------------

@pytest.fixture(params=["filled slots", "all slots, masked"])
def attention_path(request, monkeypatch):
    """Both ways a cached forward attends: the filled slots only (eager, on the CPU), and all max_len slots
    through the cache's mask (static shapes: what a compiled step and the GPU run), forced here."""
    if request.param == "all slots, masked":
        monkeypatch.setattr(RingKVCache, "static_shapes", property(lambda self: True))
    yield request.param


def assert_rolling_steps_match_sliding_window_attention(model, prompt, n_new=N_NEW):
    """Prefill the prompt (its first block_size tokens in one chunk, the rest one at a time), then feed one greedy
    token per step for n_new steps. At every step the cached logits equal those of a full forward over the whole
    sequence in which each layer attends its last block_size tokens (written out here as a banded mask)."""
    cache = new_kv_cache(model, prompt.size(0))
    last = model.decode_step(prompt[:, :BLOCK_SIZE], cache)
    for t in range(BLOCK_SIZE, prompt.size(1)):
        last = model.decode_step(prompt[:, t:t + 1], cache)
    seq = prompt
    for step in range(n_new):
        assert_forward_close(last, sliding_window_forward(model, seq)[:, -1], model)
        new = last.argmax(dim=-1, keepdim=True)  # (B, 1)
        seq = torch.cat([seq, new], dim=1)
        last = model.decode_step(new, cache)
    assert len(cache) == prompt.size(1) + n_new  # one token per step, nothing fed twice


def sliding_window_forward(model, seq):
    """Logits of a forward over all of seq where query i attends keys i - block_size < j <= i: the mask is built
    here from indices and handed to every block, bypassing the model's own choice of mask."""
    t = seq.size(1)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    band = (j <= i) & (j > i - BLOCK_SIZE)
    x = model.wte(seq)
    rope = rotary(torch.arange(t), model.config.n_embd // model.config.n_head)
    for block in model.blocks:
        x = block(x, band, rope)
    return model.lm_head(model.ln_f(x))


@pytest.mark.parametrize("prompt_len", [1, 7, BLOCK_SIZE, BLOCK_SIZE + 5])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("config_name", CONFIGS)
def test_rolling_cache_logits_equal_the_sliding_window_at_every_step(config_name, batch, prompt_len, attention_path):
    model = rope_model(**CONFIGS[config_name])
    assert_rolling_steps_match_sliding_window_attention(model, random_tokens(batch, prompt_len))


def test_rolling_cache_logits_equal_the_sliding_window_on_a_trained_model():
    torch.manual_seed(0)
    model = rope_model()
    text = random_tokens(11, seed=123).repeat(40)
    losses = train_briefly(model, text, steps=30, batch_size=8)
    assert losses[-1] < 0.6 * losses[0]
    assert_rolling_steps_match_sliding_window_attention(model.eval(), text[None, :9].repeat(2, 1))


def test_the_model_own_forward_past_block_size_is_the_same_sliding_window_attention():
    model = rope_model()
    seq = random_tokens(2, 3 * BLOCK_SIZE)
    assert_forward_close(model(seq)[0], sliding_window_forward(model, seq), model)


def test_the_band_is_not_vacuous_the_earlier_layers_carry_context_from_beyond_the_last_block_size_tokens():
    """The control: the last block_size tokens alone (the classic crop) give other logits than the rolling cache,
    because each cached key was computed while its own token still saw block_size tokens back."""
    model = rope_model()
    seq = random_tokens(1, BLOCK_SIZE + 6)
    cache = new_kv_cache(model, 1)
    model.decode_step(seq[:, :BLOCK_SIZE], cache)
    for t in range(BLOCK_SIZE, seq.size(1)):
        last = model.decode_step(seq[:, t:t + 1], cache)
    assert_forward_close(last, sliding_window_forward(model, seq)[:, -1], model)
    assert not torch.allclose(last, model(seq[:, -BLOCK_SIZE:])[0][:, -1], atol=1e-3)


def test_left_padded_rows_roll_as_they_would_alone(attention_path):
    """Rows of 3, 7 and 5 prompt tokens, left-padded into one batch, each decode 3 x block_size tokens: at every
    step each row's logits equal the sliding-window forward over that row alone, padding never seen."""
    model = rope_model()
    prompts = [random_tokens(n, seed=n) for n in (3, 7, 5)]
    t = max(p.size(0) for p in prompts)
    batch = torch.full((3, t), VOCAB - 1)  # padding with a real token id: it must be masked, not ignored
    for b, p in enumerate(prompts):
        batch[b, t - p.size(0):] = p
    cache = new_kv_cache(model, 3)
    cache.reset(torch.tensor([t - p.size(0) for p in prompts]))
    last = model.decode_step(batch, cache)
    rows = prompts
    for step in range(N_NEW):
        for b, row in enumerate(rows):
            assert_forward_close(last[b], sliding_window_forward(model, row[None])[0, -1], model)
        new = last.argmax(dim=-1)
        rows = [torch.cat([row, new[b:b + 1]]) for b, row in enumerate(rows)]
        last = model.decode_step(new[:, None], cache)


def test_a_chunk_that_would_wrap_the_ring_is_refused():
    model = rope_model()
    cache = new_kv_cache(model, 1)
    model.decode_step(random_tokens(1, BLOCK_SIZE - 2), cache)
    with pytest.raises(ValueError, match="one token at a time"):
        model.decode_step(random_tokens(1, 3), cache)


# --- generation ------------------------------------------------------------------------------------------

def count_tokens_into_blocks(model):
    shapes = []
    handle = model.blocks[0].register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape[:2])))
    return shapes, handle


@pytest.mark.parametrize("prompt_len", [4, BLOCK_SIZE + 4])
def test_past_block_size_each_step_feeds_one_token_and_nothing_is_prefilled_again(prompt_len):
    model = rope_model()
    shapes, handle = count_tokens_into_blocks(model)
    try:
        generate(model, random_tokens(2, prompt_len), N_NEW, sampling=GREEDY)
    finally:
        handle.remove()
    # the ring's worth of prompt in one chunk, the rest of the prompt a token at a time, then a token per step
    prompt_rest = max(prompt_len - BLOCK_SIZE, 0)
    assert shapes == [(2, min(prompt_len, BLOCK_SIZE))] + [(2, 1)] * (prompt_rest + N_NEW - 1)


@pytest.mark.parametrize("prompt_len", [5, BLOCK_SIZE + 4])
def test_greedy_generation_with_the_rolling_cache_equals_without_it(prompt_len):
    model = rope_model()
    prompt = random_tokens(2, prompt_len)
    cached = generate(model, prompt, N_NEW, sampling=GREEDY)
    assert torch.equal(cached, generate(model, prompt, N_NEW, sampling=GREEDY, use_cache=False))
    assert torch.equal(cached, generate(model, prompt, N_NEW, sampling=GREEDY, keep=BLOCK_SIZE))


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no_cache"])
def test_ragged_batch_rows_equal_each_prompt_generated_alone(use_cache):
    model = rope_model()
    prompts = [random_tokens(1, n, seed=n) for n in (3, 7, 5)]
    t = max(p.size(1) for p in prompts)
    batch = torch.full((3, t), VOCAB - 1)
    for b, p in enumerate(prompts):
        batch[b, t - p.size(1):] = p[0]
    out = generate(model, batch, N_NEW, sampling=GREEDY, n_pad=[t - p.size(1) for p in prompts], use_cache=use_cache)
    for b, p in enumerate(prompts):
        alone = generate(model, p, N_NEW, sampling=GREEDY, use_cache=use_cache)
        assert torch.equal(out[b, t:], alone[0, p.size(1):]), f"row {b}"


def test_a_window_smaller_than_block_size_is_refused_for_a_rolling_model():
    with pytest.raises(ValueError, match="keep applies to learned positions"):
        generate(rope_model(), random_tokens(1, 3), 2, keep=BLOCK_SIZE // 2)


def test_compiled_rolling_step_equals_eager_past_block_size():
    model = rope_model()
    prompt = random_tokens(2, 5)
    torch._dynamo.reset()
    compiled = generate(model, prompt, N_NEW, sampling=GREEDY, compile=True)
    assert torch.equal(compiled, generate(model, prompt, N_NEW, sampling=GREEDY))
