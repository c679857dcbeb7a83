"""Generation through the KV cache equals generation without it, token for token, also past block_size
(where the cache is rebuilt over the last `window` tokens), for ragged batches and for seeded sampling."""

import re

import pytest
import torch

from model import GPT, GREEDY, RingKVCache, Sampling, generate, greedy_decode
from model.gpt import POSITIONS
from tiny_models import BLOCK_SIZE, VOCAB, random_model, random_tokens
from tolerance import assert_forward_close
from model.caches.factory import new_kv_cache


N_NEW = 40  # 2.5 x block_size: jumps past block_size more than once


@pytest.fixture(scope="module")
def model():
    return random_model()


def test_generate_returns_the_prompt_followed_by_the_new_tokens(model):
    prompt = random_tokens(2, 5)
    out = generate(model, prompt, 7, sampling=GREEDY)
    assert out.shape == (2, 12) and out.dtype == prompt.dtype
    assert torch.equal(out[:, :5], prompt)
    assert torch.equal(generate(model, prompt, 0), prompt)


@pytest.mark.parametrize("keep", [None, BLOCK_SIZE, 3], ids=["default_keep", "keep=block_size", "keep=3"])
@pytest.mark.parametrize("prompt_len", [5, BLOCK_SIZE + 4])
def test_greedy_generation_with_cache_equals_without_token_for_token(model, keep, prompt_len):
    prompt = random_tokens(2, prompt_len)
    cached = generate(model, prompt, N_NEW, sampling=GREEDY, keep=keep)
    uncached = generate(model, prompt, N_NEW, sampling=GREEDY, keep=keep, use_cache=False)
    assert torch.equal(cached, uncached)


def crop_and_recompute(model, prompt, n_new):
    """The classic loop: each step, a full forward over the last block_size tokens. (tokens, logits)."""
    seq, logits = prompt, []
    for _ in range(n_new):
        last = model(seq[:, -model.config.block_size:])[0][:, -1]
        logits.append(last)
        seq = torch.cat([seq, last.argmax(dim=-1, keepdim=True)], dim=1)
    return seq, logits


def test_window_block_size_equals_crop_and_recompute_at_every_step(model, monkeypatch):
    prompt = random_tokens(2, 5)
    expected, expected_logits = crop_and_recompute(model, prompt, N_NEW)
    step_logits = []  # what every step of the cached generation computed

    def recording_step(idx, cache):
        step_logits.append(GPT.decode_step(model, idx, cache))
        return step_logits[-1]

    monkeypatch.setattr(model, "decode_step", recording_step)
    cached = generate(model, prompt, N_NEW, sampling=GREEDY, keep=BLOCK_SIZE)
    monkeypatch.undo()
    assert torch.equal(cached, expected)
    assert len(step_logits) == N_NEW
    for got, want in zip(step_logits, expected_logits):
        assert_forward_close(got, want, model)
    assert torch.equal(generate(model, prompt, N_NEW, sampling=GREEDY, keep=BLOCK_SIZE, use_cache=False), expected)


def test_a_smaller_window_does_see_less_context_than_crop_and_recompute(model):
    """The control for the test above: keep does matter, so its equality there is not vacuous."""
    prompt = random_tokens(2, 5)
    expected, _ = crop_and_recompute(model, prompt, N_NEW)
    assert not torch.equal(generate(model, prompt, N_NEW, sampling=GREEDY, keep=3), expected)


def test_a_cache_passed_in_is_reset_and_reused(model):
    prompt = random_tokens(2, 5)
    cache = new_kv_cache(model, 2)
    first = generate(model, prompt, 20, sampling=GREEDY, cache=cache)
    assert len(cache) > 0
    assert torch.equal(generate(model, prompt, 20, sampling=GREEDY, cache=cache), first)
    assert torch.equal(generate(model, prompt, 20, sampling=GREEDY), first)


# --- ragged batches --------------------------------------------------------------------------------------

def left_pad(prompts, pad_id):
    """Prompts (1, T_b) -> (batch (B, T), padding_mask (B, T), True at the left padding)."""
    t = max(p.size(1) for p in prompts)
    batch = torch.full((len(prompts), t), pad_id)
    padding = torch.ones(len(prompts), t, dtype=torch.bool)
    for b, p in enumerate(prompts):
        batch[b, t - p.size(1):], padding[b, t - p.size(1):] = p[0], False
    return batch, padding


