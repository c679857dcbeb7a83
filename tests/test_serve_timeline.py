"""server/timeline.py: the engine's history keeps the last moments only, and each moment agrees with a count made
here from the requests' own block tables; over HTTP, /timeline's last moment is the pool the page draws."""

import json
import time
import urllib.request
from collections import Counter

import torch

from model.serving.engine import Engine
from server.timeline import Timeline, moment_view
from serving import checkpoint, server  # noqa: F401  fixtures
from tiny_models import random_model

BT = 4  # tokens a block holds
PREAMBLE = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # two full blocks, then two tokens


def refs_counted(engine: Engine) -> Counter:
    """Each block's readers, from the running requests' own tables."""
    return Counter(block for request in engine.running for block in request.blocks)


@torch.no_grad()
def test_the_timeline_keeps_the_last_moments_each_as_the_engine_was_after_its_pass():
    engine, timeline = Engine(random_model(block_size=40), n_blocks=20, block_tokens=BT, max_batch=3), Timeline(5)
    engine.add("a", PREAMBLE + [7], 12)
    for _ in range(4):  # a fills the preamble's two blocks
        engine.step()
        timeline.record(engine.census())
    engine.add("b", PREAMBLE + [8], 12)
    for _ in range(3):
        engine.step()
        timeline.record(engine.census())
        refs = refs_counted(engine)
        last = timeline.since(0)["moments"][-1]
        assert [b[1] for b in last["blocks"]] == [refs[b] for b in range(engine.pool.n_blocks)]
        assert last["used"] == len(refs) and last["shared"] == sum(1 for n in refs.values() if n > 1)
        assert {r["id"]: r["blocks"] for r in last["requests"]} == {r.name: len(r.blocks) for r in engine.running}
    moments = timeline.since(0)["moments"]
    assert [m["seq"] for m in moments] == [3, 4, 5, 6, 7] and timeline.since(0)["moments_kept"] == 5
    assert [m["hits"] for m in moments] == [[], [], [{"id": "b", "cached_tokens": 8}], [], []]  # the two blocks
    assert moments[-1]["shared"] == 2 and [m["seq"] for m in timeline.since(6)["moments"]] == [7]
    engine.cancel(next(r for r in engine.running if r.name == "a"))
    timeline.record(engine.census())
    assert timeline.since(7)["moments"][0]["left"] == ["a"]


def test_a_moment_is_json_the_page_reads():
    engine, timeline = Engine(random_model(block_size=40), n_blocks=8, block_tokens=BT), Timeline()
    engine.add("a", PREAMBLE, 4)
    engine.step()
    timeline.record(engine.census())
    moment = json.loads(json.dumps(moment_view(timeline.moments[-1])))
    assert moment["requests"][0] == {"id": "a", "state": "decoding", "prompt_tokens": 10, "cached_tokens": 0,
                                     "tokens": 1, "blocks": 3, "preemptions": 0}


@torch.no_grad()
def test_moments_whose_blocks_did_not_change_share_one_copy_of_them():
    """Decoding within a block changes no block: the history keeps one copy, not one per pass."""
    engine, timeline = Engine(random_model(block_size=40), n_blocks=600, block_tokens=16), Timeline()
    engine.add("a", [1, 2, 3], 10)
    for _ in range(6):
        engine.step()
        timeline.record(engine.census())
        assert [list(b) for b in timeline.moments[-1].census.blocks] == [[b.owner, b.refs, b.cached]
                                                                  for b in engine.census().blocks]
    assert len({id(m.census.blocks) for m in timeline.moments}) == 1


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.load(answer)


def complete(server, prompt: str, max_tokens: int) -> None:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(server.api + "/completions", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=60).read()


def test_the_timeline_route_ends_with_the_pool_the_page_draws(server):
    preamble = "ROMEO: Is the day so young? JULIET: "  # two full blocks of 16
    complete(server, preamble + "It is", 20)
    complete(server, preamble + "Not yet", 20)  # reads the first one's two blocks
    deadline = time.monotonic() + 10
    while get(server.url + "/pool")["jobs"][-1]["state"] != "done":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    history, pool = get(server.url + "/timeline"), get(server.url + "/pool")
    moments = history["moments"]
    assert 40 <= len(moments) <= history["moments_kept"]
    assert [m["seq"] for m in moments] == list(range(moments[0]["seq"], moments[-1]["seq"] + 1))
    assert moments[-1]["blocks"] == pool["blocks"]  # idle since its last pass: no request holds a block
    assert moments[-1]["used"] == sum(1 for b in pool["blocks"] if b[1]) == 0
    assert moments[-1]["cached"] == sum(1 for b in pool["blocks"] if b[2]) >= 2
    hits = [hit for m in moments for hit in m["hits"]]
    assert len(hits) == 1 and hits[0]["cached_tokens"] == 32
    assert get(server.url + f"/timeline?since={moments[-1]['seq']}")["moments"] == []
