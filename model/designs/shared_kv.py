"""What shared layers add (cross-layer KV sharing, as in Brandon et al. 2024): each group of kv_share adjacent
layers reads one set of keys and values. The group's first layer projects them, as the plain attention does
(with grouped queries when n_kv_head < n_head, grouped.py); the others project queries only and read the first's.
The cache holds one layer per group: n_layer / kv_share of them."""

from ..attention import rotate
from .grouped import GroupedQueryAttention


class SharedKVAttention(GroupedQueryAttention):
    """A group's first layer (reads=None), which keeps its keys and values for the group; or a later layer, which
    projects queries only and reads the keys and values of `reads`, the group's first."""

    def __init__(self, config, kv_layer: int, reads: "SharedKVAttention | None" = None):
        self.reads_from = [reads] if reads is not None else []  # a list: the first layer is not a submodule here
        super().__init__(config, kv_layer)

    def qkv_widths(self, config) -> list[int]:
        return [config.n_embd] if self.reads_from else super().qkv_widths(config)

    def project(self, x, rope, kv):
        if not self.reads_from:
            q, k, v = super().project(x, rope, kv)
            if kv is None:  # without a cache the group reads them here; with one, from the cache
                self.kept = k, v
            return q, k, v
        B, T, _ = x.shape
        q = self.qkv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        q = q if rope is None else rotate(q, *rope)
        k, v = kv.read() if kv is not None else self.reads_from[0].kept  # already turned and cached
        return q, k, v