@pytest.mark.parametrize("keep", [None, BLOCK_SIZE, 5], ids=["default_keep", "keep=block_size", "keep=5"])
@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no_cache"])
def test_ragged_batch_rows_equal_each_prompt_generated_alone(model, keep, use_cache):
    """Prompts of lengths 3, 7, 5 left-padded into one batch; N_NEW > block_size, so every row's context
    passes block_size and is rebuilt over its last `window` tokens, as it would be alone."""
    prompts = [random_tokens(1, n, seed=n) for n in (3, 7, 5)]
    batch, padding = left_pad(prompts, pad_id=VOCAB - 1)  # a real token id: it must be masked, not ignored
    out = generate(model, batch, N_NEW, sampling=GREEDY, keep=keep, n_pad=padding.sum(dim=1), use_cache=use_cache)
    for b, p in enumerate(prompts):
        alone = generate(model, p, N_NEW, sampling=GREEDY, keep=keep, use_cache=use_cache)
        assert torch.equal(out[b, batch.size(1):], alone[0, p.size(1):]), f"row {b} (prompt length {p.size(1)})"


def test_n_pad_must_leave_each_row_a_token(model):
    prompt = random_tokens(2, 4)
    assert generate(model, prompt, 2, sampling=GREEDY, n_pad=[2, 0]).shape == (2, 6)
    for bad in ([4, 0], [-1, 0], [1]):
        with pytest.raises(ValueError, match="n_pad"):
            generate(model, prompt, 2, sampling=GREEDY, n_pad=bad)


# --- sampling --------------------------------------------------------------------------------------------

SAMPLING = [dict(temperature=0.8), dict(temperature=0.8, top_k=4), dict(temperature=0.8, top_p=0.7),
            dict(temperature=1.0, top_k=6, top_p=0.9)]


@pytest.mark.parametrize("sampling", SAMPLING, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("pos_emb", POSITIONS)
def test_seeded_sampling_is_reproducible_and_equal_with_and_without_cache(pos_emb, sampling):
    """Past block_size too: the learned model's cache is refilled, the rotary model's rolls."""
    model = random_model(pos_emb=pos_emb)
    prompt = random_tokens(2, 5)

    def sample(seed, use_cache):
        return generate(model, prompt, N_NEW, use_cache=use_cache, generator=torch.Generator().manual_seed(seed),
                        sampling=Sampling(**sampling))

    first = sample(0, use_cache=True)
    assert torch.equal(sample(0, use_cache=True), first)
    assert torch.equal(sample(0, use_cache=False), first)
    assert not torch.equal(sample(1, use_cache=True), first)  # the seed does matter


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(temperature=0, top_k=3), dict(temperature=0, top_p=0.5),
                                    dict(keep=0), dict(keep=BLOCK_SIZE + 1)],
                         ids=lambda k: "-".join(f"{a}={v}" for a, v in k.items()))
def test_invalid_sampling_or_window_arguments_are_value_errors(model, kwargs):
    with pytest.raises(ValueError):
        keep = kwargs.pop("keep", None)
        generate(model, random_tokens(1, 3), 2, sampling=Sampling(**kwargs), keep=keep)


@pytest.mark.parametrize("kwargs", [dict(use_cache=False, compile=True), dict(use_cache=False, cache="cache"),
                                    dict(cache="cache of 3 rows")], ids=lambda k: "-".join(k))
def test_options_that_cannot_apply_are_refused(model, kwargs):
    if "cache" in kwargs:
        kwargs["cache"] = new_kv_cache(model, 3 if "3 rows" in kwargs["cache"] else 2)
    with pytest.raises(ValueError, match="cache"):
        generate(model, random_tokens(2, 3), 2, **kwargs)


# --- torch.compile ---------------------------------------------------------------------------------------

