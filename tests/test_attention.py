"""MultiHeadAttention and causal_mask: equal to torch.nn.MultiheadAttention and to a per-head reference,
both paths (SDPA and explicit) equal, masks, widths, dropout and gradients.

Mask conventions under test: attn_mask / causal_mask True = may attend; key_padding_mask True = padding.
"""

import math
import re

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

from model import MultiHeadAttention, causal_mask
from tolerance import assert_within, attention_bound, gamma, mha_bound


B, T, E, N_HEAD = 2, 5, 12, 3
PATHS = pytest.param(False, id="sdpa"), pytest.param(True, id="explicit")  # the need_weights flag
# right padding, so that with a causal mask every query still sees key 0 (nn.MultiheadAttention gives NaN
# on a row with every key masked; ours gives zeros, tested on its own below)
KEY_PADDING = torch.tensor([[False, False, False, True, True],
                            [False, False, False, False, False]])


def make_mha(*args, seed=0, **kwargs) -> MultiHeadAttention:
    torch.manual_seed(seed)
    mha = MultiHeadAttention(*args, **kwargs).eval()
    if mha.qkv.bias is not None:  # nn.Linear's default biases are random already; make sure
        nn.init.normal_(mha.qkv.bias)
    return mha


def torch_mha_like(ours: MultiHeadAttention) -> nn.MultiheadAttention:
    """nn.MultiheadAttention (batch_first) holding our weights: in_proj rows are Q, K, V like our .qkv."""
    embed_dim, bias = ours.qkv.in_features, ours.qkv.bias is not None
    ref = nn.MultiheadAttention(embed_dim, ours.n_head, bias=bias, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv.weight)
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        if bias:
            ref.in_proj_bias.copy_(ours.qkv.bias)
            ref.out_proj.bias.copy_(ours.out_proj.bias)
    return ref.eval()


def reference_attention(mha: MultiHeadAttention, x, context=None, allowed=None):
    """Textbook attention, one head at a time, straight from the weights.

    allowed: bool broadcastable to (B, n_head, T_q, T_k), True = may attend. Returns (out, weights).
    """
    context = x if context is None else context
    w, b = mha.qkv.weight, mha.qkv.bias
    b = torch.zeros(w.size(0), dtype=w.dtype) if b is None else b
    qk, nh = mha.qk_dim, mha.n_head
    q = x @ w[:qk].T + b[:qk]
    k = context @ w[qk:2 * qk].T + b[qk:2 * qk]
    v = context @ w[2 * qk:].T + b[2 * qk:]
    dq, dv = qk // nh, mha.v_dim // nh
    heads, weights = [], []
    for h in range(nh):
        scores = q[..., h * dq:(h + 1) * dq] @ k[..., h * dq:(h + 1) * dq].transpose(-2, -1) / math.sqrt(dq)
        if allowed is not None:
            scores = scores.masked_fill(~allowed.expand(x.size(0), nh, -1, -1)[:, h], float("-inf"))
        p = scores.softmax(dim=-1)
        weights.append(p)
        heads.append(p @ v[..., h * dv:(h + 1) * dv])
    return mha.out_proj(torch.cat(heads, dim=-1)), torch.stack(weights, dim=1)


def allowed_by(t_q, t_k, causal=False, padding=None):
    """The (B or 1, 1, t_q, t_k) mask that is_causal and a key_padding_mask amount to, True = may attend."""
    allowed = causal_mask(t_q, t_k) if causal else torch.ones(t_q, t_k, dtype=torch.bool)
    return allowed[None, None] if padding is None else allowed & ~padding[:, None, None, :]


def test_causal_mask_is_lower_triangular_and_aligned_bottom_right():
    assert torch.equal(causal_mask(3, 3), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    # two new queries after three earlier keys: the last query sees every key
    assert torch.equal(causal_mask(2, 5), torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))
    assert torch.equal(causal_mask(1, 4), torch.ones(1, 4, dtype=torch.bool))


