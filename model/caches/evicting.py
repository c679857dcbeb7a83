"""What eviction adds to a cache of a fixed budget (model/caches/sinks.py keeps fixed tokens): each layer's key/value
heads keep the tokens their attention scores say matter, and drop one per step once full.

    cache = new_evicting_cache(model, batch_size=1, policy="h2o", budget=32)
    ids = generate(model, prompt, 10_000, cache=cache)

Policies, each scoring the keys of every key/value head from its query heads' attention weights (their mean):
- h2o (Zhang et al., 2023, "heavy hitters"): the weight each key has received since it came, summed over queries.
  The newest budget // 2 tokens stay; of the others, the one with the least goes.
- tova (Oren et al., 2024): the newest query's weight alone; the key with the least goes, the newest included.

Once full, a step writes its token into the slot its head chose at the end of the step before, so that attention
always sees `budget` keys, as a sliding window of `budget` slots does. Different heads keep different tokens.
The policies choose within what the full cache sees: a token block_size back leaves first, as it leaves the ring.
So tokens keep their own positions, no distance exceeds what the model trained on, and a budget of block_size is
the full cache. Attention here is explicit, since SDPA never returns its weights. Rows start together (no left
padding). Once full, the cache takes one token per pass; it decodes eagerly and cannot roll back.
"""

import math

import torch

from ..attention import causal_mask
from ..checks import is_integer
from ..kv_cache import CachePass, KVCache
from .budget import BudgetRules
from .ring import cache_shape


class H2O:
    """Keep the heavy hitters: the most attention received so far, and the newest budget // 2 tokens."""

    def observe(self, score, weights):
        """score (B, n_kv, S) per slot; weights (B, n_kv, t, S) of this pass's queries."""
        score += weights.sum(dim=2)

    def claim(self, score, token, newest: int):
        """Each slot's claim to stay (the least goes): score, token (B, n_kv, S) its number, newest the last's."""
        return score.masked_fill(token > newest - token.size(-1) // 2, math.inf)  # the newest budget // 2 stay


class TOVA:
    """Keep what the newest query attends: the token with its least weight goes."""

    def observe(self, score, weights):
        score.copy_(weights[:, :, -1])

    def claim(self, score, token, newest: int):
        return score


POLICIES = {"h2o": H2O, "tova": TOVA}


class EvictingLayerKV:
    """One layer's view of an evicting cache during one forward pass: update() stores, attend() scores and chooses."""

    def __init__(self, cache: "EvictingKVCache", i: int, fed: int):
        self.cache, self.fed = cache, fed  # fed: the tokens before this pass
        self.k, self.v, self.token, self.score, self.victim = (
            getattr(cache, f"{name}{i}") for name in ("k", "v", "token", "score", "victim"))

    def update(self, k_new, v_new):
        """Store the new keys/values (B, n_kv, t, hs); return the kept ones."""
        c, t, hs, fed = self.cache, k_new.size(2), k_new.size(-1), self.fed
        if fed + t <= c.max_len:  # filling up: token n in slot n
            self.k[:, :, fed:fed + t] = k_new
            self.v[:, :, fed:fed + t] = v_new
            self.token[..., fed:fed + t] = torch.arange(fed, fed + t, device=k_new.device)
            self.score[..., fed:fed + t] = 0
            return self.k[:, :, :fed + t], self.v[:, :, :fed + t]
        slot = self.victim[..., None]  # (B, n_kv, 1): each head's freed slot
        self.k.scatter_(2, slot[..., None].expand(-1, -1, 1, hs), k_new.to(self.k.dtype))
        self.v.scatter_(2, slot[..., None].expand(-1, -1, 1, hs), v_new.to(self.v.dtype))
        self.token.scatter_(2, slot, fed)
        self.score.scatter_(2, slot, 0.0)
        return self.k, self.v

    def scores(self, q, k):
        """q kᵀ / √hs: q (B, nh, t, hs), k (B, nh, S, hs) -> (B, nh, t, S)."""
        return q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))

    def attend(self, q, k, v, attn_mask, sink=None):
        """softmax(q kᵀ / √hs) v, explicitly, and the policy's next victims: q (B, nh, t, hs) -> (B, nh, t, hs)."""
        B, nh, t, hs = q.shape
        n_kv, S = k.size(1), k.size(2)
        group = nh // n_kv
        k, v = (x.to(q.dtype).repeat_interleave(group, dim=1) for x in (k, v))
        scores = self.scores(q, k)  # (B, nh, t, S)
        if t > 1:
            scores = scores.masked_fill(~causal_mask(t, S, q.device), -math.inf)
        weights = scores.softmax(dim=-1)
        c = self.cache
        c.policy.observe(self.score[..., :S], weights.view(B, n_kv, group, t, S).mean(dim=2).float())
        if S == c.max_len:  # full: the slot the next token takes
            newest = self.fed + t - 1
            claim = c.policy.claim(self.score, self.token, newest)
            leaving = self.token <= newest + 1 - c.block_size  # out of the full cache's view at the next token
            self.victim.copy_(claim.masked_fill(leaving, -math.inf).argmin(dim=-1))
        return weights @ v


