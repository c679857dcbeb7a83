"""GPT without the cache: configuration, shapes and loss, tied head, GPT-2 initialisation, causality,
attention weights, and Sampling.next_token's temperature / top-k / top-p."""

import math

import pytest
import torch
import torch.nn.functional as F

from model import GPT, GPTConfig, Sampling, build_model
from model.measuring.attention_weights import attention_weights, keeping_weights
from tolerance import assert_forward_close


SHAPE = {"vocab_size": 13, "block_size": 16, "n_layer": 2, "n_head": 3, "n_embd": 24}


def tiny_model(seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return build_model(GPTConfig(**{**SHAPE, **overrides})).eval()


# --- configuration ---------------------------------------------------------------------------------------

def test_config_with_width_not_divisible_by_n_head_is_a_value_error_naming_both():
    with pytest.raises(ValueError, match=r"\b10\b.*\b3\b"):
        GPTConfig(**{**SHAPE, "n_embd": 10, "n_head": 3})


@pytest.mark.parametrize("kwargs", [dict(vocab_size=0), dict(block_size=0), dict(n_layer=0), dict(n_head=0),
                                    dict(dropout=1.0), dict(dropout=-0.1)],
                         ids=lambda k: "-".join(f"{a}={v}" for a, v in k.items()))
def test_config_rejects_sizes_below_one_and_dropout_outside_0_1(kwargs):
    with pytest.raises(ValueError):
        GPTConfig(**{**SHAPE, **kwargs})


# --- forward ---------------------------------------------------------------------------------------------

def test_forward_gives_logits_per_position_and_the_mean_cross_entropy():
    model = tiny_model()
    idx = torch.randint(0, 13, (3, 7))
    targets = torch.randint(0, 13, (3, 7))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 7, 13)
    assert model(idx)[1] is None
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 13), targets.reshape(-1)))
    assert abs(loss.item() - math.log(13)) < 0.1  # GPT-2 init: close to uniform predictions


def test_lm_head_is_tied_to_the_token_embedding():
    model = tiny_model()
    assert model.lm_head.weight is model.wte.weight
    assert model.num_params() == sum(p.numel() for p in model.parameters())  # counted once


def test_gpt2_initialisation_scales_residual_projections_by_depth():
    model = tiny_model(n_layer=4, n_embd=48, n_head=4)
    residual = 0.02 / math.sqrt(2 * 4)
    for block in model.blocks:
        for proj, std in ((block.attn.out_proj, residual), (block.mlp.proj, residual),
                          (block.attn.qkv, 0.02), (block.mlp.fc, 0.02)):
            assert abs(proj.weight.std().item() - std) < 0.1 * std
            assert (proj.bias == 0).all()
    assert abs(model.wte.weight.std().item() - 0.02) < 0.002
    assert abs(model.wpe.weight.std().item() - 0.02) < 0.002


def test_changing_token_j_never_changes_logits_at_earlier_positions():
    model = tiny_model()
    idx = torch.randint(0, 13, (2, 10))
    logits, _ = model(idx)
    for j in (0, 4, 9):
        changed = idx.clone()
        changed[:, j] = (changed[:, j] + 1) % 13
        changed_logits, _ = model(changed)
        # the same shapes and kernels on the same host, and no earlier position reads token j: to the bit
        assert torch.equal(changed_logits[:, :j], logits[:, :j])
        assert not torch.allclose(changed_logits[:, j], logits[:, j])


def test_attention_weights_are_causal_rows_summing_to_one_per_layer():
    model = tiny_model()
    weights = attention_weights(model, torch.randint(0, 13, (2, 6)))
    assert len(weights) == 2
    for w in weights:
        assert w.shape == (2, 3, 6, 6)
        torch.testing.assert_close(w.sum(dim=-1), torch.ones(2, 3, 6))
        assert (w.triu(diagonal=1) == 0).all()


@pytest.mark.parametrize("design", [{}, {"n_kv_head": 1, "pos_emb": "rope"}, {"kv_share": 2}], ids=["mha", "mqa-rope", "shared"])
def test_the_weights_path_gives_the_same_logits(design):
    """attention_weights runs the explicit path: its logits must be those of the SDPA forward."""
    model = tiny_model(**design)
    idx = torch.randint(0, 13, (2, 6))
    with keeping_weights(model) as weights:
        explicit = model(idx)[0]
    assert len(weights) == 2
    assert_forward_close(explicit, model(idx)[0], model)  # two kernels, two summation orders


# --- Sampling.next_token -----------------------------------------------------------------------------------------

PROBS = torch.tensor([0.10, 0.50, 0.15, 0.25])  # best to worst: 1, 3, 2, 0