# --- equal to torch.nn.MultiheadAttention ---------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("masks", ["none", "causal", "padding", "causal+padding"])
@pytest.mark.parametrize("need_weights", PATHS)
def test_self_attention_equals_torch_multihead_attention(bias, masks, need_weights):
    ours = make_mha(E, N_HEAD, bias=bias)
    ref = torch_mha_like(ours)
    x = torch.randn(B, T, E)
    causal = "causal" in masks
    padding = KEY_PADDING if "padding" in masks else None
    expected, _ = ref(x, x, x, attn_mask=~causal_mask(T, T) if causal else None, key_padding_mask=padding)
    out, _ = ours(x, is_causal=causal, key_padding_mask=padding, need_weights=need_weights)
    # two float32 evaluations of one formula, each within mha_bound of the exact value
    assert_within(out, expected, 2 * mha_bound(ours, x, allowed=allowed_by(T, T, causal, padding))[0])


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("masks", ["none", "causal", "padding", "causal+padding"])
@pytest.mark.parametrize("need_weights", PATHS)
def test_cross_attention_equals_torch_multihead_attention(bias, masks, need_weights):
    ours = make_mha(E, N_HEAD, bias=bias)
    ref = torch_mha_like(ours)
    x, context = torch.randn(B, 3, E), torch.randn(B, T, E)  # queries and keys of different lengths
    causal = "causal" in masks
    padding = KEY_PADDING if "padding" in masks else None
    expected, _ = ref(x, context, context, attn_mask=~causal_mask(3, T) if causal else None,
                      key_padding_mask=padding)
    out, _ = ours(x, context, is_causal=causal, key_padding_mask=padding, need_weights=need_weights)
    assert_within(out, expected, 2 * mha_bound(ours, x, context, allowed_by(3, T, causal, padding))[0])


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_attention_weights_equal_torch_per_head_weights(cross):
    ours = make_mha(E, N_HEAD)
    ref = torch_mha_like(ours)
    x = torch.randn(B, T, E)
    context = torch.randn(B, 7, E) if cross else x
    padding = torch.arange(context.size(1)).expand(B, -1) >= 4  # the keys after the fourth are padding
    _, expected = ref(x, context, context, key_padding_mask=padding, need_weights=True, average_attn_weights=False)
    _, weights = ours(x, context if cross else None, key_padding_mask=padding, need_weights=True)
    assert weights.shape == (B, N_HEAD, T, context.size(1))
    allowed = allowed_by(T, context.size(1), padding=padding)
    assert_within(weights, expected, 2 * mha_bound(ours, x, context, allowed)[1])


# --- the explicit path equals the SDPA path -------------------------------------------------------------

MASK_CASES = ["none", "causal", "padding", "attn_mask", "causal+padding+attn_mask", "cross+causal"]


def call_with_masks(mha, x, case, need_weights):
    """Run mha on x under one of MASK_CASES; returns (out, weights, the `allowed` mask it amounts to)."""
    t = x.size(1)
    context = torch.randn(x.size(0), t + 3, x.size(2), generator=torch.Generator().manual_seed(1)) \
        if "cross" in case else None
    t_k = t if context is None else context.size(1)
    kwargs, allowed = {}, torch.ones(1, 1, t, t_k, dtype=torch.bool)
    if "causal" in case:
        kwargs["is_causal"] = True
        allowed = allowed & causal_mask(t, t_k)
    if "padding" in case:
        kwargs["key_padding_mask"] = KEY_PADDING
        allowed = allowed & ~KEY_PADDING[:, None, None, :]
    if "attn_mask" in case:
        mask = torch.rand(x.size(0), 1, t, t_k, generator=torch.Generator().manual_seed(2)) < 0.7
        mask[..., 0] = True  # every query keeps at least one key
        kwargs["attn_mask"] = mask
        allowed = allowed & mask
    out, weights = mha(x, context, need_weights=need_weights, **kwargs)
    return out, weights, allowed, context


@pytest.mark.parametrize("case", MASK_CASES)
def test_explicit_path_equals_sdpa_path_and_per_head_reference(case):
    mha = make_mha(E, N_HEAD)
    x = torch.randn(B, T, E)
    fast, no_weights, allowed, context = call_with_masks(mha, x, case, need_weights=False)
    explicit, weights, _, _ = call_with_masks(mha, x, case, need_weights=True)
    assert no_weights is None
    out_bound, weights_bound = (2 * bound for bound in mha_bound(mha, x, context, allowed))
    assert_within(explicit, fast, out_bound)
    expected, expected_weights = reference_attention(mha, x, context, allowed)
    assert_within(fast, expected, out_bound)
    assert_within(weights, expected_weights, weights_bound)


@pytest.mark.parametrize("case", MASK_CASES)
def test_attention_weight_rows_sum_to_one_and_masked_keys_get_zero(case):
    mha = make_mha(E, N_HEAD)
    x = torch.randn(B, T, E)
    _, weights, allowed, context = call_with_masks(mha, x, case, need_weights=True)
    # each weight within its bound of the exact one, and the sum's own T_k roundings
    bound = mha_bound(mha, x, context, allowed)[1].sum(dim=-1) + gamma(weights.size(-1))
    assert_within(weights.sum(dim=-1), torch.ones(weights.shape[:-1]), bound)
    allowed = allowed.expand_as(weights)
    assert (weights[~allowed] == 0).all()
    assert (weights[allowed] > 0).all()


