"""What grouped-query attention adds to the plain attention (model/attention.py): n_kv_head key/value heads for
n_head query heads, each read by a group of n_head / n_kv_head query heads (Llama 2 70B, Mistral). With
n_kv_head = 1 it is multi-query attention. The cache holds n_kv_head heads, not n_head: a smaller cache to read at
every step. The projection's widths change; SDPA's enable_gqa lets each group read its key/value head. A one-token
step instead puts a group's query heads side by side, as the queries of one head: on the CPU, enable_gqa copies
each key/value head once per query head (docs/benchmarks.md)."""

import torch.nn.functional as F

from ..attention import CausalSelfAttention, no_autocast


class GroupedQueryAttention(CausalSelfAttention):
    """CausalSelfAttention whose keys and values have config.n_kv_head heads."""

    def qkv_widths(self, config) -> list[int]:
        kv_width = config.n_kv_head * config.head_dim
        return [config.n_embd, kv_width, kv_width]

    def attend(self, q, k, v, attn_mask):
        """q (B, nh, T_q, hs), k and v (B, n_kv, T_k, hs) -> (B, nh, T_q, hs). One new token (T_q = 1): the g
        query heads of a group become g queries of its key/value head, (B, n_kv, g, hs), and its mask, one row per
        batch row or one for all, reaches them all."""
        B, nh, T_q, hs = q.shape
        mask_shared_by_heads = attn_mask is None or attn_mask.dim() <= 2 or (attn_mask.dim() == 4
                                                                              and attn_mask.size(1) == 1)
        if k.size(1) == nh or T_q > 1 or not mask_shared_by_heads:
            return super().attend(q, k, v, attn_mask)
        dropout_p = self.attn_dropout if self.training else 0.0
        with no_autocast(q.device):  # in q's dtype, as attention_dtype says
            y = F.scaled_dot_product_attention(q.reshape(B, k.size(1), -1, hs), k.to(q.dtype), v.to(q.dtype),
                                               attn_mask=attn_mask, dropout_p=dropout_p)  # (B, n_kv, g, hs_v)
        return y.reshape(B, nh, 1, -1)
