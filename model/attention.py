"""Multi-head attention: one block for self- and cross-attention, masks, dropout and a KV cache.

Mask conventions (each argument follows the PyTorch function it is named after):
- attn_mask: bool, broadcastable to (B, n_head, T_q, T_k), True where a query may attend a key,
  as in F.scaled_dot_product_attention.
- key_padding_mask: bool (B, T_k), True where a key is padding, as in nn.MultiheadAttention.
- is_causal: query i may attend key j when j <= i + (T_k - T_q), i.e. aligned bottom-right, so
  that the last query sees every key. That is what new queries appended after earlier keys need.
All given masks are combined with AND. A query whose keys are all masked gets zeros, never NaN.

Rotary positions (RoPE): rope=(cos, sin) from rotary() turns each query and key by the angle of its position
before they meet, so a score depends only on how far apart the two tokens are, never on where they stand.

Smaller caches (the designs of Llama, Mistral and Gemma), both off by default:
- Grouped-query attention: n_kv_head key/value heads for n_head query heads; each group of n_head / n_kv_head
  query heads reads one of them (n_kv_head = 1 is multi-query attention). Fewer keys and values to cache.
- A block built with project_kv=False projects queries only and reads the keys and values of an earlier layer,
  handed to it as `cache` (layers that share keys and values; model/gpt.py groups them).
- An int8 cache (model/quantize.py) hands attention its int8 keys and values with their scales (Quantized), and
  attend() folds the scales into its sums rather than dequantizing.
"""

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


def causal_mask(t_q: int, t_k: int, device=None, window: int | None = None) -> torch.Tensor:
    """(t_q, t_k) bool, True where query i may attend key j, aligned bottom-right. With a window, each query
    sees itself and at most window - 1 keys before it (sliding-window attention).

    F.scaled_dot_product_attention's is_causal aligns top-left instead, which is only the same
    when t_q == t_k.
    """
    mask = torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)
    return mask if window is None else mask.triu(diagonal=t_k - t_q - window + 1)


