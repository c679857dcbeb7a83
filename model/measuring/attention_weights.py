"""What each attention layer looked at: the weights softmax(q kᵀ / √hs) that SDPA computes and never returns.
TensorBoard draws them (training/summaries.py). Each layer's attend() is swapped, for one forward pass, for an
explicit one that keeps its weights."""

import contextlib
import math

import torch

from ..attention import causal_mask


@contextlib.contextmanager
def keeping_weights(model):
    """Within the block, every attention layer of the model attends explicitly and appends its weights
    (B, n_head, T_q, T_k) to the list it yields, one entry per layer and forward pass."""
    weights = []

    def explicit(q, k, v, attn_mask):
        mask = causal_mask(q.size(2), k.size(2), q.device) if attn_mask is None else attn_mask
        group = q.size(1) // k.size(1)  # query heads per key/value head (model/designs/grouped.py)
        k, v = (t.to(q.dtype).repeat_interleave(group, dim=1) for t in (k, v))
        w = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).masked_fill(~mask, float("-inf")).softmax(-1)
        weights.append(w)
        return w @ v

    def with_sink(sink):  # a learned sink's weights sum to less than 1 (model/designs/learned_sink.py)
        def explicit_with_sink(q, k, v, attn_mask):
            from ..designs.learned_sink import sink_attention
            y, w = sink_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask, sink)
            weights.append(w)
            return y
        return explicit_with_sink

    attentions = [block.attn for block in model.blocks]
    for attn in attentions:
        attn.attend = with_sink(attn.sink) if attn.sink is not None else explicit
    try:
        yield weights
    finally:
        for attn in attentions:
            del attn.attend


@torch.no_grad()
def attention_weights(model, idx: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's attention weights for idx (B, T): a list of n_layer tensors (B, n_head, T, T)."""
    with keeping_weights(model) as weights:
        model(idx)
    return weights