def sampled_set(n=4000, seed=0, **kwargs):
    """The tokens Sampling.next_token draws from PROBS over n rows, and how often each (a dict)."""
    logits = PROBS.log().expand(n, -1)
    ids = Sampling(**kwargs).next_token(logits, generator=torch.Generator().manual_seed(seed))
    counts = torch.bincount(ids, minlength=4) / n
    return {i for i in range(4) if counts[i] > 0}, counts


def assert_frequencies(counts, expected, n=4000):
    """Each token's frequency in n draws within 4.5 standard deviations, sqrt(p (1 - p) / n), of its probability p
    (about 0.035 at p = 0.5, n = 4000): a seeded draw that lies further out has a chance under 1e-5, whereas a wrong
    distribution (a token kept or dropped, a temperature not applied) moves some frequency by 0.05 or more."""
    bound = 4.5 * (expected * (1 - expected) / n).sqrt()
    assert ((counts - expected).abs() <= bound).all(), f"frequencies {counts.tolist()}, expected {expected.tolist()}"


def test_temperature_zero_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert Sampling(temperature=0).next_token(logits).tolist() == [1, 0]


@pytest.mark.parametrize("top_k, kept", [(1, {1}), (2, {1, 3}), (3, {1, 3, 2}), (4, {0, 1, 2, 3}),
                                         (10, {0, 1, 2, 3})])
def test_top_k_keeps_exactly_the_k_likeliest_tokens(top_k, kept):
    tokens, counts = sampled_set(top_k=top_k)
    assert tokens == kept
    expected = torch.zeros(4)
    expected[list(kept)] = PROBS[list(kept)] / PROBS[list(kept)].sum()  # renormalised over the kept ones
    assert_frequencies(counts, expected)


@pytest.mark.parametrize("top_p, kept", [(0.01, {1}), (0.45, {1}), (0.7, {1, 3}), (0.8, {1, 3, 2}),
                                         (0.95, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_fewest_likeliest_tokens_reaching_p(top_p, kept):
    tokens, counts = sampled_set(top_p=top_p)
    assert tokens == kept
    expected = torch.zeros(4)
    expected[list(kept)] = PROBS[list(kept)] / PROBS[list(kept)].sum()
    assert_frequencies(counts, expected)


def test_top_k_and_top_p_combine():
    assert sampled_set(top_k=3, top_p=0.7)[0] == {1, 3}
    assert sampled_set(top_k=2, top_p=0.95)[0] == {1, 3}


def test_temperature_sharpens_and_flattens_the_distribution():
    _, cold = sampled_set(temperature=0.5)
    _, hot = sampled_set(temperature=2.0)
    sharpened = PROBS ** 2 / (PROBS ** 2).sum()
    flattened = PROBS.sqrt() / PROBS.sqrt().sum()
    assert_frequencies(cold, sharpened)
    assert_frequencies(hot, flattened)


LOGITS = torch.tensor([1.2, -0.3, 0.4, 2.0, 0.0, 1.5, -1.0, 0.9])


def kept_distribution(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution after temperature, top-k and top-p, written out token by token, likeliest first."""
    weights = [math.exp(x / temperature) for x in LOGITS.tolist()]
    order = sorted(range(len(weights)), key=lambda i: -weights[i])[:top_k]
    total, kept, mass = sum(weights[i] for i in order), [], 0.0
    for i in order:  # the fewest likeliest tokens whose probabilities, among the top k, reach top_p
        kept.append(i)
        mass += weights[i] / total
        if mass >= top_p:
            break
    probs = torch.zeros(len(weights), dtype=torch.double)
    probs[kept] = torch.tensor([weights[i] for i in kept], dtype=torch.double)
    return probs / probs.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 8, 1.0), (0.8, 6, 0.9), (1.5, 4, 0.7)])
def test_the_sampler_draws_each_token_with_its_probability(temperature, top_k, top_p):
    """Pearson's chi-square over 40,000 draws against the distribution written out (p > 0.001)."""
    from test_speculative import SIGNIFICANCE, chi_square_p_value
    ids = Sampling(temperature=temperature, top_k=top_k, top_p=top_p).next_token(
        LOGITS.expand(40_000, -1), generator=torch.Generator().manual_seed(5))
    counts = torch.bincount(ids, minlength=len(LOGITS))
    assert chi_square_p_value(counts, kept_distribution(temperature, top_k, top_p)) > SIGNIFICANCE


def test_a_seeded_generator_makes_sampling_reproducible():
    first = sampled_set(seed=3)[1]
    assert torch.equal(sampled_set(seed=3)[1], first)
    assert not torch.equal(sampled_set(seed=4)[1], first)
