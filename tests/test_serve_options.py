"""serve.py's options, checked in this process: the host, the API key, and the pool's size against memory before it is
allocated."""

import argparse
import asyncio
import re
import socket

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


@pytest.mark.parametrize("given", [{"max_batch": 2**20}, {"blocks": 2**20}, {"max_batch": 2**20, "blocks": 8},
                                   {"block_tokens": 2**24}, {"max_batch": 2**20, "kv_cache": "int8"}])
def test_a_pool_beyond_its_share_of_memory_is_refused_before_it_is_made(monkeypatch, given):
    """A machine of 1 GiB in this test: the pool may take half of it. Each pool asked for is larger."""
    model = random_model()
    monkeypatch.setattr(options, "memory_of", lambda device: 2**30)
    monkeypatch.setattr(BlockPool, "__init__", lambda *a, **k: pytest.fail("the pool was made"))
    int8 = "" if given.get("kv_cache") == "int8" else ", or give --kv-cache int8"
    with pytest.raises(UsageError, match=f"GiB, more than 50% of the 1.0 GiB of cpu memory; lower --max-batch or "
                                         f"--blocks{int8}$"):
        options.new_engine(args(**given), model)


@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_host_is_refused_rather_than_every_address_listened_on(host):
    with pytest.raises(UsageError, match="^--host is empty"):
        options.check_options(args(host=host))


@pytest.mark.parametrize("key, fragment", [(" ", "is empty"), ("abc ", "starts or ends with whitespace"),
                                           ("\tabc", "starts or ends with whitespace"),
                                           ("clé", "has characters that are not printable ASCII ('é')"),
                                           ("a\x7fb", "has characters that are not printable ASCII ('\\x7f')")])
def test_a_key_no_client_could_send_is_refused_by_the_name_it_came_by(monkeypatch, key, fragment):
    monkeypatch.delenv(options.KEY_VARIABLE, raising=False)
    with pytest.raises(UsageError, match=f"^--api-key {re.escape(fragment)}"):
        options.check_options(args(api_key=key))
    monkeypatch.setenv(options.KEY_VARIABLE, key)
    with pytest.raises(UsageError, match=f"^KVGPT_API_KEY {re.escape(fragment)}"):
        options.check_options(args())
    monkeypatch.setenv(options.KEY_VARIABLE, "s3 cret!~")  # a space inside is sent as it is
    assert options.check_options(given := args()) is None and given.api_key == "s3 cret!~"


@pytest.mark.parametrize("cores, torch_default, given, environment, decoding", [
    (2, 2, None, None, 1),  # the event loop keeps the other core
    (1, 1, None, None, 1),  # at least one thread decodes
    (16, 8, None, None, 8),  # torch's count, where it leaves cores free already
    (16, 16, None, None, 15),
    (4, 4, 4, None, 4),  # --threads as given
    (4, 4, None, "3", 3),  # OMP_NUM_THREADS, as torch obeys it
])
def test_the_decoding_threads_leave_the_event_loop_a_core(monkeypatch, cores, torch_default, given, environment,
                                                          decoding):
    monkeypatch.setattr(options, "usable_cores", lambda: cores)
    monkeypatch.setattr(options, "DEFAULT_THREADS", torch_default)
    if environment is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", environment)
    monkeypatch.setattr("runtime.devices.usable_cores", lambda: cores)  # what OMP_NUM_THREADS is checked against
    assert options.serving_threads(args(**({"threads": given} if given else {}))) == decoding


def test_kv_cache_offers_every_cache_by_name_and_refuses_in_one_line_those_a_pool_cannot_keep():
    from model.caches.factory import CACHES
    from model.serving.paged import POOLED

    offered = next(a for a in options.build_parser()._actions if a.dest == "kv_cache").choices
    assert tuple(offered) == tuple(CACHES) and set(POOLED) < set(CACHES)
    for name in CACHES:
        if name in POOLED:
            options.check_options(args(kv_cache=name))
            continue
        with pytest.raises(UsageError) as refused:
            options.check_options(args(kv_cache=name))
        assert str(refused.value) == (f"--kv-cache {name} keeps one text's cache, not a pool of blocks: serve with "
                                      f"float or int8; sample.py --kv-cache {name} decodes with it")


def test_the_servers_connections_send_each_small_write_at_once():
    """A connection accepted on serve.py's socket has TCP_NODELAY, which asyncio sets only on sockets made for TCP.
    Without it, a streamed token waits for the client's delayed acknowledgement of the one before (about 40 ms on
    Linux) on a connection the client keeps open, as OpenAI's client does."""
    async def accepted_nodelay() -> int:
        sock = options.listening_socket("127.0.0.1", 0)
        accepted = asyncio.get_running_loop().create_future()

        class Note(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Note, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
        return nodelay

    assert asyncio.run(accepted_nodelay()) != 0
