"""Every KV cache by name, and the one place that makes each: the names sample.py's --kv-cache and
bench/kv_budget.py take. A new cache is a module of its own in model/caches/ and one line in CACHES.

    cache = new_cache(model, "h2o", batch_size=4, budget=32)
    ids = generate(model, prompt, 1_000, cache=cache)

- float, int8: the ring (model/caches/ring.py), keys and values in attention's dtype or in int8
  (int8.py); a model with local layers gets two rings (local_ring.py);
- int4, int2: KIVI's low-bit caches (lowbit.py);
- budgeted, `budget` slots (default: half of block_size): window keeps the last tokens (window.py), sinks the
  first SINKS and the last (sinks.py); for rotary models, h2o and tova let each head choose what goes
  (evicting.py), and merge folds what goes into what stays (merging.py).
"""

from functools import partial

import torch

from ..checks import is_integer
from .ring import RingKVCache, cache_shape
from ..designs.local_window import local_kv_layers
from .evicting import EvictingKVCache, new_evicting_cache
from .int8 import KV_SCALE_DTYPE, Int8KVCache
from .local_ring import new_windowed_cache
from .lowbit import LowBitKVCache, new_lowbit_cache
from .merging import MergingKVCache, new_merging_cache
from .sinks import SinkKVCache, new_budget_sink_cache
from .window import WindowKVCache, new_window_cache


def kv_cache_dtype(model, dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype new_kv_cache(model, dtype=dtype) stores keys and values in: attention's own unless given."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype == torch.int8)):
        raise ValueError(f"a KV cache holds floating-point keys and values, or int8 ones: dtype {dtype}")
    return dtype or model.attention_dtype


def new_kv_cache(model, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None, *,
                 read_all_slots: bool = False):
    """The cache generate() uses: an empty ring for batch_size rows, on the model's device. max_len: its slots
    (default block_size; more let a chunk of tokens wrap the ring). dtype: the dtype attention computes in unless
    given; torch.int8 stores int8 keys and values (int8.py). read_all_slots: always read every slot through the
    mask."""
    for name, value in (("batch_size", batch_size), ("max_len", max_len)):
        if value is not None and not (is_integer(value) and value >= 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    shape = cache_shape(model, batch_size)
    dtype = kv_cache_dtype(model, dtype)
    int8 = dtype == torch.int8  # an int8 cache's dtype argument is what attention computes in: shape's
    ring = Int8KVCache if int8 else RingKVCache
    compute = shape["dtype"] if int8 else dtype

    def make_ring(n_kv_layer: int, slots: int, reach: int):
        return ring(n_kv_layer, batch_size, shape["n_kv_head"], slots, shape["head_dim"], compute, shape["device"],
                    reach=reach, read_all_slots=read_all_slots)
    max_len = max_len or model.config.block_size
    if model.config.local_window is not None:  # local layers keep their own, shorter ring
        return new_windowed_cache(model.config, make_ring, max_len)
    return make_ring(shape["n_kv_layer"], max_len, model.config.block_size)


# name: (the class it makes, what makes one for (model, batch_size, **options))
CACHES = {
    "float": (RingKVCache, new_kv_cache),
    "int8": (Int8KVCache, partial(new_kv_cache, dtype=torch.int8)),
    "int4": (LowBitKVCache, partial(new_lowbit_cache, bits=4)),
    "int2": (LowBitKVCache, partial(new_lowbit_cache, bits=2)),
    "window": (WindowKVCache, new_window_cache),
    "sinks": (SinkKVCache, new_budget_sink_cache),
    "h2o": (EvictingKVCache, partial(new_evicting_cache, policy="h2o")),
    "tova": (EvictingKVCache, partial(new_evicting_cache, policy="tova")),
    "merge": (MergingKVCache, new_merging_cache),
}
BUDGETED = tuple(name for name, (cls, _) in CACHES.items() if cls.abilities.budgeted)
LOWBIT = tuple(name for name, (cls, _) in CACHES.items() if cls is LowBitKVCache)
EAGER = tuple(name for name, (cls, _) in CACHES.items() if not cls.abilities.compiles)  # they refuse compile


def default_budget(model) -> int:
    return model.config.block_size // 2


def new_cache(model, name: str, batch_size: int, *, budget: int | None = None, read_all_slots: bool = False,
              **lowbit):
    """An empty cache `name` (CACHES) for batch_size rows of model. budget: a budgeted cache's slots. lowbit:
    group and residual for int4 and int2 (lowbit.py). read_all_slots: the ring's (model/caches/ring.py)."""
    if name not in CACHES:
        raise ValueError(f"unknown KV cache {name!r}: choose one of {', '.join(CACHES)}")
    if budget is not None and name not in BUDGETED:
        raise ValueError(f"a budget applies to {', '.join(BUDGETED)}, not to the {name} cache")
    if read_all_slots and name in BUDGETED:
        raise ValueError(f"the {name} cache reads its own slots: read_all_slots applies to the ring")
    if lowbit and name not in LOWBIT:
        raise ValueError(f"{', '.join(lowbit)} applies to {', '.join(LOWBIT)}, not to the {name} cache")
    make = CACHES[name][1]
    if name in BUDGETED:
        return make(model, batch_size, budget=default_budget(model) if budget is None else budget)
    return make(model, batch_size, read_all_slots=read_all_slots, **lowbit)


def kv_cache_bytes(config, dtype: torch.dtype, max_len: int | None = None) -> int:
    """Bytes a cache from new_kv_cache(model, 1, max_len, dtype) holds: keys and values for every layer that
    projects them (n_layer / kv_share), each head the cache holds (config.kv_cache_heads) and each slot. A layer
    has max_len slots (default block_size), a local one local_window + max_len - block_size (local_ring.py).
    int8 adds one KV_SCALE_DTYPE scale per token and head to each."""
    max_len = max_len or config.block_size
    heads, width = config.kv_cache_heads
    per_slot = 2 * heads * (width * dtype.itemsize + (KV_SCALE_DTYPE.itemsize if dtype == torch.int8 else 0))
    if config.local_window is None:  # every layer holds max_len slots
        return per_slot * config.n_kv_layer * max_len
    slots = [config.local_window + max_len - config.block_size if local else max_len
             for local in local_kv_layers(config)]
    return per_slot * sum(slots)


def kv_cache_bytes_per_token(config, dtype: torch.dtype) -> float:
    """kv_cache_bytes per token of a full context (block_size tokens): what the cache costs per token it serves."""
    return kv_cache_bytes(config, dtype) / config.block_size
