"""What interleaved local and global layers add (Mistral's sliding window, Gemma 2 and 3's local and global layers):
a local layer attends only its last local_window tokens, and caches only those; a global layer attends block_size.

model.window_pattern is tiled over the layers from the first: "LLG" makes layers 2, 5, 8 ... global and the rest
local. A local layer's cache is a ring of local_window slots, whose reach is local_window (model/decoding/ring_cache.py),
beside the global layers' ring of block_size slots. WindowedKVCache keeps both and hands each layer its own view:
LocalLayerKV, which carries the local ring's mask. Without a cache, or with the plain in-order KVCache, a local
layer narrows the mask it is given to a band of local_window keys (causal_mask's reach).
"""

from typing import NamedTuple

import torch

from ..attention import causal_mask
from ..decoding.checks import is_integer
from ..caches.int8 import Int8KVCache
from ..decoding.ring_cache import RingKVCache

LOCAL, GLOBAL = "L", "G"


def local_layers(config) -> list[bool]:
    """Whether each layer is local: window_pattern tiled over n_layer layers."""
    pattern = config.window_pattern
    return [pattern[i % len(pattern)] == LOCAL for i in range(config.n_layer)]


def local_kv_layers(config) -> list[bool]:
    """Whether each cache layer (one per kv_share group) is local."""
    return local_layers(config)[::config.kv_share]


def check_window_pattern(config) -> None:
    """A ValueError naming what is wrong with window_pattern or local_window."""
    pattern, window = config.window_pattern, config.local_window
    if not (isinstance(pattern, str) and pattern and set(pattern) <= {LOCAL, GLOBAL}):
        raise ValueError(f"window_pattern must be letters {LOCAL} (local) and {GLOBAL} (global), tiled over the "
                         f"layers, got {pattern!r}")
    if LOCAL not in pattern:
        if window is not None:
            raise ValueError(f"local_window applies to local layers, and window_pattern {pattern!r} has none: drop "
                             f"local_window, or give window_pattern an {LOCAL}")
        return
    if not is_integer(window) or not 1 <= window < config.block_size:
        raise ValueError(f"window_pattern {pattern!r} has local layers: local_window must be an integer in "
                         f"[1, block_size - 1 = {config.block_size - 1}], got {window!r}")
    local = local_layers(config)
    if all(local):
        raise ValueError(f"window_pattern {pattern!r} makes every layer local: give at least one {GLOBAL}")
    groups = [local[i:i + config.kv_share] for i in range(0, config.n_layer, config.kv_share)]
    if any(len(set(group)) > 1 for group in groups):
        raise ValueError(f"kv_share {config.kv_share} groups layers that window_pattern {pattern!r} makes local and "
                         f"global: the layers that share keys and values must attend alike")


class LocalLayerKV(NamedTuple):
    """A local layer's view of a WindowedKVCache: its ring's LayerKV, and the mask over that ring's slots."""

    kv: tuple  # the local ring's LayerKV (or Int8LayerKV)
    mask: torch.Tensor | None  # None: the one new token sees every filled slot

    def update(self, k_new, v_new):
        return self.kv.update(k_new, v_new)

    def read(self):
        return self.kv.read()


class LocalWindow:
    """Mixed into an attention class (model/designs/shared_kv.py): attend only the last `window` tokens."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.window = config.local_window

    def forward(self, x, attn_mask=None, rope=None, kv=None):
        if isinstance(kv, LocalLayerKV):
            attn_mask = kv.mask  # over the local ring's slots
        else:  # keys in order: no cache, or the plain KVCache's filled slots
            T_q = x.size(1)
            band = causal_mask(T_q, T_q if kv is None else kv.n_read, x.device, reach=self.window)
            attn_mask = band if attn_mask is None else attn_mask & band
        return super().forward(x, attn_mask, rope, kv)


class LocalRing:
    """Mixed into a ring class: the global layers in this ring (block_size slots and reach), the local ones in
    `self.local`, a ring of the same kind with local_window slots and reach. Spare slots (max_len - reach) go to
    both, so that both take the same chunks and rollbacks."""

    def __init__(self, n_kv_layer: int, batch_size: int, n_kv_head: int, max_len: int, head_dim: int,
                 dtype=torch.float32, device=None, *, local: list[bool], window: int, reach: int,
                 read_all_slots: bool = False):
        n_local = sum(local)
        super().__init__(n_kv_layer - n_local, batch_size, n_kv_head, max_len, head_dim, dtype, device,
                         reach=reach, read_all_slots=read_all_slots)
        self.local = self.ring_class(n_local, batch_size, n_kv_head, window + max_len - reach, head_dim, dtype,
                                     device, reach=window, read_all_slots=read_all_slots)
        # cache layer i: (whether it is local, its index in its ring)
        self.where = [(is_local, local[:i].count(is_local)) for i, is_local in enumerate(local)]

    @property
    def window(self) -> int:
        return self.local.reach

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.local.nbytes

    def reset(self, n_pad=None) -> None:
        super().reset(n_pad)
        self.local.reset(n_pad)

    def advance(self, t: int) -> None:
        super().advance(t)
        self.local.advance(t)

    def rollback(self, n: int) -> None:
        self.local.rollback(n)  # refuses whatever the global ring would refuse, and more: it wraps sooner
        super().rollback(n)

    def fill_from(self, other) -> None:
        super().fill_from(other)  # every buffer, the local ring's included
        self.local.padded = other.local.padded

    def longest_chunk(self) -> int:
        return min(super().longest_chunk(), self.local.longest_chunk())

    def for_tokens(self, t: int):
        """The global ring's (positions, mask, slots, n_read), with the local ring's slots, mask and n_read beside
        its own."""
        _, local_mask, local_slots, local_n_read = self.local.for_tokens(t)  # first: it refuses longer chunks
        pos, mask, slots, n_read = super().for_tokens(t)
        if local_mask is None and t > 1:  # the plain rule: the filled slots in order
            local_mask = causal_mask(t, local_n_read, pos.device, reach=self.window)
        return pos, mask, (slots, local_slots, local_mask), (n_read, local_n_read)

    def layer(self, i: int, slots, n_read):
        is_local, j = self.where[i]
        if is_local:
            return LocalLayerKV(self.local.layer(j, slots[1], n_read[1]), slots[2])
        return super().layer(j, slots[0], n_read[0])


class WindowedKVCache(LocalRing, RingKVCache):
    """A RingKVCache for the global layers, with a ring of local_window slots for the local ones."""

    ring_class = RingKVCache


class WindowedInt8KVCache(LocalRing, Int8KVCache):
    """The same, with int8 keys and values in both rings."""

    ring_class = Int8KVCache


def new_windowed_cache(config, shape: dict, int8: bool) -> RingKVCache:
    """The windowed cache for a model whose config has local layers; shape: RingKVCache's arguments."""
    cls = WindowedInt8KVCache if int8 else WindowedKVCache
    return cls(**shape, local=local_kv_layers(config), window=config.local_window)