# --- masks ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("need_weights", PATHS)
def test_is_causal_with_fewer_queries_than_keys_is_aligned_bottom_right(need_weights):
    """New queries appended after earlier keys: equal to the last rows of the full causal self-attention."""
    mha = make_mha(E, N_HEAD)
    x = torch.randn(B, T, E)
    full, _ = mha(x, is_causal=True, need_weights=need_weights)
    bound = 2 * mha_bound(mha, x, allowed=causal_mask(T, T))[0]  # other shapes, so maybe other summation orders
    for t_q in (1, 2, T - 1):
        last, _ = mha(x[:, -t_q:], x, is_causal=True, need_weights=need_weights)
        assert_within(last, full[:, -t_q:], bound[:, -t_q:])


@pytest.mark.parametrize("need_weights", PATHS)
def test_changing_token_j_never_changes_earlier_outputs(need_weights):
    mha = make_mha(E, N_HEAD)
    x = torch.randn(1, T, E)
    out, _ = mha(x, is_causal=True, need_weights=need_weights)
    for j in range(T):
        changed = x.clone()
        changed[:, j] = torch.randn(E)
        out_changed, _ = mha(changed, is_causal=True, need_weights=need_weights)
        torch.testing.assert_close(out_changed[:, :j], out[:, :j], atol=0, rtol=0)
        assert not torch.allclose(out_changed[:, j:], out[:, j:])  # ...while it does change later ones


@pytest.mark.parametrize("need_weights", PATHS)
@pytest.mark.parametrize("case", ["all keys padded", "attn_mask row all False", "causal + left padding"])
def test_fully_masked_row_gives_zeros_not_nan(need_weights, case):
    mha = make_mha(E, N_HEAD, out_proj=False)  # the raw attention output, no projection bias on top
    x = torch.randn(B, T, E)
    kwargs = {}
    dead = torch.zeros(B, T, dtype=torch.bool)  # queries that may attend no key
    if case == "all keys padded":
        kwargs["key_padding_mask"] = torch.tensor([[True] * T, [False] * T])
        dead[0] = True
    elif case == "attn_mask row all False":
        mask = torch.ones(B, 1, T, T, dtype=torch.bool)
        mask[1, :, 2] = False
        kwargs["attn_mask"] = mask
        dead[1, 2] = True
    else:  # a left-padded row: its padding queries see only padding keys
        kwargs.update(is_causal=True, key_padding_mask=torch.tensor([[True, True] + [False] * (T - 2),
                                                                    [False] * T]))
        dead[0, :2] = True
    out, weights = mha(x, need_weights=need_weights, **kwargs)
    assert not out.isnan().any()
    assert (out[dead] == 0).all()
    assert (out[~dead].abs().sum(dim=-1) > 0).all()
    if need_weights:
        assert not weights.isnan().any()
        assert (weights.transpose(1, 2)[dead] == 0).all()


# --- gradients ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("need_weights", PATHS)
@pytest.mark.parametrize("masks", ["causal", "causal+padding", "cross+padding"])
def test_gradcheck_on_a_tiny_float64_instance(need_weights, masks):
    """Gradients against finite differences: the full Jacobian for the inputs, and random projections of
    it (gradcheck's fast mode, 30x quicker) for the inputs and every weight together."""
    mha = make_mha(4, 2).double()
    names = [name for name, _ in mha.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in mha.parameters()]
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    context = torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True) if "cross" in masks else None
    t_k = 3 if context is None else 4
    padding = torch.zeros(2, t_k, dtype=torch.bool)
    padding[0, -1] = True
    kwargs = {"is_causal": "causal" in masks, "key_padding_mask": padding if "padding" in masks else None,
              "need_weights": need_weights}

    def f(x, context, *weights):
        out, attn = functional_call(mha, dict(zip(names, weights)), (x, context), kwargs)
        return (out, attn) if need_weights else out

    assert torch.autograd.gradcheck(lambda x, context: f(x, context, *params), (x, context))
    assert torch.autograd.gradcheck(f, (x, context, *params), fast_mode=True)


# --- widths ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_query_value_output_and_input_widths_may_all_differ(cross):
    mha = make_mha(6, 2, qk_dim=4, v_dim=8, out_dim=10)
    assert mha.qkv.weight.shape == (2 * 4 + 8, 6)
    assert mha.out_proj.weight.shape == (10, 8)
    x = torch.randn(B, 3, 6)
    context = torch.randn(B, 5, 6) if cross else None
    t_k = 5 if cross else 3
    for need_weights in (False, True):
        out, weights = mha(x, context, is_causal=True, need_weights=need_weights)
        assert out.shape == (B, 3, 10)
        expected, expected_weights = reference_attention(mha, x, context, causal_mask(3, t_k))
        out_bound, weights_bound = (2 * bound for bound in mha_bound(mha, x, context, causal_mask(3, t_k)))
        assert_within(out, expected, out_bound)
        if need_weights:
            assert weights.shape == (B, 2, 3, t_k)
            assert_within(weights, expected_weights, weights_bound)


