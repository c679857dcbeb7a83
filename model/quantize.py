"""Decoding precisions: fp32 (the trained weights as they are), bf16, and int8 weight-only; and an int8 KV cache.

    model = to_precision(model, "int8")   # the one place a model changes precision

bf16: every weight and activation in bfloat16, except attention and its KV cache on the CPU, which compute in
float32 (model/attention.py: attention_dtype) whether the cache is used or not.
int8: every Linear of the blocks (attention qkv and out_proj, MLP fc and proj) and the head hold int8
weights with one bf16 scale per output channel (symmetric: w ≈ scale * q, q in [-127, 127]); embeddings and
layer norms stay bf16, and so do the activations. Any fp32 model converts when it is loaded, without
retraining.

Per token at batch 1 the blocks' matmuls read every weight once, so decoding on a CPU is bound by memory
bandwidth: bf16 halves the bytes read and int8 quarters them. A converted model is for decoding only:
an int8 model refuses train() and state_dict(), so that it is never trained or saved as if it were fp32.

The int8 KV cache (Int8KVCache, model.new_kv_cache(B, dtype=torch.int8)) works with a model of any precision: keys
and values are stored as int8 with one scale per token and head, the same absmax rule as the weights. Attention
reads them as they are stored and folds the scales into its sums (MultiHeadAttention.attend): eagerly on the CPU
the int8 keys and values still become float for the matmuls, a block of rows at a time, but compiled
(torch.compile) the conversion fuses into the kernels that read the cache, which then reads a quarter of a float32
cache's bytes.
"""

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import Quantized
from .gpt import KV_SCALE_DTYPE, KVCache

DECODING_PRECISIONS = ("fp32", "bf16", "int8")  # what a model is converted to for decoding


class QuantizedModelError(RuntimeError):
    """Training or saving a model whose weights were quantized for decoding."""


# On the CPU, aten._weight_int8pack_mm reads each row of activations in aligned chunks of 16 bf16 values (32
# bytes, AVX-512; 8 with AVX2) and checks nothing: a row of any other length is read past its end, which gives
# garbage or a crash. With in_features a multiple of 16, every row the model feeds it starts 32-byte aligned.
INT8_KERNEL_WIDTH = 16


def quantize_int8(x: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization of x's last dimension: (q int8, scale of `scale_dtype`, the last dimension
    kept as 1) with x ≈ scale * q, q in [-127, 127]. The scale is rounded to scale_dtype before q is computed, so
    that q fits the scale that is kept."""
    x = x.detach().float()
    scale = (x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127).to(scale_dtype)
    return (x / scale.float()).round().clamp(-127, 127).to(torch.int8), scale


class Int8Linear(nn.Module):
    """y = x Wᵀ + b with W stored as int8 (out_features, in_features) and a bf16 scale per output row.

    On the CPU, when in_features is a multiple of INT8_KERNEL_WIDTH, one fused kernel (aten._weight_int8pack_mm,
    bf16 activations) reads the int8 weights directly; otherwise, and off the CPU, the weights are dequantized
    to the activations' dtype for each matmul.
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.training = False
        q, scales = quantize_int8(linear.weight, dtype)  # each row's largest |w| maps to 127
        scales = scales.squeeze(1)  # (out,)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.cpu_kernel = self.in_features % INT8_KERNEL_WIDTH == 0  # whether the fused kernel can take x
        self.register_buffer("weight", q)  # a buffer, not a Parameter: nothing to train
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))

    def forward(self, x):
        if self.cpu_kernel and x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight, self.scales)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight.to(x.dtype) * self.scales[:, None].to(x.dtype), self.bias)

    def train(self, mode: bool = True):
        if mode:
            raise QuantizedModelError("this model's Linear weights are quantized to int8 for decoding and "
                                      "cannot be trained; train the fp32 model and convert it afterwards")
        return super().train(False)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        raise QuantizedModelError("this model's Linear weights are quantized to int8 for decoding; save the "
                                  "fp32 model instead (any fp32 checkpoint converts when loaded)")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"cpu_kernel={self.cpu_kernel}")


def to_precision(model: nn.Module, precision: str) -> nn.Module:
    """Convert a GPT in place for decoding at `precision` (one of DECODING_PRECISIONS) and return it, in eval mode.
    fp32 leaves it as it is; bf16 and int8 expect fp32 weights, as every checkpoint holds."""
    if precision not in DECODING_PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(DECODING_PRECISIONS)}, got {precision!r}")
    model.eval()
    if precision == "fp32":
        return model
    if precision == "int8":
        for block in model.blocks:
            for parent, name in ((block.attn, "qkv"), (block.attn, "out_proj"), (block.mlp, "fc"),
                                 (block.mlp, "proj")):
                setattr(parent, name, Int8Linear(getattr(parent, name)))
        # the head gets its own int8 copy of the tied matrix (the embedding keeps it, in bf16): with so few
        # outputs (the vocabulary) torch's bf16 matmul takes a slow path on the CPU, several times the int8 one
        model.lm_head = Int8Linear(model.lm_head)
    return model.to(torch.bfloat16)


class Int8LayerKV(NamedTuple):
    """One layer's view of an int8 cache during one forward pass: LayerKV, with a scale beside each key and value."""

    k: torch.Tensor  # (B, n_kv, max_len, hs) int8
    v: torch.Tensor  # (B, n_kv, max_len, hs) int8
    k_scale: torch.Tensor  # (B, n_kv, max_len, 1)
    v_scale: torch.Tensor  # (B, n_kv, max_len, 1)
    slots: torch.Tensor  # (T,) where the T new keys and values go
    n_read: int | None  # attention reads slots [:n_read]; None: all max_len of them
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
        of the cache (MultiHeadAttention.attend)."""
        n = self.n_read
        return (Quantized(self.k[:, :, :n], self.k_scale[:, :, :n].to(self.dtype)),
                Quantized(self.v[:, :, :n], self.v_scale[:, :, :n].to(self.dtype)))


class Int8KVCache(KVCache):
    """A KVCache that stores keys and values as int8, with one KV_SCALE_DTYPE scale per token and head: about a
    quarter of float32's bytes. `dtype` is what attention computes in. Everything else (the ring, the masks,
    left padding, rollback) is KVCache's."""

    def __init__(self, n_layer: int, batch_size: int, n_kv_head: int, max_len: int, head_dim: int,
                 dtype=torch.float32, device=None, **kwargs):
        super().__init__(n_layer, batch_size, n_kv_head, max_len, head_dim, dtype=torch.int8, device=device,
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
