"""How far apart two float32 computations of one value may lie, from the arithmetic alone: the tests' tolerances.

A BLAS or attention kernel may sum in any order it likes, and picks its order by the CPU (AVX2, AVX-512, AMX), the
shapes and the thread count. A tolerance taken from one machine's rounding fails on another, so each tolerance here
holds for every summation order (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1):
a float32 sum of n products lies within gamma(n) * sum |a_i| |b_i| of the exact value, whatever the order, with or
without fused multiply-adds. Two float32 evaluations of one formula then lie within twice that of each other.

The bounds are elementwise tensors, computed in float64 from the float32 inputs (whose float64 products and sums are
exact to about 1e-16, far below any bound here). They assume float32 matmuls in full float32
(torch.get_float32_matmul_precision() == "highest", torch's default), which _full_float32() checks.
"""

import math
import os

import torch

EPS = torch.finfo(torch.float32).eps  # 2^-23: the gap between 1.0 and the next float32
U = EPS / 2  # the unit roundoff: one rounding moves a value by at most U of itself
# exp's own error, in ulps: libm's and Sleef's exp (softmax) are within 1 ulp; ATen's exp_u20, which its CPU flash
# attention uses, within 20 ("a faster version of exp with ULP=20", aten/src/ATen/cpu/vec). So a computed exp lies
# within EXP_ULPS * EPS of exp, relative.
EXP_ULPS = 20


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): n roundings in a row move a value by at most this much of itself."""
    assert n * U < 0.5, n
    return n * U / (1 - n * U)


def _full_float32():
    assert torch.get_float32_matmul_precision() == "highest", "TF32 or bf16 matmuls round far more than float32's"


def _d(t):
    return t.detach().double() if isinstance(t, torch.Tensor) else t


def matmul_bound(a: torch.Tensor, b: torch.Tensor, da=0.0, db=0.0, extra: int = 0) -> torch.Tensor:
    """Elementwise bound on how far a float32 a @ b lies from the exact product of the exact inputs, a and b being
    within da and db of those (elementwise, broadcastable; 0 for exact inputs), in any summation order:
    gamma(k + extra) |a| @ |b| for sums of k products (extra: more roundings of each element, as a scale's), plus
    what the inputs' errors carry."""
    _full_float32()
    a, b, da, db = _d(a), _d(b), _d(da), _d(db)
    k = a.size(-1)
    bound = gamma(k + extra) * ((a.abs() + da) @ (b.abs() + db))
    if isinstance(da, torch.Tensor) or da:
        bound = bound + da @ (b.abs() + db)
    if isinstance(db, torch.Tensor) or db:
        bound = bound + a.abs() @ db
    return bound


def linear_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, dx=0.0) -> torch.Tensor:
    """Elementwise bound on |fl(F.linear(x, weight, bias)) - exact|, in any order: gamma(n + 1) (|x| @ |W|^T + |b|),
    n = x's width (Higham's (3.5), the bias one more term); plus |dx| @ |W|^T when x is off by up to dx."""
    bound = matmul_bound(x, weight.t(), da=dx, extra=1)
    return bound if bias is None else bound + gamma(x.size(-1) + 1) * _d(bias).abs()


