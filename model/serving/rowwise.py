"""Batch invariance: each row of a decoding pass computed as it would be alone, to the last bit.

A matmul of M rows may sum in another order than one of a single row: BLAS libraries pick their kernels by M (on
some CPUs one for 1 row, another for 2 or 3, another from 4). A request's logits would then depend, by rounding,
on how many others decode beside it, and an int8 pool can turn such a rounding into a whole int8 step of a key.
So the engine's decoding passes run inside RowsAlone(), where every F.linear is a batched product of 1-row
matrices, and each row's attention reads as many keys in every pass (paged.py: PagedPass.of).

Prefill is not batch-invariant: attention's kernels also sum by how many queries a pass holds, so a prompt
prefilled beside others, or after a cached prefix, may differ from the same prompt alone in the last bits of its
keys. Rarely, such a bit moves a key of an int8 pool by one level.
"""

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def linear_by_rows(input, weight, bias=None):
    """F.linear, each row of input (..., in) computed as a matrix of its own."""
    rows = input.reshape(-1, 1, input.size(-1))  # (M, 1, in)
    y = torch.bmm(rows, weight.t().expand(rows.size(0), -1, -1)).view(*input.shape[:-1], weight.size(0))
    return y if bias is None else y + bias


class RowsAlone(TorchFunctionMode):
    """While inside, F.linear computes each row of its input as it would alone (linear_by_rows)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return (linear_by_rows if func is F.linear else func)(*args, **(kwargs or {}))
