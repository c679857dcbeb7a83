"""serve.py through OpenAI's own client: completions whole and streamed, every client's text what it gets alone,
64 streams at once, and clients that drop mid-stream."""

import asyncio
import http.client
import json
import random
import re
import time
import urllib.parse
import urllib.request

import pytest
import torch

from model import Sampling, generate
from serving import VOCAB, Served, checkpoint, greedy_alone, local_model, server  # noqa: F401  fixtures

openai = pytest.importorskip("openai", reason="the tests drive serve.py with OpenAI's client: pip install openai")
PROMPTS = ["ROMEO:", "ROMEO: Is the day so young?", "JULIET:", "JULIET: Wherefore art thou", "<b>no</b> & yes"]


def client(server, **kwargs):
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60, **kwargs)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def metrics(server) -> dict:
    """The server's Prometheus samples by name and labels."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def wait_for_empty_pool(server, seconds: float = 20) -> dict:
    """The pool once no block is read and no completion runs or waits; fails if that takes too long."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pool = get_json(server.url + "/pool")
        if all(refs == 0 for _, refs, _ in pool["blocks"]) and not any(
                job["state"] != "done" for job in pool["jobs"]):
            return pool
        time.sleep(0.05)
    raise AssertionError(f"the pool still holds blocks after {seconds} s: {pool}")


def test_a_completion_whole_and_streamed_is_the_greedy_text_with_its_usage(server, local_model):
    expected = greedy_alone(local_model, PROMPTS[1], 40)
    whole = client(server).completions.create(model=client(server).models.list().data[0].id, prompt=PROMPTS[1],
                                              max_tokens=40, temperature=0)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(PROMPTS[1]), 40)
    chunks = list(client(server).completions.create(model=whole.model, prompt=PROMPTS[1], max_tokens=40,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert len({c.id for c in chunks}) == 1 and chunks[-1].usage.completion_tokens == 40
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_a_stop_string_ends_the_text_before_it(server, local_model):
    full = greedy_alone(local_model, PROMPTS[0], 60)
    stop = full[20:23]  # three characters the text reaches
    cut = full[:full.index(stop)]
    whole = client(server).completions.create(model=None, prompt=PROMPTS[0], max_tokens=60, temperature=0,
                                              stop=[stop, "never in this text |~|"])
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (cut, "stop")
    streamed = list(client(server).completions.create(model=None, prompt=PROMPTS[0], max_tokens=60, temperature=0,
                                                      stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_stop_string_that_ends_at_the_last_token_is_a_stop_in_the_answer_and_the_metrics(server, local_model):
    full = greedy_alone(local_model, PROMPTS[0], 20)
    cut = next(k for k in range(19, -1, -1) if full.index(full[k:]) == k)  # the shortest end found nowhere before
    before = metrics(server)
    answer = client(server).completions.create(model=None, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                               stop=full[cut:], n=4)
    assert {(c.text, c.finish_reason) for c in answer.choices} == {(full[:cut], "stop")}
    after, counted = metrics(server), [f'kvgpt_requests_total{{outcome="{outcome}"}}' for outcome in ("stop", "length")]
    assert [after[key] - before[key] for key in counted] == [4, 0]


def test_stop_strings_cut_the_text_where_a_written_out_search_cuts_it():
    """Random texts over two letters, fed a character at a time as the engine draws them: what is sent is the text up
    to the stop that ends first, and what is held back is the longest end of the text so far that begins a stop,
    found by trying every length."""
    from server.stops import StopScan
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 30)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        end = next((e for e in range(len(text) + 1) if any(text[:e].endswith(stop) for stop in stops)), None)
        cut = None if end is None else end - max(len(stop) for stop in stops if text[:end].endswith(stop))
        scan, sent, stopped = StopScan(stops), "", False
        for at in range(len(text)):
            out, stopped = scan.feed(text[at])
            sent += out
            if stopped:
                break
            fed = text[:at + 1]
            held = max(k for k in range(len(fed) + 1) for stop in stops if k < len(stop) and fed.endswith(stop[:k]))
            assert sent == fed[:len(fed) - held], (text, stops, fed)
        sent += "" if stopped else scan.flush()
        assert (sent, stopped) == ((text[:cut], True) if end is not None else (text, False)), (text, stops)


def test_sixteen_clients_at_once_sharing_prefixes_each_get_their_text_alone(server, local_model):
    prompts = [PROMPTS[i % len(PROMPTS)] + "abcdefghijklmnop"[:i] for i in range(16)]

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60) as api:
            return await asyncio.gather(*(api.completions.create(model=None, prompt=p, max_tokens=30, temperature=0)
                                          for p in prompts))

    before = metrics(server)["kvgpt_prefix_cache_hit_tokens_total"]
    answers = asyncio.run(asyncio.wait_for(all_at_once(), 120))
    for prompt, answer in zip(prompts, answers):
        assert answer.choices[0].text == greedy_alone(local_model, prompt, 30), prompt
    assert metrics(server)["kvgpt_prefix_cache_hit_tokens_total"] > before  # the shared prefixes were read
    wait_for_empty_pool(server)


def test_a_seeded_request_draws_the_same_text_alone_and_under_load(server, local_model):
    ask = dict(model=None, prompt=PROMPTS[2], max_tokens=50, temperature=0.9, top_p=0.95, seed=1234)
    alone = client(server).completions.create(**ask).choices[0].text
    ids = torch.tensor([VOCAB.encode(PROMPTS[2])])
    drawn = generate(local_model, ids, 50, sampling=Sampling(temperature=0.9, top_p=0.95),
                     generator=torch.Generator().manual_seed(1234))
    assert alone == VOCAB.decode(drawn[0, ids.size(1):].tolist())

    async def under_load():
        async with openai.AsyncOpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60) as api:
            others = [api.completions.create(model=None, prompt=PROMPTS[i % 5], max_tokens=60, temperature=1.0,
                                             extra_body={"top_k": 20}) for i in range(15)]
            return await asyncio.gather(api.completions.create(**ask), *others)

    assert asyncio.run(asyncio.wait_for(under_load(), 120))[0].choices[0].text == alone


def test_a_top_p_that_float32_rounds_to_0_draws_the_likeliest_token(server, local_model):
    answer = client(server).completions.create(model=None, prompt=PROMPTS[0], max_tokens=40, top_p=5e-324, seed=3)
    assert answer.choices[0].text == greedy_alone(local_model, PROMPTS[0], 40)


def test_sixty_four_streams_at_once_all_complete_unmixed_and_the_pool_empties(server, local_model):
    prompts = [f"{PROMPTS[i % 5]} {i}" for i in range(64)]

    async def stream(api, prompt):
        pieces, ids = [], set()
        async for chunk in await api.completions.create(model=None, prompt=prompt, max_tokens=24, temperature=0,
                                                        stream=True):
            ids.add(chunk.id)
            pieces.append(chunk.choices[0].text)
        return ids, "".join(pieces)

    async def all_streams():
        async with openai.AsyncOpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120) as api:
            return await asyncio.gather(*(stream(api, p) for p in prompts))

    results = asyncio.run(asyncio.wait_for(all_streams(), 300))
    assert len({next(iter(ids)) for ids, _ in results}) == 64 and all(len(ids) == 1 for ids, _ in results)
    for prompt, (_, text) in zip(prompts, results):
        assert text == greedy_alone(local_model, prompt, 24), prompt
    pool = wait_for_empty_pool(server)
    assert sum(refs for _, refs, _ in pool["blocks"]) == 0


