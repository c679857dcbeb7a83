"""What interleaved local and global layers add (Mistral's sliding window, Gemma 2 and 3's local and global layers):
a local layer attends only its last local_window tokens, and caches only those; a global layer attends block_size.

config.window_pattern is tiled over the layers from the first: "LLG" makes layers 2, 5, 8 ... global and the rest
local. A local layer's cache is a ring of its own (model/caches/local_ring.py), which hands the layer a
LocalLayerKV: its view, with the local ring's mask. Without a cache, or with the plain in-order KVCache, a local
layer narrows the mask it is given to a band of local_window keys (causal_mask's reach).
"""

from typing import NamedTuple

import torch

from ..attention import causal_mask
from ..checks import is_integer

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
    """A local layer's view of a windowed cache (model/caches/local_ring.py): its ring's view, and the mask over
    that ring's slots."""

    kv: object  # the local ring's view (model/kv_cache.py: LayerView)
    mask: torch.Tensor | None  # None: the one new token sees every filled slot


class LocalWindow:
    """Mixed into an attention class (model/designs/layers.py): attend only the last `window` tokens."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.window = config.local_window

    def forward(self, x, attn_mask=None, rope=None, kv=None):
        if isinstance(kv, LocalLayerKV):
            kv, attn_mask = kv  # the local ring's view, and its mask over the ring's slots
        else:  # keys in order: no cache, or the plain KVCache's filled slots
            T_q = x.size(1)
            band = causal_mask(T_q, T_q if kv is None else kv.n_read, x.device, reach=self.window)
            attn_mask = band if attn_mask is None else attn_mask & band
        return super().forward(x, attn_mask, rope, kv)
