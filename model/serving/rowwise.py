"""Batch invariance: each row of an engine pass computed as it would be alone, to the last bit.

A matmul of M rows may sum in another order than one of a single row: BLAS libraries pick their kernels by M (on
some CPUs one for 1 row, another for 2 or 3, another from 4), and attention's kernels sum by how many queries a
pass holds. A request's logits would then depend, by rounding, on what else the engine runs, and an int8 pool can
turn such a rounding into a whole int8 step of a key.

So every pass of the engine, prefill included, feeds one token per row (model/serving/engine.py): a prompt's
tokens are rows of their own, each reading its keys as a decoding step would, and each row's attention reads as
many keys in every pass (model/serving/paged.py: PagedPass.of). Inside RowsAlone every product of the pass is
computed one row at a time: F.linear and the int8 weights' packed kernel as 1-row matrices, an einsum per row of
its first operand, a batched matmul (both operands 3-d or more) as one bmm of matrices laid out alike whatever the
batch holds. Attention's own kernel takes each row's queries and keys apart already. Any other product raises
UnroutedProduct, so that none escapes unnoticed.

A mode puts Python between every operation of a pass, which for a small model costs a large share of its time
(docs/benchmarks.md). So an engine's eager passes go through RowsRoute: the first under RowsAlone, which counts what
it routes; when that was only the model's nn.Linear modules, the later passes swap those modules' forward for
linear_by_rows instead, with no mode. The same bits either way: both compute each linear as linear_by_rows does.
A captured bucket pass (buckets.py) keeps the mode, whose cost it pays once, at capture.
"""

import collections
import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

INT8_PACKED = torch.ops.aten._weight_int8pack_mm  # model/decoding/quantize.py: Int8Linear's fused kernel
BATCHED = {"matmul", "__matmul__", "__rmatmul__", "bmm"}  # per row when both operands are batched (3-d or more)
# products that sum rows together in one matrix: RowsAlone refuses them
UNROUTED = {"mm", "addmm", "mv", "addmv", "dot", "vdot", "inner", "outer", "ger", "addr", "tensordot", "baddbmm",
            "addbmm", "chain_matmul", "multi_dot", "bilinear", "conv1d", "conv2d", "conv3d", "kron",
            "_addmm_activation"}


class UnroutedProduct(RuntimeError):
    """A pass inside RowsAlone called a product that it cannot compute one row at a time."""


def linear_by_rows(input, weight, bias=None):
    """F.linear, each row of input (..., in) computed as a matrix of its own."""
    rows = input.reshape(-1, 1, input.size(-1))  # (M, 1, in)
    y = torch.bmm(rows, weight.t().expand(rows.size(0), -1, -1)).view(*input.shape[:-1], weight.size(0))
    return y if bias is None else y + bias


def int8_packed_by_rows(x, weight, scales):
    """The int8 packed kernel (x (M, in) -> (M, out)), one row of x at a time."""
    return torch.cat([INT8_PACKED(x[i:i + 1], weight, scales) for i in range(x.size(0))])


def einsum_by_rows(equation, *operands):
    """torch.einsum per index of the first operand's first dimension, which must lead the output and no other
    operand: each row of a pass alone."""
    operands = operands[0] if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
    inputs, output = equation.replace(" ", "").split("->")
    first, *others = inputs.split(",")
    row = first[:1]
    if not row.isalpha() or not output.startswith(row) or any(row in other for other in others):
        raise UnroutedProduct(f"einsum {equation!r} has no dimension of rows that RowsAlone can split")
    head, *rest = operands
    return torch.cat([torch.einsum(equation, head[i:i + 1], *rest) for i in range(head.size(0))])


def one_layout(t: torch.Tensor) -> torch.Tensor:
    """t as row-major matrices, or as column-major ones when it is so already: a layout that its batch keeps
    whatever it holds. A strided view of one row merges into a batch of matrices that many rows would be copied to."""
    return t if t.transpose(-2, -1).is_contiguous() else t.contiguous()


def matmul_by_rows(a, b):
    """A batched matmul as one bmm of matrices laid out alike, whatever the batch holds, so that every one takes
    the same kernel."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a, b = (one_layout(t.expand(*batch, *t.shape[-2:])).reshape(-1, *t.shape[-2:]) for t in (a, b))
    return torch.bmm(a, b).view(*batch, a.size(-2), b.size(-1))


def batched(args) -> bool:
    """Whether a matmul's operands are both batched: torch folds a 2-d one's partner into one matrix of rows."""
    tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
    return len(tensors) == 2 and all(t.dim() >= 3 for t in tensors)


class RowsAlone(TorchFunctionMode):
    """While inside, every product computes each row of a pass as it would alone; UnroutedProduct for those that
    cannot. routed: how many products of each kind it computed by rows."""

    def __init__(self):
        super().__init__()
        self.routed = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            self.routed["linear"] += 1
            return linear_by_rows(*args, **kwargs)
        if getattr(func, "_overloadpacket", func) is INT8_PACKED:
            self.routed["int8"] += 1
            return int8_packed_by_rows(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "einsum":
            self.routed["einsum"] += 1
            return einsum_by_rows(*args, **kwargs)
        if name in BATCHED and batched(args):
            self.routed["matmul"] += 1
            return matmul_by_rows(*(args[::-1] if name == "__rmatmul__" else args[:2]))
        if name in BATCHED or name in UNROUTED:
            raise UnroutedProduct(f"{name} inside RowsAlone: compute it one row at a time (model/serving/rowwise.py)")
        return func(*args, **kwargs)


class RowsRoute:
    """A model's passes, each row computed as it would be alone, by the cheapest rule that holds. The first pass
    runs under RowsAlone. If every product it routed was the F.linear of one of the model's nn.Linear modules, the
    later passes swap those modules' forward for linear_by_rows and run with no mode. Which products a pass computes
    follows from the model and its cache's kind, so one route serves one model over one pool. The swap is made on
    the model itself: one pass at a time."""

    def __init__(self, model):
        self.linears = [m for m in model.modules() if type(m) is nn.Linear]  # a subclass may compute otherwise
        self.mode_free = False  # whether passes need no mode: learned from the first

    @contextlib.contextmanager
    def alone(self):
        """While inside, a pass computes each row as it would alone."""
        if self.mode_free:
            with linears_by_rows(self.linears):
                yield
            return
        mode, called = RowsAlone(), collections.Counter()
        hooks = [m.register_forward_pre_hook(lambda *_: called.update(["linear"])) for m in self.linears]
        try:
            with mode:
                yield
        finally:
            for hook in hooks:
                hook.remove()
        self.mode_free = mode.routed == called  # the modules' F.linear calls, and nothing else


@contextlib.contextmanager
def linears_by_rows(linears: list[nn.Linear]):
    """While inside, each of these modules computes F.linear as linear_by_rows does."""
    for module in linears:
        module.forward = functools.partial(linear_module_by_rows, module)
    try:
        yield
    finally:
        for module in linears:
            del module.forward


def linear_module_by_rows(module: nn.Linear, input):
    return linear_by_rows(input, module.weight, module.bias)
