"""serve.py's options, checked in this process: the host, and the pool's size against memory before it is
allocated."""

import argparse

import pytest

from model.serving.paged import BlockPool
from runtime.errors import UsageError
from server import options
from tiny_models import random_model


def args(**given) -> argparse.Namespace:
    return options.build_parser().parse_args([f"--{k.replace('_', '-')}={v}" for k, v in given.items()])


@pytest.mark.parametrize("int8", [False, True])
def test_a_pools_bytes_are_counted_before_it_is_made(int8):
    model = random_model()
    pool = BlockPool(model, 5, 4, int8, max_rows=3)
    made = pool.nbytes + sum(t.nbytes for t in pool.gathered.values())
    assert BlockPool.bytes_needed(model, 5, 4, int8, max_rows=3) == made


@pytest.mark.parametrize("given, lower", [({"max_batch": 2**20}, "--max-batch"), ({"blocks": 2**20}, "--blocks"),
                                          ({"max_batch": 2**20, "blocks": 8}, "--max-batch"),
                                          ({"block_tokens": 2**24}, "--block-tokens")])
def test_a_pool_beyond_its_share_of_memory_is_refused_before_it_is_made(monkeypatch, given, lower):
    """A machine of 1 GiB in this test: the pool may take half of it. Each pool asked for is larger."""
    model = random_model()
    monkeypatch.setattr(options, "memory_of", lambda device: 2**30)
    monkeypatch.setattr(BlockPool, "__init__", lambda *a, **k: pytest.fail("the pool was made"))
    with pytest.raises(UsageError, match=f"GiB, more than 50% of the 1.0 GiB of cpu memory; lower {lower}$"):
        options.new_engine(args(**given), model)


@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_host_is_refused_rather_than_every_address_listened_on(host):
    with pytest.raises(UsageError, match="^--host is empty"):
        options.check_options(args(host=host))