class EvictingKVCache(BudgetRules, KVCache):
    """budget slots per layer and key/value head; a policy (POLICIES) chooses which token each head drops."""

    kind, keeps, moves = "an evicting cache", "numbers each row's tokens alike", "each needs the step before's victim"
    policies = POLICIES  # the policies it takes, by name
    view = EvictingLayerKV  # a layer's view, for one pass

    def __init__(self, n_kv_layer: int, batch_size: int, n_kv_head: int, head_dim: int, dtype=torch.float32,
                 device=None, *, policy: str, budget: int, block_size: int):
        super().__init__(n_kv_layer, batch_size, n_kv_head, budget, head_dim, dtype, device)
        self.policy_name, self.policy, self.block_size = policy, self.policies[policy](), block_size
        per_slot = (batch_size, n_kv_head, budget)
        self.add_layer_buffers(("token",), per_slot, torch.long, device)  # the number of the token each slot holds
        self.add_layer_buffers(("score",), per_slot, torch.float32, device)
        self.add_layer_buffers(("victim",), per_slot[:2], torch.long, device)

    @property
    def nbytes(self) -> int:
        """Bytes held: keys and values, and what the policy keeps per slot."""
        return super().nbytes + sum(t.nbytes for name in ("token", "score", "victim")
                                    for t in self.layer_buffers(name))

    def begin(self, t: int) -> CachePass:
        fed, new = self.take(t)
        return CachePass(new, None, lambda i: self.view(self, i, fed))

    def one_row(self) -> "EvictingKVCache":
        return type(self)(self.n_kv_layer, 1, self.k0.size(1), self.head_dim, self.dtype, self.device,
                          policy=self.policy_name, budget=self.max_len, block_size=self.block_size)


def new_evicting_cache(model, batch_size: int, *, policy: str, budget: int) -> EvictingKVCache:
    """An empty cache for batch_size rows of model, each layer's key/value heads keeping `budget` tokens."""
    if policy not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}: choose one of {', '.join(POLICIES)}")
    return EvictingKVCache(**evicting_shape(model, batch_size, budget), policy=policy, budget=budget,
                           block_size=model.config.block_size)


def evicting_shape(model, batch_size: int, budget: int) -> dict:
    """An evicting cache's shape for batch_size rows of model, once the model and budget are known to suit it."""
    c = model.config
    if c.pos_emb != "rope" or not (c.kv_share == 1 and c.local_window is None and c.kv_latent is None
                                   and not c.learned_sink):
        raise ValueError("an evicting cache leaves gaps between the tokens it keeps, and attends itself: it needs "
                         "pos_emb=rope (positions that count distances), and plain or grouped attention")
    if not (is_integer(budget) and 2 <= budget <= c.block_size):
        raise ValueError(f"budget must be an integer from 2 to block_size={c.block_size}, got {budget!r}")
    shape = cache_shape(model, batch_size)
    del shape["max_len"]
    return shape
