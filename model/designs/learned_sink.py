"""What a learned attention sink adds (gpt-oss; StreamingLLM trained a sink token for the same end): one trained
logit per head that joins every query's softmax as a score of a key that is not there. Attention weights then need
not sum to 1, so a head can attend to nothing, and it needs no real token (often the first one) as a place to put
its weight. The sink holds no value: the output is Σ_j w_j v_j with softmax taken over [scores, sink], the sink's
own weight dropped.

The sink is a parameter, never cached: every cache path serves it as is. Attention is written out here (the
scores, a column for the sink, softmax), since SDPA takes no extra column; a cache that attends itself (the int8
cache, model/caches/int8.py) is handed the sink and adds the same column.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention import causal_mask


def sink_attention(q, k, v, mask, sink, dropout_p: float = 0.0):
    """softmax([q kᵀ / √hs, sink], masked)[..., :-1] v. q (B, nh, T_q, hs); k, v (B, n_kv, T_k, hs); mask bool,
    broadcast to (B, nh, T_q, T_k), or None for causal; sink (nh,). Returns (y (B, nh, T_q, hs_v), weights)."""
    B, nh, T_q, hs = q.shape
    n_kv, T_k = k.size(1), k.size(2)
    if mask is None and T_q > 1:
        mask = causal_mask(T_q, T_k, q.device)
    q = q.reshape(B, n_kv, nh // n_kv * T_q, hs)  # the g query heads of a key/value head as g * T_q rows
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)  # (B, n_kv, g * T_q, T_k)
    if mask is not None:
        rows = mask.size(0) if mask.dim() == 4 else 1
        scores = scores.masked_fill(~mask.expand(rows, nh, T_q, T_k).reshape(rows, n_kv, -1, T_k), float("-inf"))
    sink = sink.to(scores.dtype).view(1, n_kv, nh // n_kv, 1, 1).expand(B, -1, -1, T_q, 1).reshape(B, n_kv, -1, 1)
    weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]  # a query that sees no key: all 0
    y = F.dropout(weights, dropout_p) @ v  # (B, n_kv, g * T_q, hs)
    return y.view(B, nh, T_q, -1), weights.view(B, nh, T_q, T_k)


class LearnedSink:
    """Mixed into an attention class (model/designs/layers.py): a trained sink logit per head."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.sink = nn.Parameter(torch.zeros(config.n_head))  # 0: a key scored 0, as likely as any at the start

    def attend(self, q, k, v, attn_mask):
        dropout_p = self.attn_dropout if self.training else 0.0
        with torch.autocast(q.device.type, enabled=False):  # in q's dtype, as the plain attention computes
            return sink_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask, self.sink, dropout_p)[0]
