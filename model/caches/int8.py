"""What an int8 KV cache adds to the ring (model/caches/ring.py): keys and values stored as int8, with one
float32 scale per token and head (the absmax rule, quantize_int8, which the int8 weights of
model/decoding/quantize.py share), about a quarter of float32's bytes.

Attention reads them as they are stored and folds the scales into its sums, since q·(s k) = s (q·k) and
Σ w (s v) = Σ (w s) v: the scales never touch a float copy of the cache. Eagerly on the CPU the int8 keys and
values still become float for the matmuls, a block of rows at a time (FLOAT_BLOCK_BYTES); compiled
(torch.compile), the conversion fuses into the kernels that read the cache.
"""

import math
from typing import NamedTuple

import torch

from ..attention import causal_mask
from .ring import RingKVCache

KV_SCALE_DTYPE = torch.float32  # an int8 cache's scales

# how much float the int8 keys become at a time, eagerly on the CPU: small enough to stay in the CPU's caches
# until the matmuls read it (docs/benchmarks.md)
FLOAT_BLOCK_BYTES = 8 * 2**20


def quantize_int8(x: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization of x's last dimension: (q int8, scale of `scale_dtype`, the last dimension
    kept as 1) with x ≈ scale * q, q in [-127, 127]. The scale is rounded to scale_dtype before q is computed, so
    that q fits the scale that is kept."""
    x = x.detach().float()
    scale = (x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127).to(scale_dtype)
    return (x / scale.float()).round().clamp(-127, 127).to(torch.int8), scale


class Quantized(NamedTuple):
    """Keys or values as int8 with one scale per token and head, x ≈ scale * values."""

    values: torch.Tensor  # (B, n_kv, T_k, hs) int8
    scale: torch.Tensor  # (B, n_kv, T_k, 1), in the dtype attention computes in

    @property
    def dtype(self) -> torch.dtype:
        """What attention computes in."""
        return self.scale.dtype

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        """The keys or values as floats of dtype: scale * values."""
        return self.values.to(dtype) * self.scale.to(dtype)


class Int8LayerKV(NamedTuple):
    """One layer's view of an int8 cache during one forward pass: LayerKV, with a scale beside each key and value."""

    k: torch.Tensor  # (B, n_kv, max_len, hs) int8
    v: torch.Tensor  # (B, n_kv, max_len, hs) int8
    k_scale: torch.Tensor  # (B, n_kv, max_len, 1)
    v_scale: torch.Tensor  # (B, n_kv, max_len, 1)
    slots: torch.Tensor  # (T,) where the T new keys and values go
    n_read: int | None  # attention reads slots [:n_read]; None: all of them
    dtype: torch.dtype  # what attention computes in

    def update(self, k_new, v_new):
        """Quantize the new keys/values (B, n_kv, T, hs) into their slots; return what attention reads."""
        for store, scale, new in ((self.k, self.k_scale, k_new), (self.v, self.v_scale, v_new)):
            q, s = quantize_int8(new, KV_SCALE_DTYPE)
            store.index_copy_(2, self.slots, q)
            scale.index_copy_(2, self.slots, s)
        return self.read()

    def read(self):
        """The keys and values attention reads, (B, n_kv, n_read or max_len, hs), as they are stored: int8, each
        with its scales in `dtype`. Attention applies the scales to its scores and weights, never to a float copy
        of the cache (int8_attention)."""
        n = self.n_read
        return (Quantized(self.k[:, :, :n], self.k_scale[:, :, :n].to(self.dtype)),
                Quantized(self.v[:, :, :n], self.v_scale[:, :, :n].to(self.dtype)))

    def attend(self, q, k: Quantized, v: Quantized, mask, sink=None):
        """Attention over the int8 keys and values as read(), the scales folded in (int8_attention)."""
        return int8_attention(q, k, v, mask, sink=sink)[0]


