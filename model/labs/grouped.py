"""What grouped-query attention adds to the plain attention (model/attention.py): n_kv_head key/value heads for
n_head query heads, each read by a group of n_head / n_kv_head query heads (Llama 2 70B, Mistral). With
n_kv_head = 1 it is multi-query attention. The cache holds n_kv_head heads, not n_head: a smaller cache to read at
every step. Only the projection's widths change; SDPA's enable_gqa lets each group read its key/value head."""

from ..attention import CausalSelfAttention


class GroupedQueryAttention(CausalSelfAttention):
    """CausalSelfAttention whose keys and values have config.n_kv_head heads."""

    def qkv_widths(self, config) -> list[int]:
        kv_width = config.n_kv_head * config.head_dim
        return [config.n_embd, kv_width, kv_width]
