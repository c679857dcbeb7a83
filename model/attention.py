"""Causal self-attention, as the GPT runs it: one fused Q/K/V projection, rotary positions when
asked, and a KV cache while decoding. The textbook block (cross-attention, padding masks, widths,
weights) is designs/multihead.py."""

from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F


def causal_mask(t_q: int, t_k: int, device=None, reach: int | None = None) -> torch.Tensor:
    """(t_q, t_k) bool, True where query i may attend key j, aligned bottom-right: the last query sees every key.
    With a reach, each query sees itself and at most reach - 1 keys before it (sliding-window attention).
    SDPA's own is_causal aligns top-left, which is the same only when t_q == t_k."""
    mask = torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)
    return mask if reach is None else mask.triu(diagonal=t_k - t_q - reach + 1)


def rotary(positions: torch.Tensor, head_dim: int, base: float = 10_000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's (cos, sin) for token positions (T,) or (B, T): each (T, head_dim) or (B, 1, T, head_dim). Channel
    pair i (i and i + head_dim/2) turns by position * base^(-2i / head_dim); sin carries each half's sign. The
    angles are float64 (float32 on MPS, which has none): float32 loses digits of positions in the thousands."""
    dtype = torch.float32 if positions.device.type == "mps" else torch.float64
    inv_freq = base ** -(torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype) / head_dim)
    angles = positions.to(dtype)[..., None] * inv_freq  # (T, hd/2) or (B, T, hd/2)
    if angles.dim() == 3:
        angles = angles[:, None]  # (B, 1, T, hd/2): every head turns alike
    cos, sin = angles.cos().float(), angles.sin().float()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, T, hd) with each channel pair (x_i, x_{i + hd/2}) turned by its angle, in float32:
    (x_i cos - x_{i + hd/2} sin, x_{i + hd/2} cos + x_i sin), the halves swapped by one roll."""
    return (x * cos + x.roll(x.size(-1) // 2, dims=-1) * sin).to(x.dtype)


def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What attention computes in for inputs of `dtype`, and a cache's default dtype: float32 for bf16 on the CPU,
    where torch's bf16 attention is slower than its float32 one (docs/benchmarks.md); else `dtype`."""
    return torch.float32 if dtype == torch.bfloat16 and device.type == "cpu" else dtype


def no_autocast(device: torch.device):
    """A context in which autocast leaves dtypes alone; entered only when autocast is on (it costs a step time)."""
    return torch.autocast(device.type, enabled=False) if torch.is_autocast_enabled(device.type) else nullcontext()


class CausalSelfAttention(nn.Module):
    """Causal self-attention over n_head heads of head_dim channels. kv_layer: the cache layer it writes."""

    def __init__(self, config, kv_layer: int):
        super().__init__()
        self.sink = None  # a learned sink's logits per head (model/designs/learned_sink.py)
        self.n_head, self.head_dim, self.kv_layer = config.n_head, config.head_dim, kv_layer
        self.rotary_dim = config.head_dim  # channels rope turns (fewer: designs/latent.py)
        self.widths = self.qkv_widths(config)
        self.qkv = nn.Linear(config.n_embd, sum(self.widths), bias=config.bias)  # rows: Q, K, V
        self.out_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = config.dropout  # on the attention weights, in training
        self.out_dropout = nn.Dropout(config.dropout)

    def qkv_widths(self, config) -> list[int]:
        """The widths of Q, K and V in the fused projection (model/designs/grouped.py narrows K and V)."""
        return [config.n_embd] * 3

    def forward(self, x, attn_mask=None, rope=None, kv=None):
        """x (B, T, C) -> (B, T, C). attn_mask: bool, broadcast to (B, nh, T, T_k), True where a query may attend
        a key; None: causal. rope: (cos, sin) from rotary(). kv: this layer's LayerKV while decoding."""
        B, T, C = x.shape
        q, k, v = self.project(x, rope, kv)  # (B, nh, T, hs); (B, n_kv, T_k, hs), cache included
        q = q.to(k.dtype if kv is not None else attention_dtype(q.dtype, q.device))  # as cached
        if hasattr(kv, "attend"):  # a cache that attends itself (kv_cache.py: LayerView)
            y = kv.attend(q, k, v, attn_mask, self.sink)  # (B, nh, T, hs)
        else:
            y = self.attend(q, k, v, attn_mask)
        y = y.transpose(1, 2).reshape(B, T, C).to(x.dtype)  # the heads side by side again
        return self.out_dropout(self.out_proj(y))

    def project(self, x, rope, kv):
        """Queries, keys and values in heads, turned by rope; keys and values written to and read from kv."""
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).split(self.widths, -1))
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)  # keys are cached turned: they keep positions
        if kv is not None:
            k, v = kv.update(k, v)
        return q, k, v

    def attend(self, q, k, v, attn_mask):
        """softmax(q kᵀ / √hs, masked) v: q (B, nh, T_q, hs), k and v (B, n_kv, T_k, hs) -> (B, nh, T_q, hs)."""
        T_q, T_k = q.size(2), k.size(2)
        if attn_mask is None and T_q not in (1, T_k):  # queries after cached keys: bottom-right
            attn_mask = causal_mask(T_q, T_k, q.device)
        dropout_p = self.attn_dropout if self.training else 0.0
        with no_autocast(q.device):  # in q's dtype, as attention_dtype says
            return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=attn_mask,
                                                  dropout_p=dropout_p, is_causal=attn_mask is None and T_q > 1,
                                                  enable_gqa=k.size(1) < q.size(1))  # designs/grouped.py