class Int8KVCache(RingKVCache):
    """A RingKVCache that stores keys and values as int8, with one KV_SCALE_DTYPE scale per token and head.
    `dtype` is what attention computes in. Everything else (the ring, the masks, left padding, rollback) is
    RingKVCache's."""

    def __init__(self, n_kv_layer: int, batch_size: int, n_kv_head: int, max_len: int, head_dim: int,
                 dtype=torch.float32, device=None, **kwargs):
        super().__init__(n_kv_layer, batch_size, n_kv_head, max_len, head_dim, dtype=torch.int8, device=device,
                         **kwargs)
        self.compute_dtype = dtype
        self.add_layer_buffers(("k_scale", "v_scale"), (batch_size, n_kv_head, max_len, 1), KV_SCALE_DTYPE, device)

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.nbytes for t in self.layer_buffers("k_scale") + self.layer_buffers("v_scale"))

    def layer(self, i: int, slots: torch.Tensor, n_read: int | None) -> Int8LayerKV:
        k, v, slots, n_read = super().layer(i, slots, n_read)
        return Int8LayerKV(k, v, getattr(self, f"k_scale{i}"), getattr(self, f"v_scale{i}"), slots, n_read,
                           self.compute_dtype)

    def one_row(self) -> "Int8KVCache":
        return Int8KVCache(self.n_kv_layer, 1, self.k0.size(1), self.max_len, self.head_dim, self.compute_dtype,
                           self.device, reach=self.reach, read_all_slots=self.read_all_slots)


def rows(t, r: slice):
    """Rows r of a (B, ...) tensor; None, a 2-d mask, or one row broadcast over all as they are."""
    return t if t is None or t.dim() < 4 or t.size(0) == 1 else t[r]


def int8_attention(q, k: Quantized, v: Quantized, mask=None, need_weights: bool = False, sink=None):
    """softmax(q (s k)ᵀ / √hs, masked) (s v) with the scales folded in: q (B, nh, T_q, hs); mask bool
    (broadcast to (B, nh, T_q, T_k)) or None for causal. A query with no key gets zeros. sink (nh,): a learned
    sink's logits, a column of the softmax whose weight is dropped (model/designs/learned_sink.py).
    Returns (y (B, nh, T_q, hs_v), weights (B, nh, T_q, T_k) or None)."""
    (k, k_scale), (v, v_scale) = k, v
    B, nh, T_q, hs = q.shape
    T_k, n_kv = k.size(2), k.size(1)
    if mask is None and T_q > 1:
        mask = causal_mask(T_q, T_k, q.device)
    if q.device.type == "cpu" and not torch.compiler.is_compiling():
        rows_per_block = max(1, FLOAT_BLOCK_BYTES // (k[0].numel() * q.element_size()))
        if B > rows_per_block:  # a block of rows at a time, whose float copy the CPU's caches still hold
            blocks = []
            for i in range(0, B, rows_per_block):
                part = lambda t: rows(t, slice(i, i + rows_per_block))  # noqa: E731
                blocks.append(int8_attention(part(q), Quantized(part(k), part(k_scale)),
                                             Quantized(part(v), part(v_scale)), part(mask), need_weights, sink))
            return torch.cat([y for y, _ in blocks]), torch.cat([w for _, w in blocks]) if need_weights else None
    # the query heads that read one key/value head go side by side, as g * T_q rows of queries
    q = q.reshape(B, n_kv, nh // n_kv * T_q, hs)  # (B, n_kv, g * T_q, hs)
    if mask is not None:
        rows_of_mask = mask.size(0) if mask.dim() == 4 else 1
        mask = mask.expand(rows_of_mask, nh, T_q, T_k).reshape(rows_of_mask, n_kv, q.size(2), T_k)
    k, v = k.to(q.dtype), v.to(q.dtype)  # from int8, exactly
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(hs) * k_scale.transpose(-2, -1)  # (B, n_kv, g * T_q, T_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sink is not None:  # each query head's rows: g of them per key/value head, T_q each
        sink = sink.to(scores.dtype).view(1, n_kv, nh // n_kv, 1, 1).expand(B, -1, -1, T_q, 1)
        scores = torch.cat([scores, sink.reshape(B, n_kv, -1, 1)], dim=-1)
    weights = scores.softmax(dim=-1)[..., :T_k]
    if mask is not None:  # a row with every key masked is all NaN after softmax
        weights = weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    y = (weights * v_scale.transpose(-2, -1)) @ v  # (B, n_kv, g * T_q, hs_v)
    return y.view(B, nh, T_q, -1), weights.view(B, nh, T_q, T_k) if need_weights else None
