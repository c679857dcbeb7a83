"""What attention sinks add to a cache of a fixed budget (budget.py), after StreamingLLM (Xiao et al., 2023): it
keeps the first `sinks` tokens of a text and a ring of its last `window` tokens, for generation of any length.
sinks=0 is the sliding window of the same budget (window.py).

Models park attention they do not need on the first tokens. A window that drops them moves that weight onto
tokens that never had it, and the text falls apart; keeping a few restores it. StreamingLLM gives tokens their
positions within the cache, so that no distance exceeds what the model trained on.
- Rotary positions: only distances count, and the window's keep theirs. The sinks are the exception: once the
  cache is full, sink i sits sinks + window - 1 - i before the newest token. So their keys, cached turned to
  positions 0 .. sinks - 1, turn on by how far the window has moved at every step (a rotation's angles add up).
- Learned positions: a position is part of every key and cannot move. So once the cache is full, each new token
  takes the last place in the cache, sinks + window - 1, as its position; the cached keys keep theirs.

    cache = new_sink_cache(model, batch_size=1, sinks=4, window=60)
    ids = generate(model, prompt, 10_000, cache=cache)

Rows start together (no left padding). Once full, the cache takes one token per pass; it decodes eagerly and
cannot roll back.
"""

import torch

from ..attention import rotary, rotate
from ..checks import is_integer
from ..kv_cache import CachePass, KVCache
from .budget import BudgetRules
from .ring import cache_shape

SINKS = 4  # StreamingLLM's count: the first tokens kept by default


class SinkLayerKV:
    """One layer's view of a sink cache during one forward pass (LayerKV's update and read)."""

    def __init__(self, cache: "SinkKVCache", i: int, slots: torch.Tensor, n_read: int | None, first: int):
        self.cache, self.slots, self.n_read, self.first = cache, slots, n_read, first  # first: the first new token
        self.k, self.v, self.k_sink = (getattr(cache, f"{name}{i}") for name in ("k", "v", "k_sink"))

    def update(self, k_new, v_new):
        """Write the new keys/values (B, n_kv, t, hs) into their slots, turn the sinks' keys to where they sit
        now; return what attention reads."""
        c, t = self.cache, k_new.size(2)
        first, S = self.first, c.sinks
        if first < S and c.turn_sinks:  # new sinks: their keys as they came, turned to their own positions
            n = min(S - first, t)
            self.k_sink[:, :, first:first + n] = k_new[:, :, :n].to(self.k_sink.dtype)
        self.k.index_copy_(2, self.slots, k_new.to(self.k.dtype))
        self.v.index_copy_(2, self.slots, v_new.to(self.v.dtype))
        moved = first + t - c.max_len  # how far the newest token is past the last slot's position
        if moved > 0 and S and c.turn_sinks:
            cos, sin = rotary(torch.tensor([moved], device=k_new.device), k_new.size(-1))
            self.k[:, :, :S] = rotate(self.k_sink, cos, sin)
        return self.read()

    def read(self):
        """The keys and values attention reads (a shared layer reads what its group's first wrote)."""
        return self.k[:, :, :self.n_read], self.v[:, :, :self.n_read]


class SinkKVCache(BudgetRules, KVCache):
    """Slots 0 .. sinks - 1 hold the first tokens; the other `window` slots are a ring of the last ones."""

    kind, keeps, moves = "a sink cache", "keeps each row's first tokens", "each new token moves the sinks"

    def __init__(self, n_kv_layer: int, batch_size: int, n_kv_head: int, head_dim: int, dtype=torch.float32,
                 device=None, *, sinks: int, window: int, turn_sinks: bool):
        super().__init__(n_kv_layer, batch_size, n_kv_head, sinks + window, head_dim, dtype, device)
        self.sinks, self.window, self.turn_sinks = sinks, window, turn_sinks  # turn_sinks: rotary positions
        self.add_layer_buffers(("k_sink",), (batch_size, n_kv_head, sinks if turn_sinks else 0, head_dim), dtype,
                               device)

    def begin(self, t: int) -> CachePass:
        fed, new = self.take(t)
        if fed + t <= self.max_len:  # filling up: token n in slot n, the plain cache's rule
            return CachePass(new, None, lambda i: SinkLayerKV(self, i, new, fed + t, fed))
        slot = self.sinks + (new - self.sinks) % self.window  # one token sees every slot
        positions = new if self.turn_sinks else self.slot_ids[-1:]  # learned: the cache's last place
        return CachePass(positions, None, lambda i: SinkLayerKV(self, i, slot, None, fed))

    def one_row(self) -> "SinkKVCache":
        return SinkKVCache(self.n_kv_layer, 1, self.k0.size(1), self.head_dim, self.dtype, self.device,
                           sinks=self.sinks, window=self.window, turn_sinks=self.turn_sinks)


def new_sink_cache(model, batch_size: int, *, sinks: int, window: int) -> SinkKVCache:
    """An empty cache for batch_size rows of model that keeps the first `sinks` tokens and the last `window`."""
    c = model.config
    if c.kv_latent is not None or c.local_window is not None:
        raise ValueError("sinks and the window keep whole keys in a budget of their own: they need neither latent "
                         "attention nor local layers")
    if not (is_integer(sinks) and sinks >= 0 and is_integer(window) and window >= 1):
        raise ValueError(f"sinks must be an integer >= 0 and window one >= 1, got sinks={sinks!r}, window={window!r}")
    if sinks + window > c.block_size:
        raise ValueError(f"sinks + window = {sinks + window} is more than the block_size={c.block_size} tokens the "
                         f"model sees: the full cache holds them all")
    shape = cache_shape(model, batch_size)
    del shape["max_len"]
    return SinkKVCache(**shape, sinks=sinks, window=window, turn_sinks=c.pos_emb == "rope")


def new_budget_sink_cache(model, batch_size: int, *, budget: int) -> SinkKVCache:
    """A sink cache of `budget` slots: the first SINKS tokens and the last budget - SINKS."""
    if is_integer(budget) and budget < SINKS + 1:
        raise ValueError(f"a budget of {budget!r} slots leaves none for the last tokens beside {SINKS} sinks: give "
                         f"at least {SINKS + 1}")
    return new_sink_cache(model, batch_size, sinks=SINKS, window=budget - SINKS)
