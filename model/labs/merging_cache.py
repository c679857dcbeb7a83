"""What merging adds to eviction (evicting_cache.py): the token a head drops is not lost, but averaged into the
kept key most like it. CaM (Zhang et al., 2024) and D2O (Wan et al., 2024) merge evicted tokens likewise.

    cache = new_merging_cache(model, batch_size=1, budget=32)
    ids = generate(model, prompt, 10_000, cache=cache)

A slot then stands for n tokens. Its key and value are their means, weighted by how many tokens each part held,
and its attention score gets log n. So n tokens with equal keys and values weigh exactly what they weighed apart:
exp(s + log n) = n exp(s). The leaving token goes to the kept key of its head with the highest cosine similarity.

Which token leaves is TOVA's choice (the newest query's least weight), with the newest budget // 4 tokens kept.
A token that leaves the full cache's view (block_size back) is dropped, as the full cache drops it, so a budget
of block_size is still the full cache. Tokens merged into a slot stay while that slot stays.
"""

import torch
import torch.nn.functional as F

from .evicting_cache import TOVA, EvictingKVCache, EvictingLayerKV, evicting_shape


class ProtectedTOVA(TOVA):
    """TOVA, but the newest budget // 4 tokens stay: what leaves is merged, and the newest are rarely alike."""

    def claim(self, score, token, newest: int):
        return score.masked_fill(token > newest - token.size(-1) // 4, torch.inf)


class MergingLayerKV(EvictingLayerKV):
    """An evicting layer's view whose victim is merged into its likest kept key before the new token takes its slot."""

    def __init__(self, cache: "MergingKVCache", i: int):
        super().__init__(cache, i)
        self.count = getattr(cache, f"count{i}")  # (B, n_kv, S): how many tokens each slot stands for

    def update(self, k_new, v_new):
        fed, t = int(self.cache.pos), k_new.size(2)
        if fed + t <= self.cache.max_len:
            self.count[..., fed:fed + t] = 1
        else:
            self.merge_victim(fed)
            self.count.scatter_(2, self.victim[..., None], 1.0)
        return super().update(k_new, v_new)

    def merge_victim(self, fed: int) -> None:
        """Fold each head's victim slot into the slot whose key is likest, unless it leaves the full cache's view."""
        slot = self.victim[..., None]  # (B, n_kv, 1)
        wide = slot[..., None].expand(-1, -1, 1, self.k.size(-1))  # (B, n_kv, 1, hs)
        k_out, v_out = self.k.gather(2, wide).float(), self.v.gather(2, wide).float()
        likeness = F.cosine_similarity(self.k.float(), k_out, dim=-1).scatter(2, slot, -torch.inf)  # (B, n_kv, S)
        host = likeness.argmax(dim=-1, keepdim=True)  # (B, n_kv, 1)
        host_wide = host[..., None].expand_as(wide)
        n_out, n_host = self.count.gather(2, slot), self.count.gather(2, host)
        n_out = n_out.masked_fill(self.token.gather(2, slot) <= fed - self.cache.block_size, 0)  # dropped, as there
        share = (n_out / (n_host + n_out))[..., None]  # (B, n_kv, 1, 1): the leaving token's part of the mean
        for buffer, out in ((self.k, k_out), (self.v, v_out)):
            kept = buffer.gather(2, host_wide).float()
            buffer.scatter_(2, host_wide, (kept + share * (out - kept)).to(buffer.dtype))
        self.count.scatter_(2, host, n_host + n_out)

    def scores(self, q, k):
        """Each slot's score plus log of the tokens it stands for."""
        group, S = q.size(1) // self.count.size(1), k.size(2)
        bias = self.count[..., :S].log().to(q.dtype).repeat_interleave(group, dim=1)  # (B, nh, S)
        return super().scores(q, k) + bias[:, :, None]


class MergingKVCache(EvictingKVCache):
    """An evicting cache (TOVA, the newest quarter kept) whose heads merge what they drop into what they keep."""

    policies = {"merge": ProtectedTOVA}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_layer_buffers(("count",), self.victim0.shape + (self.max_len,), torch.float32, self.k0.device)

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.nbytes for t in self.layer_buffers("count"))

    def layer(self, i: int, slots, n_read) -> MergingLayerKV:
        self.check_eager()
        return MergingLayerKV(self, i)

    def one_row(self, model) -> "MergingKVCache":
        return new_merging_cache(model, 1, budget=self.max_len)


def new_merging_cache(model, batch_size: int, *, budget: int) -> MergingKVCache:
    """An empty merging cache for batch_size rows of model, each layer's key/value heads keeping `budget` slots."""
    return MergingKVCache(**evicting_shape(model, batch_size, budget), policy="merge", budget=budget,
                          block_size=model.config.block_size)