def attention_bound(q, k, v, allowed=None, scale=None, dq=0.0, dk=0.0, dv=0.0, sink=None, bias=None):
    """Elementwise bounds (on the output, on the weights) of float32 attention softmax(q k^T scale, masked) v against
    the exact value, for any summation order and any kernel of the textbook formula or the online (flash) softmax.

    q (..., T_q, d), k (..., T_k, d), v (..., T_k, d_v); k and v may have fewer heads (dim -3) than q, grouped.
    allowed: bool broadcastable to the scores, True where a query may attend a key. scale: 1/sqrt(d) by default.
    dq, dk, dv: bounds on the inputs' own errors. sink: a logit per head (dim -3) in every softmax's denominator.
    bias: float32 values added to the scores (as log counts), broadcastable to them, each computed within 2 ulps.

    The argument: each score is a dot product (gamma(d + 4), with the roundings of the scale); each weight's exponent
    is off by at most eta, that score error plus the roundings of subtracting the row's running maximum (at most
    4 u max|s|) and one exp's error for each rescaling of a flash kernel (at most one per key); a weight
    exp(s_j) / sum exp(s_i) is then off by at most a factor exp(2 eta), and its sums by gamma(2 T_k + 4)."""
    q, k, v, dq, dk, dv = (_d(t) for t in (q, k, v, dq, dk, dv))
    group = q.size(-3) // k.size(-3) if q.dim() >= 3 and k.dim() >= 3 else 1
    if group > 1:
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
        dk, dv = (t.repeat_interleave(group, -3) if isinstance(t, torch.Tensor) and t.dim() >= 3 else t
                  for t in (dk, dv))
    d, t_k = q.size(-1), k.size(-2)
    scale = 1 / math.sqrt(d) if scale is None else scale
    scores = scale * (q @ k.transpose(-2, -1))
    ds = scale * matmul_bound(q, k.transpose(-2, -1), dq, dk.transpose(-2, -1) if isinstance(dk, torch.Tensor) else dk,
                              extra=4)  # the scale's own rounding, and SDPA's of q and k by its square root
    if bias is not None:  # its own error, and the addition's rounding
        bias = _d(bias)
        ds = ds + 2 * EPS * bias.abs() + U * (scores.abs() + bias.abs())
        scores = scores + bias
    if allowed is None:
        allowed = torch.ones_like(scores, dtype=torch.bool)
    allowed = torch.broadcast_to(allowed, scores.shape)
    if sink is not None:  # the sink is one more logit, of no value
        s = _d(sink).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        scores, ds = torch.cat([scores, s], -1), torch.cat([ds, torch.zeros_like(s)], -1)
        allowed = torch.cat([allowed, torch.ones_like(s, dtype=torch.bool)], -1)
        v = torch.cat([v, torch.zeros_like(v[..., :1, :])], -2)
        dv = torch.cat([dv, torch.zeros_like(dv[..., :1, :])], -2) if isinstance(dv, torch.Tensor) and dv.dim() else dv
        t_k += 1
    scores = scores.masked_fill(~allowed, -math.inf)
    weights = scores.softmax(-1).nan_to_num(0.0)  # a row that sees no key: zeros
    largest = scores.masked_fill(~allowed, 0).abs().amax(-1, keepdim=True)
    eta = ds.masked_fill(~allowed, 0).amax(-1, keepdim=True) + 4 * U * largest + (t_k + 1) * EXP_ULPS * EPS
    rho = (1 + gamma(2 * t_k + 4)) ** 2 * torch.exp(2 * eta) - 1  # relative, on each weight and each term of a sum
    out = rho * (weights @ v.abs()) + (1 + rho) * (weights @ (dv if isinstance(dv, torch.Tensor) else
                                                              torch.full_like(v, float(dv))))
    if sink is not None:
        weights = weights[..., :-1]
    return out, rho * weights


def attention_reference(q, k, v, allowed=None, scale=None, sink=None, bias=None):
    """The same attention, in float64: (output, weights); a row that sees no key gives zeros."""
    q, k, v = _d(q), _d(k), _d(v)
    group = q.size(-3) // k.size(-3) if q.dim() >= 3 and k.dim() >= 3 else 1
    if group > 1:
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scale = 1 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = scale * (q @ k.transpose(-2, -1))
    scores = scores if bias is None else scores + _d(bias)
    if allowed is not None:
        scores = scores.masked_fill(~torch.broadcast_to(allowed, scores.shape), -math.inf)
    if sink is not None:
        scores = torch.cat([scores, _d(sink).view(-1, 1, 1).expand(*scores.shape[:-1], 1)], -1)
    weights = scores.softmax(-1).nan_to_num(0.0)
    if sink is not None:
        weights = weights[..., :-1]
    return weights @ v, weights


