"""Every KV cache by name: the names sample.py's --kv-cache and bench/kv_budget.py take, and the one place that
makes each cache from its name.

    cache = new_cache(model, "h2o", batch_size=4, budget=32)
    ids = generate(model, prompt, 1_000, cache=cache)

- float, int8: the ring (model/decoding/ring_cache.py), keys and values in attention's dtype or in int8 (model/caches/int8.py);
- int4, int2: KIVI's low-bit caches (model/caches/lowbit.py);
- budgeted, `budget` slots (default: half of block_size): window keeps the last tokens and sinks the first
  SINKS and the last (model/caches/sinks.py); for rotary models, h2o and tova let each head choose what goes
  (model/caches/evicting.py), and merge folds what goes into what stays (model/caches/merging.py).
"""

import torch

from ..decoding.checks import is_integer
from .evicting import POLICIES, new_evicting_cache
from .lowbit import LOW_BITS, new_lowbit_cache
from .merging import MergingKVCache, new_merging_cache
from .sinks import SINKS, new_sink_cache

LOWBIT = {f"int{bits}": bits for bits in LOW_BITS}
BUDGETED = ("window", "sinks", *POLICIES, *MergingKVCache.policies)
CACHES = ("float", "int8", *LOWBIT, *BUDGETED)
EAGER = (*LOWBIT, *BUDGETED)  # they refuse compile


def default_budget(model) -> int:
    return model.config.block_size // 2


def new_cache(model, name: str, batch_size: int, *, budget: int | None = None, read_all_slots: bool = False,
              **lowbit):
    """An empty cache `name` (CACHES) for batch_size rows of model. budget: a budgeted cache's slots. lowbit:
    group and residual for int4 and int2 (model/caches/lowbit.py). read_all_slots: the ring's (model/decoding/ring_cache.py)."""
    if name not in CACHES:
        raise ValueError(f"unknown KV cache {name!r}: choose one of {', '.join(CACHES)}")
    if budget is not None and name not in BUDGETED:
        raise ValueError(f"a budget applies to {', '.join(BUDGETED)}, not to the {name} cache")
    if read_all_slots and name in BUDGETED:
        raise ValueError(f"the {name} cache reads its own slots: read_all_slots applies to the ring")
    if lowbit and name not in LOWBIT:
        raise ValueError(f"{', '.join(lowbit)} applies to {', '.join(LOWBIT)}, not to the {name} cache")
    budget = default_budget(model) if budget is None else budget
    if name in ("window", "sinks"):
        sinks = SINKS if name == "sinks" else 0
        if is_integer(budget) and budget < sinks + 1:
            raise ValueError(f"a budget of {budget!r} slots leaves none for the last tokens beside {sinks} sinks: "
                             f"give at least {sinks + 1}")
        return new_sink_cache(model, batch_size, sinks=sinks, window=budget - sinks)
    if name in POLICIES:
        return new_evicting_cache(model, batch_size, policy=name, budget=budget)
    if name in MergingKVCache.policies:
        return new_merging_cache(model, batch_size, budget=budget)
    if name in LOWBIT:
        return new_lowbit_cache(model, batch_size, LOWBIT[name], read_all_slots=read_all_slots, **lowbit)
    return model.new_kv_cache(batch_size, dtype=torch.int8 if name == "int8" else None, read_all_slots=read_all_slots)