def rotary(positions: torch.Tensor, head_dim: int, base: float = 10_000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's (cos, sin) for token positions (T,) or (B, T), for rotate(): each (T, head_dim) or
    (B, 1, T, head_dim), to broadcast over (B, nh, T, head_dim). Channel pair i of a head (i and i + head_dim/2)
    turns by position * base^(-2i / head_dim); sin carries the sign of each half, (-sin, sin). The angles are
    taken in float64 (MPS has none: float32 there), because in float32 a position in the thousands already
    loses digits of its angle, and decoding goes that far."""
    dtype = torch.float32 if positions.device.type == "mps" else torch.float64
    inv_freq = base ** -(torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype) / head_dim)
    angles = positions.to(dtype)[..., None] * inv_freq  # (T, hd/2) or (B, T, hd/2)
    if angles.dim() == 3:
        angles = angles[:, None]  # (B, 1, T, hd/2): every head turns alike
    cos, sin = angles.cos().float(), angles.sin().float()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, T, hd) with each channel pair (x_i, x_{i + hd/2}) turned by its angle, in float32:
    (x_i cos - x_{i + hd/2} sin, x_{i + hd/2} cos + x_i sin), with the halves swapped by one roll."""
    return (x * cos + x.roll(x.size(-1) // 2, dims=-1) * sin).to(x.dtype)


def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention computes in, for q, k, v of `dtype` on `device`, and a KV cache's default: float32
    for bf16 on the CPU, where torch's bf16 attention is slower than its float32 one (about 4x for one query as
    it decodes, 3x for a training step's backward; the cache is small beside the weights); else `dtype`. With or
    without a cache, the same rule."""
    return torch.float32 if dtype == torch.bfloat16 and device.type == "cpu" else dtype


# how much float an int8 cache's keys become at a time, eagerly on the CPU (MultiHeadAttention.attend): small
# enough to stay in the CPU's caches until the matmuls read it (8 MiB: 21 rows of 6 heads of 64 over 256 tokens,
# the fastest of 2, 4, 8 and 16 MiB there, on a CPU with 2 MiB of L2 per core and a 32 MiB L3)
FLOAT_BLOCK_BYTES = 8 * 2**20


def rows(t, r: slice):
    """Rows r of a (B, ...) tensor; None, a 2-d mask, or one row broadcast over all as they are."""
    return t if t is None or t.dim() < 4 or t.size(0) == 1 else t[r]


class Quantized(NamedTuple):
    """Keys or values stored as int8 with one scale per token and head, x ≈ scale * values: what an int8 KV cache
    (model/quantize.py) hands attention, which folds the scales into its sums instead of dequantizing."""

    values: torch.Tensor  # (B, n_kv, T_k, hs) int8
    scale: torch.Tensor  # (B, n_kv, T_k, 1), in the dtype attention computes in


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over n_head heads with a fused Q/K/V projection.

    Widths: inputs are embed_dim wide; queries and keys qk_dim in all, values v_dim in all (split
    evenly over the heads); the output projection maps v_dim to out_dim. Each defaults to embed_dim.
    n_kv_head (default n_head): key/value heads, each read by n_head / n_kv_head query heads; keys and values
    are then qk_dim and v_dim times n_kv_head / n_head wide. project_kv=False: queries only (see the module).
    """

    def __init__(self, embed_dim: int, n_head: int, *, qk_dim: int | None = None, v_dim: int | None = None,
                 out_dim: int | None = None, bias: bool = True, out_proj: bool = True, dropout: float = 0.0,
                 n_kv_head: int | None = None, project_kv: bool = True):
        super().__init__()
        qk_dim = qk_dim or embed_dim
        v_dim = v_dim or embed_dim
        n_kv_head = n_kv_head or n_head
        for name, width in (("query/key width", qk_dim), ("value width", v_dim)):
            if width % n_head:
                raise ValueError(f"{name} {width} is not divisible by n_head {n_head}")
        if n_head % n_kv_head:
            raise ValueError(f"n_kv_head {n_kv_head} must divide n_head {n_head}: each key/value head serves an "
                             f"equal group of query heads")
        if not out_proj and out_dim not in (None, v_dim):
            raise ValueError(f"without an output projection the output width is the value width {v_dim}, "
                             f"not out_dim {out_dim}")
        self.n_head, self.n_kv_head, self.qk_dim, self.v_dim = n_head, n_kv_head, qk_dim, v_dim
        self.k_dim, self.kv_v_dim = qk_dim // n_head * n_kv_head, v_dim // n_head * n_kv_head  # key, value widths
        self.project_kv = project_kv
        # rows: Q, then K, then V (Q alone without project_kv)
        self.qkv = nn.Linear(embed_dim, qk_dim + (self.k_dim + self.kv_v_dim if project_kv else 0), bias=bias)
        self.out_proj = nn.Linear(v_dim, out_dim or embed_dim, bias=bias) if out_proj else nn.Identity()
        self.attn_dropout = dropout
        self.out_dropout = nn.Dropout(dropout)

    def forward(self, x, context=None, *, attn_mask=None, key_padding_mask=None, is_causal=False,
                need_weights=False, rope=None, cache=None):
        """Attend from x (B, T_q, embed_dim) to itself, or to context (B, T_k, embed_dim) if given.

        cache: a LayerKV. The new keys and values are written into it and the queries attend to the
        slots it returns: all max_len of them, and then attn_mask must say which slots each query may see,
        and let each query see at least one (KVCache.attn_mask lets each see its own); or the filled ones only
        (eagerly on the CPU), which is_causal alone may mask. Attention runs in the dtype the cache returns, else
        in attention_dtype(). A block without project_kv reads its keys and values from `cache` instead.
        need_weights: take the explicit path and also return the attention weights.
        rope: (cos, sin) from rotary() for the positions of x's tokens (self-attention only): the keys are turned
        before they are cached, so cached keys keep their positions.
        Returns (out (B, T_q, out_dim), weights (B, n_head, T_q, T_k) or None).
        """
        B, T_q, _ = x.shape
        if rope is not None and context is not None:
            raise ValueError("rotary positions apply to self-attention only: queries and keys from one sequence")
        if self.project_kv:
            q, k, v = self.project(x, context)
            q = q.view(B, T_q, self.n_head, -1).transpose(1, 2)  # (B, nh, T_q, hs)
            k = k.view(B, k.size(1), self.n_kv_head, -1).transpose(1, 2)  # (B, n_kv, T_k, hs)
            v = v.view(B, v.size(1), self.n_kv_head, -1).transpose(1, 2)  # (B, n_kv, T_k, hs_v)
            if rope is not None:
                q, k = rotate(q, *rope), rotate(k, *rope)
            if cache is not None:
                # the slots attention reads: all max_len of them, or the filled ones (eagerly, on the CPU)
                k, v = cache.update(k, v)  # (B, n_kv, T_k, hs)
        else:  # keys and values come from an earlier layer, already turned and cached
            if cache is None or context is not None:
                raise ValueError("a block without project_kv attends to another layer's keys and values: pass them "
                                 "as cache, and no context")
            q = self.qkv(x).view(B, T_q, self.n_head, -1).transpose(1, 2)  # (B, nh, T_q, hs)
            q = q if rope is None else rotate(q, *rope)
            k, v = cache.read()  # (B, n_kv, T_k, hs)
        k_scale = v_scale = None
        if isinstance(k, Quantized):  # an int8 cache's: int8 keys and values, and their scales for attend()
            (k, k_scale), (v, v_scale) = k, v
        dtype = attention_dtype(q.dtype, q.device) if cache is None else (k if k_scale is None else k_scale).dtype
        q = q.to(dtype)
        if k_scale is None:  # (int8 keys and values become float inside attend())
            k, v = k.to(dtype), v.to(dtype)
        T_k = k.size(2)

        dropout_p = self.attn_dropout if self.training else 0.0
        # causal needs no mask tensor when T_q == T_k (SDPA's own is_causal is then the same as ours) or when
        # one query comes last and so sees every key (one decoding step)
        plain = attn_mask is None and key_padding_mask is None and (not is_causal or T_q in (1, T_k))
        # in `dtype` under autocast too, which would take float32 attention on the CPU back to bf16, whose backward
        # is slower there (docs/benchmarks.md)
        with torch.autocast(x.device.type, enabled=False):
            if plain and not need_weights and k_scale is None:
                # no mask tensor at all: lets SDPA pick its fastest kernel, and builds no T x T mask
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal and T_q > 1,
                                                   enable_gqa=self.grouped)
                weights = None
            else:
                # one query that comes last, unmasked, sees every key: no mask to build
                mask = None if plain and T_q == 1 else self.combined_mask(T_q, T_k, x.device, attn_mask,
                                                                           key_padding_mask, is_causal)
                y, weights = self.attend(q, k, v, mask, dropout_p, need_weights, k_scale, v_scale)

        y = y.transpose(1, 2).reshape(B, T_q, self.v_dim).to(x.dtype)  # re-assemble the heads side by side
        return self.out_dropout(self.out_proj(y)), weights

    @staticmethod
    def combined_mask(T_q, T_k, device, attn_mask, key_padding_mask, is_causal):
        """The given masks ANDed into one bool mask, True where a query may attend a key, or None."""
        mask = causal_mask(T_q, T_k, device) if is_causal else None
        if key_padding_mask is not None:
            keys_present = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, T_k)
            mask = keys_present if mask is None else mask & keys_present
        if attn_mask is not None:
            mask = attn_mask if mask is None else mask & attn_mask
        return mask

    @property
    def grouped(self) -> bool:
        """Whether query heads share key/value heads (grouped- or multi-query attention)."""
        return self.n_kv_head < self.n_head

    def attend(self, q, k, v, mask, dropout_p, need_weights, k_scale=None, v_scale=None):
        """softmax(q kᵀ / √d, masked) v, explicitly when the weights are wanted or keys and values come with
        scales (B, n_kv, T_k, 1) (an int8 cache's), else through SDPA.
        Returns (y (B, nh, T_q, hs_v), weights (B, nh, T_q, T_k) or None)."""
        if k_scale is not None and q.device.type == "cpu" and not torch.compiler.is_compiling():
            # eagerly, int8 keys and values become float for the matmuls: a block of rows at a time, whose float
            # copy the CPU's cache still holds when the matmuls read it (compiled, the conversion fuses into the
            # kernels that read the cache, and no copy is made)
            rows_per_block = max(1, FLOAT_BLOCK_BYTES // (k[0].numel() * q.element_size()))
            if q.size(0) > rows_per_block:
                blocks = []
                for i in range(0, q.size(0), rows_per_block):
                    q_, k_, v_, mask_, k_scale_, v_scale_ = (rows(t, slice(i, i + rows_per_block))
                                                             for t in (q, k, v, mask, k_scale, v_scale))
                    blocks.append(self.attend(q_, k_, v_, mask_, dropout_p, need_weights, k_scale_, v_scale_))
                return torch.cat([y for y, _ in blocks]), torch.cat([w for _, w in blocks]) if need_weights else None
        if need_weights or k_scale is not None:
            B, nh, T_q, hs = q.shape
            T_k, n_kv = k.size(2), self.n_kv_head
            # the query heads that read one key/value head go side by side, as g * T_q rows of queries
            q = q.reshape(B, n_kv, nh // n_kv * T_q, hs)  # (B, n_kv, g * T_q, hs)
            if mask is not None:
                rows_of_mask = mask.size(0) if mask.dim() == 4 else 1
                mask = mask.expand(rows_of_mask, nh, T_q, T_k).reshape(rows_of_mask, n_kv, q.size(2), T_k)
            k, v = k.to(q.dtype), v.to(q.dtype)  # from int8 (a cache's), exactly
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(hs)  # (B, n_kv, g * T_q, T_k)
            if k_scale is not None:  # q·(s k) = s (q·k), and Σ w (s v) = Σ (w s) v: the scales never touch k or v
                k_scale, v_scale = k_scale.transpose(-2, -1), v_scale.transpose(-2, -1)  # (B, n_kv, 1, T_k)
                scores = scores * k_scale  # scales each key's column
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            weights = scores.softmax(dim=-1)
            if mask is not None:  # a row with every key masked is all NaN after softmax
                weights = weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
            dropped = F.dropout(weights, dropout_p, self.training)
            y = (dropped if v_scale is None else dropped * v_scale) @ v  # (B, n_kv, g * T_q, hs_v)
            return y.view(B, nh, T_q, -1), weights.view(B, nh, T_q, T_k) if need_weights else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=self.grouped)
        # kernels differ on rows with every key masked (zeros on some, NaN on others): make them zeros
        return y.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0), None

    def project(self, x, context=None):
        """Queries from x; keys and values from x (self-attention) or from context (cross-attention)."""
        if context is None:  # one fused matmul for Q, K and V
            return self.qkv(x).split([self.qk_dim, self.k_dim, self.kv_v_dim], dim=-1)
        # the same weights, split: queries from x, keys and values from context
        w_q, w_kv = self.qkv.weight.split([self.qk_dim, self.k_dim + self.kv_v_dim])
        b_q, b_kv = (None, None) if self.qkv.bias is None else self.qkv.bias.split([self.qk_dim, self.k_dim + self.kv_v_dim])
        k, v = F.linear(context, w_kv, b_kv).split([self.k_dim, self.kv_v_dim], dim=-1)
        return F.linear(x, w_q, b_q), k, v
