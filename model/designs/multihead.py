"""Multi-head attention as the textbooks teach it: self- and cross-attention, causal and padding masks, distinct
query/key and value widths, dropout, grouped key/value heads and the attention weights themselves. The GPT runs
the plain causal block (model/attention.py); this one is tested against torch's nn.MultiheadAttention.

Mask conventions (each argument follows the PyTorch function it is named after):
- attn_mask: bool, broadcastable to (B, n_head, T_q, T_k), True where a query may attend a key,
  as in F.scaled_dot_product_attention.
- key_padding_mask: bool (B, T_k), True where a key is padding, as in nn.MultiheadAttention.
- is_causal: query i may attend key j when j <= i + (T_k - T_q), i.e. aligned bottom-right, so
  that the last query sees every key (causal_mask).
All given masks are combined with AND. A query whose keys are all masked gets zeros, never NaN.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention import attention_dtype, causal_mask


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over n_head heads with a fused Q/K/V projection.

    Widths: inputs are embed_dim wide; queries and keys qk_dim in all, values v_dim in all (split
    evenly over the heads); the output projection maps v_dim to out_dim. Each defaults to embed_dim.
    n_kv_head (default n_head): key/value heads, each read by n_head / n_kv_head query heads; keys and values
    are then qk_dim and v_dim times n_kv_head / n_head wide.
    """

    def __init__(self, embed_dim: int, n_head: int, *, qk_dim: int | None = None, v_dim: int | None = None,
                 out_dim: int | None = None, bias: bool = True, out_proj: bool = True, dropout: float = 0.0,
                 n_kv_head: int | None = None):
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
        self.qkv = nn.Linear(embed_dim, qk_dim + self.k_dim + self.kv_v_dim, bias=bias)  # rows: Q, then K, then V
        self.out_proj = nn.Linear(v_dim, out_dim or embed_dim, bias=bias) if out_proj else nn.Identity()
        self.attn_dropout = dropout
        self.out_dropout = nn.Dropout(dropout)

    def forward(self, x, context=None, *, attn_mask=None, key_padding_mask=None, is_causal=False,
                need_weights=False):
        """Attend from x (B, T_q, embed_dim) to itself, or to context (B, T_k, embed_dim) if given.
        need_weights: take the explicit path and also return the attention weights.
        Returns (out (B, T_q, out_dim), weights (B, n_head, T_q, T_k) or None)."""
        B, T_q, _ = x.shape
        q, k, v = self.project(x, context)
        q = q.view(B, T_q, self.n_head, -1).transpose(1, 2)  # (B, nh, T_q, hs)
        k = k.view(B, k.size(1), self.n_kv_head, -1).transpose(1, 2)  # (B, n_kv, T_k, hs)
        v = v.view(B, v.size(1), self.n_kv_head, -1).transpose(1, 2)  # (B, n_kv, T_k, hs_v)
        dtype = attention_dtype(q.dtype, q.device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        T_k = k.size(2)

        dropout_p = self.attn_dropout if self.training else 0.0
        # causal needs no mask tensor when T_q == T_k (SDPA's own is_causal is then the same as ours) or when
        # one query comes last and so sees every key
        plain = attn_mask is None and key_padding_mask is None and (not is_causal or T_q in (1, T_k))
        with torch.autocast(x.device.type, enabled=False):  # in `dtype`, as attention_dtype says
            if plain and not need_weights:
                # no mask tensor at all: lets SDPA pick its fastest kernel, and builds no T x T mask
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal and T_q > 1,
                                                   enable_gqa=self.grouped)
                weights = None
            else:
                mask = None if plain and T_q == 1 else self.combined_mask(T_q, T_k, x.device, attn_mask,
                                                                           key_padding_mask, is_causal)
                y, weights = self.attend(q, k, v, mask, dropout_p, need_weights)

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

    def attend(self, q, k, v, mask, dropout_p, need_weights):
        """softmax(q kᵀ / √d, masked) v, explicitly when the weights are wanted, else through SDPA.
        Returns (y (B, nh, T_q, hs_v), weights (B, nh, T_q, T_k) or None)."""
        if need_weights:
            B, nh, T_q, hs = q.shape
            T_k, n_kv = k.size(2), self.n_kv_head
            # the query heads that read one key/value head go side by side, as g * T_q rows of queries
            q = q.reshape(B, n_kv, nh // n_kv * T_q, hs)  # (B, n_kv, g * T_q, hs)
            if mask is not None:
                rows_of_mask = mask.size(0) if mask.dim() == 4 else 1
                mask = mask.expand(rows_of_mask, nh, T_q, T_k).reshape(rows_of_mask, n_kv, q.size(2), T_k)
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(hs)  # (B, n_kv, g * T_q, T_k)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            weights = scores.softmax(dim=-1)
            if mask is not None:  # a row with every key masked is all NaN after softmax
                weights = weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
            y = F.dropout(weights, dropout_p, self.training) @ v  # (B, n_kv, g * T_q, hs_v)
            return y.view(B, nh, T_q, -1), weights.view(B, nh, T_q, T_k)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=self.grouped)
        # kernels differ on rows with every key masked (zeros on some, NaN on others): make them zeros
        return y.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0), None

    def project(self, x, context=None):
        """Queries from x; keys and values from x (self-attention) or from context (cross-attention)."""
        if context is None:  # one fused matmul for Q, K and V
            return self.qkv(x).split([self.qk_dim, self.k_dim, self.kv_v_dim], dim=-1)
        # the same weights, split: queries from x, keys and values from context
        w_q, w_kv = self.qkv.weight.split([self.qk_dim, self.k_dim + self.kv_v_dim])
        b_q, b_kv = (None, None) if self.qkv.bias is None else self.qkv.bias.split([self.qk_dim,
                                                                                     self.k_dim + self.kv_v_dim])
        k, v = F.linear(context, w_kv, b_kv).split([self.k_dim, self.kv_v_dim], dim=-1)
        return F.linear(x, w_q, b_q), k, v
