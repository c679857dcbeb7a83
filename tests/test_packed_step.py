"""The packed compiled step (sampling/compiled_step.py, packed=True): one model's weights frozen into the step and
laid out for the CPU's matrix kernels. At every step it gives the logits of a full forward, it is kept for those
weights alone, and its attention, written as products and sums (model/decoding/aot_step.py: attention_in_loops),
is torch's SDPA."""

import pytest
import torch
import torch.nn.functional as F

from model import GREEDY, generate
from model.caches.factory import new_kv_cache
from model.caches.ring import Uncached
from model.decoding.aot_step import attention_in_loops
from model.decoding.quantize import to_precision
from runtime.compiled import weights_digest
from sampling.compiled_step import has_compiled_step, load_or_compile_step, packs, step_path
from tiny_models import BLOCK_SIZE, random_model, random_tokens
from tolerance import assert_forward_close, assert_within, attention_bound, attention_reference

ROWS, PROMPT = 2, 5
PAD = torch.tensor([0, 3])  # the second row starts with 3 tokens of left padding


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A rotary model, a cache of two rows, and the packed step compiled for them, kept in a folder of its own."""
    folder = tmp_path_factory.mktemp("steps")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVGPT_CACHE_DIR", str(folder))
        model = random_model(seed=1, pos_emb="rope")
        cache = new_kv_cache(model, ROWS)
        yield model, cache, load_or_compile_step(model, cache, packed=True), folder


def test_each_packed_step_gives_the_logits_of_a_full_forward(packed):
    """3 x block_size one-token steps, past the ring's wrap, with a left-padded row."""
    model, cache, step, _ = packed
    seq = random_tokens(ROWS, PROMPT + 3 * BLOCK_SIZE, seed=2)
    cache.reset(PAD)
    model.decode_step(seq[:, :PROMPT], cache)
    for t in range(PROMPT, seq.size(1)):
        logits = step.decode_step(seq[:, t:t + 1], cache)
        full = model(seq[:, :t + 1], cache=Uncached(model.config.block_size, PAD))[0][:, -1]
        assert_forward_close(logits, full, model, f"step {t}")


def test_greedy_steps_feed_back_the_argmax_of_the_steps_own_logits(packed):
    """greedy_steps picks each row's token inside the compiled code and feeds it back: in runs of 1, 7 and
    2 x block_size steps, past the ring's wrap, with a left-padded row, the tokens are those that decode_step's
    logits pick through a twin of the cache, each fed back in turn."""
    model, cache, step, _ = packed
    prompt = random_tokens(ROWS, PROMPT + 1, seed=5)
    twin = new_kv_cache(model, ROWS)
    for each in (cache, twin):
        each.reset(PAD)
        model.decode_step(prompt[:, :PROMPT], each)
    runs, last = [], prompt[:, PROMPT:]
    for n in (1, 7, 2 * BLOCK_SIZE):
        runs.append(step.greedy_steps(last, cache, n))
        assert runs[-1].shape == (ROWS, n)
        last = runs[-1][:, -1:]
    picked, last = [], prompt[:, PROMPT:]
    for _ in range(1 + 7 + 2 * BLOCK_SIZE):
        last = step.decode_step(last, twin).argmax(-1, keepdim=True)
        picked.append(last)
    assert torch.equal(torch.cat(runs, dim=1), torch.cat(picked, dim=1))


def test_generate_through_the_packed_step_gives_the_eager_text(packed):
    model, cache, step, _ = packed
    prompt = random_tokens(ROWS, PROMPT, seed=3)
    assert torch.equal(generate(model, prompt, 2 * BLOCK_SIZE, sampling=GREEDY, cache=cache, step=step),
                       generate(model, prompt, 2 * BLOCK_SIZE, sampling=GREEDY))


def test_a_packed_step_is_kept_for_its_weights_alone(packed, monkeypatch):
    """Other weights of the same shape have another packed step; the same weights in another model object find
    the kept one; the shared step of the shape is another file."""
    model, cache, _, folder = packed
    monkeypatch.setenv("KVGPT_CACHE_DIR", str(folder))
    assert has_compiled_step(model, cache, packed=True)
    twin = random_model(seed=1, pos_emb="rope")
    assert has_compiled_step(twin, new_kv_cache(twin, ROWS), packed=True)
    other = random_model(seed=7, pos_emb="rope")
    assert not has_compiled_step(other, new_kv_cache(other, ROWS), packed=True)
    with torch.no_grad():
        twin.lm_head.weight[0, 0] += 1e-3  # one weight moved
    assert step_path(twin, cache, packed=True) != step_path(model, cache, packed=True)
    assert step_path(model, cache, packed=True) != step_path(model, cache)


def test_only_float32_weights_are_packed():
    """bf16 and int8 products would round in another order than the eager step's: those models get the shared
    step, whose kernels are the eager step's. Their weights still have a digest (int8 modules keep no state_dict)."""
    assert packs(random_model())
    for precision in ("bf16", "int8"):
        model = to_precision(random_model(), precision)
        assert not packs(model)
        assert weights_digest(model) != weights_digest(to_precision(random_model(seed=5), precision))


@pytest.mark.parametrize("case", ["mask with a row that sees nothing", "float mask", "causal, fewer queries",
                                  "grouped heads", "scale"])
def test_attention_in_loops_is_torchs_sdpa(case):
    """Against F.scaled_dot_product_attention and the formula in float64, within the bound of float32 attention."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    kwargs, allowed = {}, None
    if case == "mask with a row that sees nothing":
        allowed = torch.rand(2, 1, 3, 6) > 0.4
        allowed[0, 0, 1] = False
        kwargs["attn_mask"] = allowed
    elif case == "float mask":
        allowed = torch.rand(2, 1, 3, 6) > 0.4
        allowed[..., 0] = True
        kwargs["attn_mask"] = torch.zeros(2, 1, 3, 6).masked_fill(~allowed, -torch.inf)
    elif case == "causal, fewer queries":
        kwargs["is_causal"] = True
        allowed = torch.ones(3, 6, dtype=torch.bool).tril()  # SDPA's causal mask is aligned top-left
    elif case == "grouped heads":
        k, v = k[:, :2], v[:, :2]
        kwargs["enable_gqa"] = True
    else:
        kwargs["scale"] = 0.3
    got = attention_in_loops(q, k, v, **kwargs)
    assert torch.isfinite(got).all()
    bound, _ = attention_bound(q, k, v, allowed, scale=kwargs.get("scale"))
    assert_within(got, attention_reference(q, k, v, allowed, scale=kwargs.get("scale"))[0], bound, case)
    assert_within(got, F.scaled_dot_product_attention(q, k, v, **kwargs), 2 * bound, case)


def test_a_cache_given_new_tensors_is_stepped_through_them(packed):
    """A compiled step lists a cache's tensors once; a cache converted there and back (Module.to) holds new tensors,
    and the step writes those: an eager step after it reads every key the compiled steps wrote."""
    model, cache, step, _ = packed
    seq = random_tokens(ROWS, PROMPT + 6, seed=4)
    cache.reset()
    model.decode_step(seq[:, :PROMPT], cache)
    step.decode_step(seq[:, PROMPT:PROMPT + 1], cache)
    cache.to(torch.float64).to(torch.float32)
    cache.reset()
    model.decode_step(seq[:, :PROMPT], cache)
    for t in range(PROMPT, PROMPT + 5):
        step.decode_step(seq[:, t:t + 1], cache)
    assert_forward_close(model.decode_step(seq[:, -1:], cache), model(seq)[0][:, -1], model)