def test_without_output_projection_the_output_is_the_value_width():
    mha = make_mha(6, 2, v_dim=8, out_proj=False)
    out, _ = mha(torch.randn(B, 3, 6))
    assert out.shape == (B, 3, 8)
    with pytest.raises(ValueError, match=r"\b8\b.*\b10\b|\b10\b.*\b8\b"):
        MultiHeadAttention(6, 2, v_dim=8, out_dim=10, out_proj=False)


@pytest.mark.parametrize("kwargs, width, n_head", [
    ({"embed_dim": 10, "n_head": 3}, 10, 3),
    ({"embed_dim": 12, "n_head": 3, "qk_dim": 10}, 10, 3),
    ({"embed_dim": 12, "n_head": 4, "v_dim": 6}, 6, 4),
])
def test_width_not_divisible_by_n_head_is_a_value_error_naming_both(kwargs, width, n_head):
    with pytest.raises(ValueError) as err:
        MultiHeadAttention(**kwargs)
    numbers = [int(n) for n in re.findall(r"\d+", str(err.value))]
    assert width in numbers and n_head in numbers


@pytest.mark.parametrize("need_weights", PATHS)
def test_under_cpu_bf16_autocast_attention_still_computes_in_float32(need_weights):
    """Autocast makes the projections bf16; attention itself must stay float32 on the CPU (attention_dtype),
    where torch's bf16 attention is slower. Reference: the softmax written out in float64 on the same q, k, v."""
    mha = make_mha(E, N_HEAD, out_proj=False)  # the output is attention's own, before any bf16 projection
    x = torch.randn(B, T, E)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = mha(x, is_causal=True, need_weights=need_weights)
        q, k, v = (t.view(B, T, N_HEAD, -1).transpose(1, 2).double() for t in mha.project(x))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    expected = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, E)
    assert out.dtype == torch.float32
    # float32 attention over these q, k, v lies within attention_bound of the exact value; bf16 would be ~1e-2 off
    bound = attention_bound(q, k, v, torch.ones(T, T, dtype=torch.bool).tril())[0]
    assert_within(out, expected, bound.transpose(1, 2).reshape(B, T, E))


# --- dropout --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("need_weights", PATHS)
def test_dropout_is_inactive_in_eval(need_weights):
    mha = make_mha(E, N_HEAD, dropout=0.5)
    no_dropout = MultiHeadAttention(E, N_HEAD, dropout=0.0).eval()
    no_dropout.load_state_dict(mha.state_dict())
    x = torch.randn(B, T, E)
    first, _ = mha(x, is_causal=True, need_weights=need_weights)
    second, _ = mha(x, is_causal=True, need_weights=need_weights)
    expected, _ = no_dropout(x, is_causal=True, need_weights=need_weights)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, expected, atol=0, rtol=0)


@pytest.mark.parametrize("need_weights", PATHS)
@pytest.mark.parametrize("where", ["attention weights", "output"])
def test_dropout_is_active_in_train(need_weights, where):
    mha = make_mha(E, N_HEAD, dropout=0.5).train()
    if where == "attention weights":  # isolate the dropout inside the attention (SDPA's dropout_p)
        mha.out_dropout = nn.Identity()
    else:
        mha.attn_dropout = 0.0
    x = torch.randn(B, T, E)
    torch.manual_seed(1)
    first, _ = mha(x, is_causal=True, need_weights=need_weights)
    second, _ = mha(x, is_causal=True, need_weights=need_weights)
    evaluated, _ = mha.eval()(x, is_causal=True, need_weights=need_weights)
    assert not torch.allclose(first, second)
    assert not torch.allclose(first, evaluated)


def test_fully_masked_row_gives_zeros_even_where_the_sdpa_kernel_gives_nan(monkeypatch):
    """CPU SDPA returns zeros for a query with no visible key; the textbook softmax (and some GPU kernels)
    give NaN. Simulate such a kernel: the output must still be zeros there."""
    import model.attention

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def nan_on_dead_rows(q, k, v, attn_mask=None, **kwargs):
        out = sdpa(q, k, v, attn_mask=attn_mask, **kwargs)
        if attn_mask is None:
            return out
        return out.masked_fill(~attn_mask.any(dim=-1, keepdim=True), float("nan"))

    monkeypatch.setattr(model.attention.F, "scaled_dot_product_attention", nan_on_dead_rows)
    mha = make_mha(E, N_HEAD, out_proj=False)
    padding = torch.tensor([[True] * T, [False] * T])  # row 0: every key is padding
    out, _ = mha(torch.randn(B, T, E), key_padding_mask=padding)
    assert not out.isnan().any()
    assert (out[0] == 0).all() and (out[1].abs().sum(dim=-1) > 0).all()
