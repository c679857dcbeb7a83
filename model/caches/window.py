"""A sliding window: a cache of a fixed budget that keeps the last `budget` tokens of each row in a ring, for
generation of any length. Like the sink cache (sinks.py) with no sinks, each token keeps its place in the text:
rotary positions count distances, and the window's keep theirs; learned positions cannot move with a key, so once
the window is full each new token takes the last place in it, budget - 1.

    cache = new_window_cache(model, batch_size=1, budget=64)
    ids = generate(model, prompt, 10_000, cache=cache)
"""

from ..checks import is_integer
from ..kv_cache import CachePass, KVCache
from .budget import BudgetRules
from .ring import cache_shape


class WindowKVCache(BudgetRules, KVCache):
    """The last max_len tokens, token n in slot n % max_len. rotary: whether positions are the tokens' own."""

    kind, keeps, moves = "a window cache", "numbers each row's tokens alike", "each new token takes the oldest slot"

    def __init__(self, n_kv_layer: int, batch_size: int, n_kv_head: int, budget: int, head_dim: int, dtype, device,
                 *, rotary: bool):
        super().__init__(n_kv_layer, batch_size, n_kv_head, budget, head_dim, dtype, device)
        self.rotary = rotary

    def begin(self, t: int) -> CachePass:
        fed, new = self.take(t)
        if fed + t <= self.max_len:  # filling up: the plain cache's rule
            return CachePass(new, None, lambda i: self.layer(i, new, fed + t))
        positions = new if self.rotary else self.slot_ids[-1:]  # one token, which sees every slot
        return CachePass(positions, None, lambda i: self.layer(i, new % self.max_len, None))

    def one_row(self) -> "WindowKVCache":
        return WindowKVCache(self.n_kv_layer, 1, self.k0.size(1), self.max_len, self.head_dim, self.dtype,
                             self.device, rotary=self.rotary)


def new_window_cache(model, batch_size: int, *, budget: int) -> WindowKVCache:
    """An empty cache for batch_size rows of model that keeps the last `budget` tokens."""
    c = model.config
    if c.kv_latent is not None or c.local_window is not None:
        raise ValueError("the window keeps whole keys in a budget of its own: it needs neither latent attention nor "
                         "local layers")
    if not (is_integer(budget) and 1 <= budget <= c.block_size):
        raise ValueError(f"budget must be an integer from 1 to block_size={c.block_size}, got {budget!r}")
    shape = cache_shape(model, batch_size)
    return WindowKVCache(shape["n_kv_layer"], batch_size, shape["n_kv_head"], budget, shape["head_dim"],
                         shape["dtype"], shape["device"], rotary=c.pos_emb == "rope")
