"""Engine.census() (model/serving/census.py): its picture of the blocks and requests agrees with a count made
here from the requests' own block tables and chain hashes, and nothing changes a picture once taken."""

import hashlib
from collections import Counter

import pytest
import torch

from model.serving.engine import Engine
from tiny_models import random_model

BT = 4  # tokens a block holds
PREAMBLE = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # two full blocks, then two tokens


def counted(engine: Engine, full: set[int]) -> tuple[Counter, dict]:
    """Each block's readers and first reader, from the running requests' tables; adds to full the blocks they
    have filled, which the pool keeps named while no block is handed out twice."""
    refs, owners = Counter(), {}
    for request in engine.running:
        refs.update(request.blocks)
        for block in request.blocks:
            owners.setdefault(block, request.name)
        full.update(request.blocks[:request.fed // BT])
    return refs, owners


def assert_census_agrees(engine: Engine, full: set[int]) -> None:
    refs, owners = counted(engine, full)
    census = engine.census()
    assert [b.refs for b in census.blocks] == [refs[b] for b in range(engine.pool.n_blocks)]
    assert [b.owner for b in census.blocks] == [owners.get(b) for b in range(engine.pool.n_blocks)]
    assert {b for b, block in enumerate(census.blocks) if block.cached} == full
    used = sum(1 for n in refs.values() if n)
    assert (census.used, census.idle, census.free) == (used, len(full - set(refs)), engine.pool.n_blocks - used)
    assert census.shared == sum(1 for n in refs.values() if n > 1)
    running = {r.name: r for r in engine.running}
    for request in census.requests:
        if request.name in running:  # decoding once it has drawn: no prefill here stops one token short
            assert request.state == ("decoding" if request.generated_tokens else "prefilling")
            assert request.blocks_held == len(running[request.name].blocks)
        else:
            assert (request.state, request.blocks_held) == ("waiting", 0)


@torch.no_grad()
def test_the_census_of_requests_sharing_a_prefix_agrees_with_their_block_tables():
    engine = Engine(random_model(block_size=40), n_blocks=40, block_tokens=BT, chunk=4, max_batch=3)
    prompts = {"a": PREAMBLE + [7, 7], "b": PREAMBLE + [8], "c": [2, 7, 1, 8, 2, 8, 1, 8, 2, 8],
               "d": PREAMBLE + [0]}
    for name, prompt in prompts.items():
        engine.add(name, prompt, 12)
    full = set()
    assert [r.state for r in engine.census().requests] == ["waiting"] * 4
    for _ in range(8):
        engine.step()
        assert_census_agrees(engine, full)
    census = engine.census()
    assert {r.state for r in census.requests} == {"decoding", "waiting"}  # a, b and c run; d waits its turn
    assert max(b.refs for b in census.blocks) == 2  # b reads a's preamble
    c = next(r for r in engine.running if r.name == "c")
    filled = c.fed // BT
    engine.cancel(c)  # its full blocks stay cached, read by no one
    assert_census_agrees(engine, full)
    assert engine.census().idle == filled >= 2
    for _ in range(8):
        engine.step()
        assert_census_agrees(engine, full)
    cached = {r.name: r.cached_tokens for r in engine.census().requests}
    assert cached == {"a": 0, "b": 8, "d": 8}  # the preamble's two full blocks, read from a's
    picture = engine.census()
    assert (picture.stats.prompt_tokens, picture.stats.reused_tokens) == (sum(map(len, prompts.values())), 16)
    assert [r.prompt_tokens for r in picture.requests] == [len(prompts[name]) for name in "abd"]


@torch.no_grad()
def test_the_block_named_by_the_census_holds_the_chain_hash_of_its_tokens():
    """Proof by another hash: a full block the census calls cached is the one a later request with the same first
    tokens reads."""
    engine = Engine(random_model(block_size=40), n_blocks=12, block_tokens=BT)
    a = engine.add("a", PREAMBLE + [7], 3)
    list(engine.run())
    names = [hashlib.sha256(b"".join(int(t).to_bytes(4, "little") for t in PREAMBLE[:BT])).digest()]
    names.append(hashlib.sha256(names[0] + b"".join(int(t).to_bytes(4, "little") for t in PREAMBLE[BT:2 * BT]))
                 .digest())
    cached = [b for b, block in enumerate(engine.census().blocks) if block.cached]
    assert [engine.pool.by_hash[name] for name in names] == cached[:2] and a.drawn == 3


@torch.no_grad()
def test_a_preempted_request_is_counted_as_such_and_holds_no_block():
    """Four blocks of 4 for two requests of 4 prompt tokens and 8 new: at the ninth token one must go."""
    engine = Engine(random_model(block_size=40), n_blocks=4, block_tokens=BT, max_batch=2)
    engine.add("first", [1, 2, 3, 4], 8)
    engine.add("last", [4, 3, 2, 1], 8)
    while not engine.stats.preemptions:
        engine.step()
    census = {r.name: r for r in engine.census().requests}
    assert (census["last"].state, census["last"].preemptions, census["last"].blocks_held) == ("preempted", 1, 0)
    assert census["first"].state == "decoding" and census["first"].blocks_held == 3
    assert engine.census().stats.preemptions == 1


def test_a_census_is_frozen_and_stays_as_it_was_taken():
    engine = Engine(random_model(block_size=40), n_blocks=8, block_tokens=BT)
    engine.add("a", PREAMBLE, 4)
    engine.step()
    census = engine.census()
    picture = repr(census)
    for part, field in ((census, "free"), (census.blocks[0], "refs"), (census.requests[0], "state"),
                        (census.stats, "passes")):
        with pytest.raises(AttributeError):  # a frozen dataclass's error, or a named tuple's
            setattr(part, field, 0)
    assert isinstance(census.blocks, tuple) and isinstance(census.requests, tuple)
    engine.step()
    assert repr(census) == picture and engine.census() != census
    assert engine.device == torch.device("cpu")
