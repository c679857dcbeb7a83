"""Decoding precisions: fp32 (the trained weights as they are), bf16, and int8 weight-only.

    model = to_precision(model, "int8")   # the one place a model changes precision

bf16: every weight and activation in bfloat16, except attention and its KV cache on the CPU, which compute in
float32 (model/attention.py: attention_dtype) whether the cache is used or not.
int8: every Linear of the blocks (attention qkv and out_proj, MLP fc and proj) and the head hold int8
weights with one bf16 scale per output channel (symmetric: w ≈ scale * q, q in [-127, 127]: the int8 cache's
rule, model/caches/int8.py: quantize_int8); embeddings and layer norms stay bf16, and so do the activations. Any
fp32 model converts when it is loaded, without retraining.

Per token at batch 1 the blocks' matmuls read every weight once, so decoding on a CPU is bound by memory
bandwidth: bf16 halves the bytes read and int8 quarters them. A converted model is for decoding only:
an int8 model refuses train() and state_dict(), so that it is never trained or saved as if it were fp32,
and to_precision refuses any converted model, so that it is never converted twice.
The int8 KV cache, which works with a model of any precision, is model/caches/int8.py.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..caches.int8 import quantize_int8

DECODING_PRECISIONS = ("fp32", "bf16", "int8")  # what a model is converted to for decoding


class QuantizedModelError(RuntimeError):
    """Training or saving a model whose weights were quantized for decoding."""


# On the CPU, aten._weight_int8pack_mm reads each row of activations in aligned chunks of 16 bf16 values (32
# bytes, AVX-512; 8 with AVX2) and checks nothing: a row of any other length is read past its end, which gives
# garbage or a crash. With in_features a multiple of 16, every row the model feeds it starts 32-byte aligned.
INT8_KERNEL_WIDTH = 16
# Whether this torch build has the fused int8 matmul on CUDA: newer builds add a kernel, older ones have none
CUDA_INT8_KERNEL = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", "CUDA")


class Int8Linear(nn.Module):
    """y = x Wᵀ + b with W stored as int8 (out_features, in_features) and a bf16 scale per output row.

    One fused kernel (aten._weight_int8pack_mm) reads the int8 weights directly: on the CPU when in_features is a
    multiple of INT8_KERNEL_WIDTH, and on CUDA where the build has one (CUDA_INT8_KERNEL). Otherwise the weights
    are converted to the activations' dtype for each matmul, and the scales applied to its output.
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
        if self.cpu_kernel and x.device.type == "cpu" or CUDA_INT8_KERNEL and x.device.type == "cuda":
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight, self.scales)
            y = y.view(*x.shape[:-1], self.out_features)
        else:  # scaled after the matmul: one (B, T, out) product, not a scaled copy of the weights
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias

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


def converted_to(model: nn.Module) -> str | None:
    """What a model's weights were converted to (int8, or the floating dtypes besides float32); None: all fp32."""
    if any(isinstance(module, Int8Linear) for module in model.modules()):
        return "int8"
    dtypes = {t.dtype for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()} - {torch.float32}
    return ", ".join(sorted(str(dtype).removeprefix("torch.") for dtype in dtypes)) or None


def to_precision(model: nn.Module, precision: str) -> nn.Module:
    """Convert a GPT in place for decoding at `precision` (one of DECODING_PRECISIONS) and return it, in eval mode.
    fp32 leaves it as it is; bf16 and int8 take fp32 weights, as every checkpoint holds. A model converted
    already is refused, and left as it is: converting again would quantize its rounded weights a second time."""
    if precision not in DECODING_PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(DECODING_PRECISIONS)}, got {precision!r}")
    if (converted := converted_to(model)) is not None:
        raise ValueError(f"model holds {converted} weights, converted for decoding already; to_precision takes a "
                         f"model with fp32 weights: convert the fp32 model (load its checkpoint again)")
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
