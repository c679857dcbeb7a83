"""generate() and Sampling refuse arguments that cannot work with a ValueError that names the argument."""

import math

import pytest
import torch

from model import GREEDY, RingKVCache, Sampling, generate
from tiny_models import random_tokens
from model.caches.factory import new_kv_cache
from programs import model


@pytest.mark.parametrize("case, argument", [
    ("a cache of another batch size", "cache"), ("a cache shorter than block_size", "cache"),
    ("float idx", "idx"), ("empty idx", "idx"), ("1-D idx", "idx"),
    ("n_pad of the wrong length", "n_pad"), ("n_pad as a (B, 1) tensor", "n_pad"),
    ("negative max_new_tokens", "max_new_tokens"),
])
def test_generate_misuse_is_a_value_error_naming_the_argument(model, case, argument):
    idx, kwargs = random_tokens(2, 4), {}
    if case == "a cache of another batch size":
        kwargs["cache"] = new_kv_cache(model, 3)
    elif case == "a cache shorter than block_size":
        c = model.config  # a cache of its own making: new_kv_cache refuses fewer slots than block_size
        kwargs["cache"] = RingKVCache(c.n_kv_layer, 2, c.n_kv_head, c.block_size - 1, c.head_dim)
        with pytest.raises(ValueError, match="max_len"):
            new_kv_cache(model, 2, max_len=c.block_size - 1)
    elif case == "float idx":
        idx = idx.float()
    elif case == "empty idx":
        idx = idx[:, :0]
    elif case == "1-D idx":
        idx = idx[0]
    elif case == "n_pad of the wrong length":
        kwargs["n_pad"] = [0, 0, 0]
    elif case == "n_pad as a (B, 1) tensor":
        kwargs["n_pad"] = torch.zeros(2, 1, dtype=torch.long)
    max_new_tokens = -1 if case == "negative max_new_tokens" else 2
    with pytest.raises(ValueError, match=f"^{argument} "):
        generate(model, idx, max_new_tokens, sampling=GREEDY, **kwargs)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, 1e-38, -1.0])
def test_a_temperature_that_cannot_work_is_a_value_error(temperature):
    with pytest.raises(ValueError, match="^temperature must be"):
        Sampling(temperature=temperature)
