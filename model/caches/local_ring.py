"""What local layers add to a cache (model/designs/local_window.py): the local layers keep a ring of their own,
local_window slots long, beside the global layers' ring of block_size slots. WindowedKVCache holds both rings,
of any ring class (float or int8), and hands each layer its ring's view; a local layer's view carries its ring's
mask (LocalLayerKV). Spare slots (max_len - block_size) go to both rings, so that both take the same chunks and
rollbacks."""

import torch.nn as nn

from ..attention import causal_mask
from ..designs.local_window import LocalLayerKV, local_kv_layers
from ..kv_cache import CachePass
from .ring import CacheShape


class WindowedKVCache(nn.Module):
    """Two rings of one class: `ring` for the global cache layers, `local` for the local ones."""

    def __init__(self, ring: nn.Module, local: nn.Module, is_local: list[bool]):
        super().__init__()
        self.ring, self.local, self.is_local = ring, local, is_local
        self.abilities = ring.abilities
        # cache layer i: (whether it is local, its index in its ring)
        self.where = [(local_, is_local[:i].count(local_)) for i, local_ in enumerate(is_local)]

    batch_size = property(lambda self: self.ring.batch_size)
    max_len = property(lambda self: self.ring.max_len)
    dtype = property(lambda self: self.ring.dtype)
    device = property(lambda self: self.ring.device)
    window = property(lambda self: self.local.reach)

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes + self.local.nbytes

    @property
    def shape(self) -> CacheShape:
        """The global ring's, with the local layers counted and their window."""
        ring, local = self.ring.shape, self.local.shape
        return ring._replace(n_kv_layer=ring.n_kv_layer + local.n_kv_layer, local_window=local.reach)

    def __len__(self) -> int:
        return len(self.ring)

    def begin(self, t: int) -> CachePass:
        """The global ring's pass; a local layer gets the local ring's view, with its mask."""
        local = self.local.begin(t)  # first: it refuses longer chunks
        step = self.ring.begin(t)
        mask = local.mask
        if mask is None and t > 1:  # the plain rule: the filled slots in order
            mask = causal_mask(t, len(self.local), step.positions.device, reach=self.window)

        def layer(i: int):
            is_local, j = self.where[i]
            return LocalLayerKV(local.layer(j), mask) if is_local else step.layer(j)
        return CachePass(step.positions, step.mask, layer)

    def reset(self, n_pad=None) -> None:
        self.ring.reset(n_pad)
        self.local.reset(n_pad)

    def rollback(self, n: int) -> None:
        self.local.rollback(n)  # refuses whatever the global ring would refuse, and more: it wraps sooner
        self.ring.rollback(n)

    def read_filled(self, on: bool) -> None:
        self.ring.read_filled(on)
        self.local.read_filled(on)

    def longest_chunk(self) -> int:
        return min(self.ring.longest_chunk(), self.local.longest_chunk())

    def one_row(self) -> "WindowedKVCache":
        return WindowedKVCache(self.ring.one_row(), self.local.one_row(), self.is_local)

    def fill_from(self, other: "WindowedKVCache") -> None:
        self.ring.fill_from(other.ring)
        self.local.fill_from(other.local)


def new_windowed_cache(config, make_ring, max_len: int) -> WindowedKVCache:
    """The cache of a model with local layers: make_ring(n_kv_layer, max_len, reach) makes each ring."""
    is_local = local_kv_layers(config)
    n_local, window = sum(is_local), config.local_window
    return WindowedKVCache(make_ring(len(is_local) - n_local, max_len, config.block_size),
                           make_ring(n_local, window + max_len - config.block_size, window), is_local)