def test_compiled_one_token_step_equals_eager_greedy_generation(model):
    prompt = random_tokens(2, 5)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = generate(model, prompt, N_NEW, sampling=GREEDY, compile=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the step did go through the compiler
    assert torch.equal(compiled, generate(model, prompt, N_NEW, sampling=GREEDY))


def test_a_compiled_step_is_compiled_once_for_generations_of_other_lengths(model):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for prompt_len, n_new in ((5, N_NEW), (3, N_NEW + 7), (9, 4)):
        generate(model, random_tokens(2, prompt_len), n_new, sampling=GREEDY, compile=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


# --- arguments that cannot work are a ValueError naming them -----------------------------------------------

def bad_generate_call(model, case):
    """A call to generate with one argument that cannot work; returns the name the error must carry."""
    prompt = random_tokens(2, 3)
    calls = {
        "max_new_tokens=True": (lambda: generate(model, prompt, True), "max_new_tokens"),
        "keep=True": (lambda: generate(model, prompt, 2, keep=True), "keep"),
        "top_k=True": (lambda: generate(model, prompt, 2, sampling=Sampling(top_k=True)), "top_k"),
        "temperature=True": (lambda: generate(model, prompt, 2, sampling=Sampling(temperature=True)), "temperature"),
        "n_pad=[True, 0]": (lambda: generate(model, prompt, 2, n_pad=[True, 0]), "n_pad"),
        "id >= vocab_size": (lambda: generate(model, torch.full((2, 3), VOCAB), 2), "vocabulary"),
        "negative id": (lambda: generate(model, -prompt - 1, 2), "vocabulary"),
        "cache of another shape": (lambda: generate(model, prompt, 2, cache=new_kv_cache(random_model(n_layer=3), 2)),
                                   "another model shape"),
        "cache of int64": (lambda: generate(model, prompt, 2, cache=RingKVCache(2, 2, 3, BLOCK_SIZE, 8, dtype=torch.long,
                                                                             reach=BLOCK_SIZE)), "int64"),
        "cache of another kind": (lambda: generate(model, prompt, 2, cache=object()), "model/protocol.py: Cache"),
    }
    return calls[case]


@pytest.mark.parametrize("case", ["max_new_tokens=True", "keep=True", "top_k=True", "temperature=True",
                                  "n_pad=[True, 0]", "id >= vocab_size", "negative id", "cache of another shape",
                                  "cache of int64", "cache of another kind"])
def test_arguments_that_cannot_work_are_value_errors_naming_them(model, case):
    call, name = bad_generate_call(model, case)
    with pytest.raises(ValueError, match=re.escape(name)):
        call()


def test_a_model_in_training_mode_is_refused_rather_than_decoded_with_dropout():
    model = random_model(dropout=0.2).train()
    with pytest.raises(ValueError, match=r"training mode.*model\.eval\(\)"):
        generate(model, random_tokens(1, 3), 2)
    assert generate(model.eval(), random_tokens(1, 3), 2).shape == (1, 5)


@pytest.mark.parametrize("pos_emb", POSITIONS)
def test_block_size_1_generates_what_recomputation_does(pos_emb):
    """The smallest context: each token sees only itself (rope: heads of 2 channels), and the default keep holds
    one token, so every step's logits come from the newest token, never from the step before."""
    model = random_model(block_size=1, n_head=2, n_embd=4 if pos_emb == "rope" else 24, pos_emb=pos_emb)
    prompt = random_tokens(2, 3)
    cached = generate(model, prompt, 12, sampling=GREEDY)
    assert torch.equal(cached, generate(model, prompt, 12, sampling=GREEDY, use_cache=False))
    for t in range(3, cached.size(1)):  # each token is the argmax of a forward over the one before it
        assert torch.equal(cached[:, t], model(cached[:, t - 1:t])[0][:, -1].argmax(-1))


# --- the idea in ten lines ------------------------------------------------------------------------------------

@pytest.mark.parametrize("pos_emb", POSITIONS)
def test_greedy_decode_the_ten_line_loop_equals_a_full_forward_at_every_step(pos_emb):
    model = random_model(pos_emb=pos_emb)
    prompt = random_tokens(3, 5)
    out = greedy_decode(model, prompt, BLOCK_SIZE - 5)
    for t in range(5, BLOCK_SIZE):  # each new token is the argmax of a full forward over everything before it
        assert torch.equal(out[:, t], model(out[:, :t])[0][:, -1].argmax(-1))
    assert torch.equal(out, generate(model, prompt, BLOCK_SIZE - 5, sampling=GREEDY))
    with pytest.raises(ValueError, match="block_size"):
        greedy_decode(model, prompt, BLOCK_SIZE)