def mean_rtol(n: int) -> float:
    """How far apart, relative, two float32 sums (or means) of the same n terms of one sign may lie, each summed in
    its own order: 2 gamma(n), as sum |x| = |sum x| then."""
    return 2 * gamma(n)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound, msg: str = ""):
    """|actual - expected| <= bound, elementwise (bound: a tensor broadcastable to them, or a number), in float64;
    on failure names how many elements lie outside, the worst one's distance and its bound."""
    diff = (_d(actual) - _d(expected)).abs()
    bound = torch.as_tensor(_d(bound), dtype=torch.float64)
    assert actual.shape == expected.shape, f"{msg}: shapes {tuple(actual.shape)} and {tuple(expected.shape)}"
    outside = ~(diff <= bound)  # NaN counts as outside
    if os.environ.get("KVGPT_TOLERANCE_LOG"):  # how close each comparison comes to its bound, one line each
        with open(os.environ["KVGPT_TOLERANCE_LOG"], "a") as log:
            ratio = (diff / torch.broadcast_to(bound, diff.shape)).nan_to_num(0.0, posinf=math.inf)
            print(os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], msg, f"{ratio.max().item():.3g}",
                  f"{diff.max().item():.3g}", file=log)
    if outside.any():
        excess = (diff - bound).nan_to_num(math.inf)
        worst = int(excess.argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        raise AssertionError(f"{msg + ': ' if msg else ''}{int(outside.sum())} of {diff.numel()} elements differ by "
                             f"more than the arithmetic allows; worst at {index}: {actual[index].item()!r} against "
                             f"{expected[index].item()!r}, {diff[index].item():.3g} apart, bound "
                             f"{torch.broadcast_to(bound, diff.shape)[index].item():.3g}")


def projected_attention_bound(x, context, qkv, widths, n_head, n_kv_head, out_proj=None, allowed=None, sink=None):
    """Elementwise bounds (on the output, on the weights) of a float32 attention block against the exact value: queries
    from x and keys and values from context through one Linear qkv (rows: widths[0] of queries, then widths[1] of
    keys, widths[2] of values), n_head query heads over n_kv_head key/value heads, then out_proj (a Linear, or None).
    The projections' linear_bound carried through attention_bound and the output projection's."""
    w, b = qkv.weight, qkv.bias
    exact = [_d(t) @ _d(w).t() + (0 if b is None else _d(b)) for t in (x, context)]
    errors = [linear_bound(t, w, b) for t in (x, context)]

    def heads(t, width, n):  # (B, T, width) -> (B, n, T, width / n)
        return t.reshape(*t.shape[:2], n, width // n).transpose(1, 2)

    (q, _, _), (_, k, v) = (t.split(widths, -1) for t in exact)
    (dq, _, _), (_, dk, dv) = (t.split(widths, -1) for t in errors)
    q, dq = heads(q, widths[0], n_head), heads(dq, widths[0], n_head)
    k, dk = heads(k, widths[1], n_kv_head), heads(dk, widths[1], n_kv_head)
    v, dv = heads(v, widths[2], n_kv_head), heads(dv, widths[2], n_kv_head)
    dh, weights_bound = attention_bound(q, k, v, allowed, dq=dq, dk=dk, dv=dv, sink=sink)
    h = attention_reference(q, k, v, allowed, sink=sink)[0]
    h, dh = (t.transpose(1, 2).reshape(t.size(0), t.size(2), -1) for t in (h, dh))  # the heads side by side
    if out_proj is None or not isinstance(out_proj, torch.nn.Linear):
        return dh, weights_bound
    return linear_bound(h, out_proj.weight, out_proj.bias, dx=dh), weights_bound


def mha_bound(mha, x, context=None, allowed=None):
    """projected_attention_bound of a MultiHeadAttention (model/designs/multihead.py) of x attending to context
    (default x). allowed: as attention_bound's, broadcastable to (B, n_head, T_q, T_k)."""
    return projected_attention_bound(x, x if context is None else context, mha.qkv,
                                     [mha.qk_dim, mha.k_dim, mha.kv_v_dim], mha.n_head, mha.n_kv_head, mha.out_proj,
                                     allowed)


def forward_atol(config, expected: torch.Tensor) -> float:
    """How far two float32 forwards of one model (a cache against recomputation, one kernel against another, compiled
    against eager) may put its logits, or any other output (a cache's keys), apart: EPS x the longest sum in a layer
    x the output's largest magnitude x (layers + 1). The reasoning: a layer adds to the residual stream sums of at most
    `longest` terms, each off by gamma(longest) of its magnitude, which the final LayerNorm and the head carry into the
    same relative error of the logits; the head's own sum (+1 layer); EPS = 2u for the two forwards, each that far from
    the exact value. A real bug (a key dropped or misplaced, a wrong mask or position) moves logits by 1e-2 or more."""
    longest = max(4 * config.n_embd, config.block_size)  # the MLP's down projection, or attention over every key
    return EPS * longest * float(expected.detach().abs().max()) * (config.n_layer + 1)


def assert_forward_close(actual: torch.Tensor, expected: torch.Tensor, config, msg: str = ""):
    """actual within forward_atol of expected, elementwise; config: the model's (or the model)."""
    config = getattr(config, "config", config)
    assert_within(actual, expected, forward_atol(config, expected), msg)
