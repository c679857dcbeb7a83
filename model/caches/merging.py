"""What merging adds to eviction (model/caches/evicting.py): the token a head drops is not lost, but averaged into the
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

from .evicting import TOVA, EvictingKVCache, EvictingLayerKV, evicting_shape


class ProtectedTOVA(TOVA):
    """TOVA, but the newest budget // 4 tokens stay: what leaves is merged, and the newest are rarely alike."""

    def claim(self, score, token, newest: int):
        return score.masked_fill(token > newest - token.size(-1) // 4, torch.inf)


class MergingLayerKV(EvictingLayerKV):
    """An evicting layer's view whose victim is merged into its likest kept key before the new token takes its slot."""

    def __init__(self, cache: "MergingKVCache", i: int, fed: int):
        super().__init__(cache, i, fed)
        self.count = getattr(cache, f"count{i}")  # (B, n_kv, S): how many tokens each slot stands for

    def update(self, k_new, v_new):
        fed, t = self.fed, k_new.size(2)
        if fed + t <= self.cache.max_len:
            self.count[..., fed:fed + t] = 1
        else:
            self.merge_victim(fed)
            self.count.scatter_(2, self.victim[..., None], 1.0)
        return super().update(k_new, v_new)

    def merge_victim(self, fed: int) -> None:
        """Fold each head's victim slot into the slot whose key is likest, unless it leaves the full cache's view."""
        k, v, count, token = (x.flatten(0, 1) for x in (self.k, self.v, self.count, self.token))  # a row per head
        heads, out = torch.arange(k.size(0), device=k.device), self.victim.flatten()
        k_out, v_out = k[heads, out].float(), v[heads, out].float()  # (B·n_kv, hs)
        likeness = F.cosine_similarity(k.float(), k_out[:, None], dim=-1)  # (B·n_kv, S)
        likeness[heads, out] = -torch.inf
        host = likeness.argmax(dim=-1)
        n_out = count[heads, out].masked_fill(token[heads, out] <= fed - self.cache.block_size, 0)  # dropped
        n_host = count[heads, host]
        share = (n_out / (n_host + n_out))[:, None]  # the leaving token's part of the mean
        for buffer, leaving in ((k, k_out), (v, v_out)):
            kept = buffer[heads, host].float()
            buffer[heads, host] = (kept + share * (leaving - kept)).to(buffer.dtype)
        count[heads, host] = n_host + n_out

    def scores(self, q, k):
        """Each slot's score plus log of the tokens it stands for."""
        group, S = q.size(1) // self.count.size(1), k.size(2)
        bias = self.count[..., :S].log().to(q.dtype).repeat_interleave(group, dim=1)  # (B, nh, S)
        return super().scores(q, k) + bias[:, :, None]


class MergingKVCache(EvictingKVCache):
    """An evicting cache (TOVA, the newest quarter kept) whose heads merge what they drop into what they keep."""

    policies = {"merge": ProtectedTOVA}
    view = MergingLayerKV

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        per_slot = self.token0.shape  # (B, n_kv, budget), as the policy's own buffers
        self.add_layer_buffers(("count",), per_slot, torch.float32, self.k0.device)  # the tokens each slot stands for

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.nbytes for t in self.layer_buffers("count"))


def new_merging_cache(model, batch_size: int, *, budget: int) -> MergingKVCache:
    """An empty merging cache for batch_size rows of model, each layer's key/value heads keeping `budget` slots."""
    return MergingKVCache(**evicting_shape(model, batch_size, budget), policy="merge", budget=budget,
                          block_size=model.config.block_size)