def test_clients_that_drop_mid_stream_are_cancelled_and_their_blocks_freed(server):
    before = metrics(server)
    host = urllib.parse.urlsplit(server.url)
    connections = [http.client.HTTPConnection(host.hostname, host.port, timeout=30) for _ in range(20)]
    for i, connection in enumerate(connections):  # all sent first: none ends before the last has begun
        connection.request("POST", "/v1/completions", json.dumps(
            {"prompt": PROMPTS[i % 5][:6], "max_tokens": 240, "temperature": 1.0, "stream": True}),
            {"Content-Type": "application/json"})
    connections = [(connection, connection.getresponse()) for connection in connections]
    for _, response in connections:
        assert response.status == 200 and response.readline().startswith(b"data: {")  # its first token came
    for connection, response in connections:
        response.close()
        connection.close()
    wait_for_empty_pool(server)
    after = metrics(server)
    assert after['kvgpt_requests_total{outcome="cancelled"}'] - before['kvgpt_requests_total{outcome="cancelled"}'] \
        == 20
    assert after["kvgpt_blocks_used"] == 0
    answer = client(server).completions.create(model=None, prompt="still here", max_tokens=5, temperature=0)
    assert len(answer.choices[0].text) == 5


def test_models_health_and_metrics_say_what_is_served(server):
    models = client(server).models.list().data
    assert len(models) == 1 and models[0].id.endswith("/best") and models[0].owned_by == "kvgpt"
    assert client(server).models.retrieve(models[0].id) == models[0]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(server).models.retrieve("gpt-4")
    assert get_json(server.url + "/health") == {"status": "ok"}
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    for name in ("requests_running", "requests_waiting", "tokens_drawn_total", "blocks_used", "blocks_free",
                 "prefix_cache_hit_rate", "preemptions_total", "time_to_first_token_seconds_bucket"):
        assert re.search(rf"^kvgpt_{name}(\{{.*\}})? \d", text, re.M), name


def test_an_exported_folder_is_served_with_the_checkpoints_text(checkpoint, local_model, tmp_path):
    pytest.importorskip("transformers", reason="export.py's packages are not installed")
    from exporting.folder import export
    served = Served(export(checkpoint, tmp_path / "exported"))
    try:
        api = client(served)
        assert [m.id for m in api.models.list().data] == ["exported"]
        answer = api.completions.create(model="exported", prompt=PROMPTS[3], max_tokens=30, temperature=0)
        assert answer.choices[0].text == greedy_alone(local_model, PROMPTS[3], 30)
    finally:
        served.stop()


def test_int8_weights_and_an_int8_pool_serve_the_text_the_engine_gives_alone(checkpoint):
    from model.serving.engine import Engine
    from runtime.checkpoint import load_model
    engine = Engine(load_model(checkpoint, precision="int8")[0], n_blocks=16, block_tokens=16, int8=True)
    alone = engine.add("alone", VOCAB.encode(PROMPTS[1]), 40)
    list(engine.run())
    served = Served(checkpoint, "--precision", "int8", "--kv-cache", "int8")
    try:
        answer = client(served).completions.create(model=None, prompt=PROMPTS[1], max_tokens=40, temperature=0)
        assert answer.choices[0].text == VOCAB.decode(alone.tokens[len(PROMPTS[1]):])
    finally:
        served.stop()
