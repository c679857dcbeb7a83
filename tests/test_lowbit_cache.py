"""The 4- and 2-bit KV caches (model/caches/lowbit.py): the packing, what the cache reads against KIVI's
quantization written out here, the byte formula against the tensors, exactness when the full-precision tokens
cover the context, and the settings that cannot work."""

import pytest
import torch

from model import GREEDY, generate
from model.caches.lowbit import LowBitKVCache, lowbit_cache_bytes, new_lowbit_cache, pack, unpack
from tiny_models import random_model, random_tokens
from model.caches.factory import new_kv_cache

@pytest.mark.parametrize("bits", [2, 4])
def test_packing_puts_each_value_in_its_bits_and_unpacking_restores_it(bits):
    q = torch.randint(0, 2**bits, (3, 5, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack(q, bits)
    assert packed.shape == (3, 5, 16 * bits // 8) and packed.dtype == torch.uint8
    per_byte = 8 // bits
    expected = sum(q[..., j::per_byte].int() * 2 ** (bits * j) for j in range(per_byte))  # value j at bit j * bits
    assert torch.equal(packed.int(), expected)
    assert torch.equal(unpack(packed, bits), q)


def kivi(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """x quantized asymmetrically over dim and back: scale and zero (the minimum) rounded to float16 first."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp(min=1e-6).half().float()
    zero = lo.half().float()
    return zero + scale * ((x - zero) / scale).round().clamp(0, 2**bits - 1)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("group, residual", [(4, 4), (4, 8), (8, 8)])
def test_the_cache_reads_old_tokens_quantized_as_kivi_does_and_recent_ones_exactly(bits, group, residual):
    """Keys per channel over groups of `group` tokens, values per token over groups of `group` channels; the last
    `residual` tokens as fed. Fed in chunks of random sizes, past the ring's wrap."""
    B, n_kv, max_len, hs = 2, 2, 16, 8
    cache = LowBitKVCache(1, B, n_kv, max_len, hs, bits=bits, group=group, residual=residual)
    g = torch.Generator().manual_seed(bits * group + residual)
    keys, values = [], []
    while len(keys) < 3 * max_len:
        t = int(torch.randint(1, cache.longest_chunk() + 1, (), generator=g))
        k, v = torch.randn(B, n_kv, t, hs, generator=g), torch.randn(B, n_kv, t, hs, generator=g)
        k[..., 0] *= 8  # one large channel, as keys have
        k_read, v_read = cache.begin(t).layer(0).update(k, v)
        keys += k.unbind(2)
        values += v.unbind(2)
        fed = len(keys)
        for slot in range(k_read.size(2)):
            token = fed - 1 - (fed - 1 - slot) % max_len
            if token >= fed - residual:
                want_k, want_v = keys[token], values[token]
            else:
                first = token // group * group
                want_k = kivi(torch.stack(keys[first:first + group], dim=2), bits, dim=2)[:, :, token - first]
                want_v = kivi(values[token].view(B, n_kv, hs // group if group < hs else 1, -1), bits,
                              dim=-1).view(B, n_kv, hs)
            torch.testing.assert_close(k_read[:, :, slot], want_k, rtol=0, atol=1e-5)
            torch.testing.assert_close(v_read[:, :, slot], want_v, rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides", [{}, dict(n_kv_head=1), dict(kv_share=2), dict(kv_latent=8, bias=False)])
@pytest.mark.parametrize("bits", [2, 4])
def test_the_byte_formula_is_what_the_tensors_hold(overrides, bits):
    model = random_model(**overrides)
    cache = new_lowbit_cache(model, 3, bits, group=8, residual=8)
    assert cache.nbytes == 3 * lowbit_cache_bytes(model.config, bits, group=8, residual=8)


@pytest.mark.parametrize("pos_emb, overrides", [("learned", {}), ("rope", {}), ("rope", dict(kv_share=2, n_layer=4)),
                                                 ("learned", dict(n_kv_head=1, kv_share=2, n_layer=4))])
@pytest.mark.parametrize("bits", [2, 4])
def test_with_every_token_it_sees_in_full_precision_the_cache_is_exact(pos_emb, overrides, bits):
    """residual = block_size: per-step logits equal the float cache's at every step, past 3 x block_size, with
    left padding; the greedy text equals too. With shared layers, the later layers read what the first wrote."""
    model = random_model(pos_emb=pos_emb, **overrides)
    block = model.config.block_size
    prompt, n_pad = random_tokens(3, 7, seed=1), torch.tensor([0, 2, 5])
    float_logits, lowbit_logits = [], []
    for cache, out in ((new_kv_cache(model, 3), float_logits),
                       (new_lowbit_cache(model, 3, bits, group=8, residual=block), lowbit_logits)):
        forcing = Recorder(random_tokens(3, 3 * block, seed=2), out)
        for _ in generate_with(model, prompt, 3 * block, forcing, cache, n_pad):
            pass
    assert len(float_logits) == 3 * block
    for a, b in zip(float_logits, lowbit_logits):
        assert torch.equal(a, b)
    text = generate(model, prompt, 2 * block, sampling=GREEDY, n_pad=n_pad)
    assert torch.equal(generate(model, prompt, 2 * block, sampling=GREEDY, n_pad=n_pad,
                                cache=new_lowbit_cache(model, 3, bits, group=8, residual=block)), text)


class Recorder:
    """A Sampling that feeds given tokens and keeps each step's logits."""

    def __init__(self, targets, out):
        self.targets, self.out = targets, out

    def next_token(self, logits, generator=None):
        self.out.append(logits.clone())
        return self.targets[:, len(self.out) - 1]


def generate_with(model, prompt, n, sampling, cache, n_pad):
    from model.decoding.generate import generate_tokens
    return generate_tokens(model, prompt, n, sampling=sampling, cache=cache, n_pad=n_pad)


@pytest.mark.parametrize("bits, agree", [(4, 0.6), (2, 0.3)])
def test_a_quantized_cache_stays_close_and_serves_a_shared_prompt(bits, agree):
    """With a short residual the cache is lossy: the greedy text agrees with the float cache's while the context
    fits in the exact recent tokens, and often after. Many samples of one prompt are prefilled once, as with the float
    cache, and each row decodes as it would alone."""
    model = random_model(pos_emb="rope")
    block = model.config.block_size
    prompt = random_tokens(1, 6, seed=4)
    plain = generate(model, prompt, 3 * block, sampling=GREEDY)
    lowbit = generate(model, prompt, 3 * block, sampling=GREEDY, cache=new_lowbit_cache(model, 1, bits, group=8,
                                                                                          residual=8))
    assert torch.equal(lowbit[:, :8 + 1], plain[:, :8 + 1])  # predicted while the 8 recent tokens were all
    assert (lowbit == plain).float().mean() >= agree
    shared = generate(model, prompt.expand(3, -1), 3 * block, sampling=GREEDY,
                      cache=new_lowbit_cache(model, 3, bits, group=8, residual=8))
    assert torch.equal(shared, lowbit.expand(3, -1))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(bits=3), "holds 2 or 4 bits per value (8: the int8 cache), got bits=3"),
    (dict(bits=4, group=5), "group must be an integer >= 1 that divides the cache's 16 slots, got 5"),
    (dict(bits=4, group=8, residual=12), "residual must be a multiple of group=8"),
    (dict(bits=4, group=8, residual=32), "from one group to the cache's 16 slots, got 32"),
])
def test_settings_that_cannot_work_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", "\\(").replace(")", "\\)")):
        new_lowbit_cache(random_model(), 1, **kwargs)


def test_a_head_width_its_bytes_cannot_split_is_refused_naming_the_cache_that_can():
    with pytest.raises(ValueError, match=r"^the head width 6 must be a multiple of group=16 \(or below it\) and of 4 "
                                         r"values per byte; the int8 cache takes any width$"):
        new_lowbit_cache(random_model(n_head=4), 1, 2)


def test_rollback_compile_and_local_layers_are_refused():
    model = random_model(pos_emb="rope")
    cache = new_lowbit_cache(model, 1, 4, group=8)
    model.decode_step(random_tokens(1, 5), cache)
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback(2)
    with pytest.raises(ValueError, match="decodes eagerly"):
        generate(model, random_tokens(1, 5), 4, cache=cache, compile=True)
    with pytest.raises(ValueError, match="serves layers that attend everything"):
        new_lowbit_cache(random_model(window_pattern="LG", local_window=4), 1, 4)
