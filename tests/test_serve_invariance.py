"""serve.py answers a greedy request with the same logits, to the bit, whatever else it serves: 200 requests at
once through OpenAI's own client, under a random schedule (shared prefixes, a pool small enough to preempt,
prompts prefilled in chunks, streams dropped midway, sampled requests beside greedy ones), each greedy one's
token logprobs and top logprobs equal those of the same request alone on an empty engine. And each request's
cached_tokens is the engine's own count, as its census recorded it (/timeline)."""

import json
import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from model import build_model
from model.gpt import GPTConfig
from model.serving.engine import Engine
from model.serving.request import Kept
from runtime.checkpoint import build_checkpoint, load_model, save_checkpoint
from server.logprobs import ChoiceScores, score
from serving import VOCAB, Served

openai = pytest.importorskip("openai", reason="the tests drive serve.py with OpenAI's client: pip install openai")

BLOCK, BLOCK_TOKENS, TOP = 128, 4, 3
# (design, --kv-cache, --precision): every design, each pool and weight precision more than once
RUNS = [("plain", "float", "fp32"), ("latent-absorbed", "int8", "int8"), ("plain", "int8", "int8"),
        ("rope-mqa", "int8", "fp32"), ("shared", "float", "int8"), ("latent", "int8", "fp32"),
        ("latent-absorbed", "float", "fp32"), ("sink", "int8", "int8")]
DESIGNS = {"plain": dict(), "rope-mqa": dict(pos_emb="rope", n_kv_head=1), "shared": dict(kv_share=2),
           "latent": dict(kv_latent=8), "latent-absorbed": dict(pos_emb="rope", kv_latent=8, kv_latent_rope=4,
                                                                 bias=False),
           "sink": dict(learned_sink=True, n_kv_head=1)}


def checkpoint_of(folder, design: str):
    """A tiny random GPT of the design, 32 wide so that int8 weights take the packed kernel."""
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=len(VOCAB), block_size=BLOCK, n_layer=2, n_head=2, n_embd=32,
                                  **DESIGNS[design]))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return save_checkpoint(build_checkpoint(model, VOCAB), folder / "best.pt")


def requests(seed: int, n: int) -> list[dict]:
    """n completions: most after one of four prefixes, one past the engine's chunk of 64 tokens, a
    quarter sampled, some streamed and dropped after their first piece, some echoing their scored prompt."""
    rng = random.Random(seed)
    text = lambda k: "".join(rng.choice("abcdefgh ,.\n") for _ in range(k))  # noqa: E731
    prefixes = [text(rng.randrange(10, 30)) for _ in range(3)] + [text(80)]
    out = []
    for i in range(n):
        prompt = (rng.choice(prefixes) if rng.random() < 0.8 else "") + text(rng.randrange(1, 8))
        ask = dict(prompt=prompt, max_tokens=rng.randrange(2, 4), logprobs=TOP, temperature=0)
        if rng.random() < 0.25:
            ask.update(temperature=0.9, seed=i)
        elif rng.random() < 0.15:
            ask.update(echo=True)
        out.append((ask, rng.random() < 0.1))  # the second: streamed and dropped midway
    return out


def send(api, ask: dict, drop: bool):
    if drop:
        stream = api.completions.create(model=None, stream=True, **ask)
        next(iter(stream))
        stream.close()
        return None
    return api.completions.create(model=None, **ask)


def alone(model, ask: dict, int8: bool) -> list:
    """The greedy request alone on an empty engine, scored as serve.py scores it: (token, logprob, top)."""
    engine = Engine(model, n_blocks=2 * BLOCK // BLOCK_TOKENS, block_tokens=BLOCK_TOKENS, int8=int8)
    ids = VOCAB.encode(ask["prompt"])
    kept = Kept(draws=True, prompt=ask.get("echo", False))
    request = engine.add(0, ids, ask["max_tokens"], kept=kept)
    list(engine.run())
    drawn = request.tokens[len(ids):]
    scored = score(torch.stack(kept.logits), drawn, TOP, VOCAB.decode)
    if kept.prompt:  # the prompt's first token has no log-probability
        rows = torch.cat(kept.prompt_logits) if kept.prompt_logits else None
        scored = ChoiceScores(TOP, VOCAB.decode).prompt(ids, rows) + scored
    return [(s.token, s.logprob, s.top) for s in scored]


def first_counts(served, stop: threading.Event) -> dict:
    """Each request's cached tokens when it first ran, from the census after each pass, read until stop."""
    counts, seq = {}, 0
    while True:
        done = stop.is_set()
        with urllib.request.urlopen(f"{served.url}/timeline?since={seq}", timeout=30) as response:
            moments = json.loads(response.read())["moments"]
        assert not moments or moments[0]["seq"] == seq + 1, "passes went unseen"
        for moment in moments:
            for r in moment["requests"]:
                if r["state"] in ("prefilling", "decoding"):
                    counts.setdefault(r["id"], r["cached_tokens"])
            seq = moment["seq"]
        if done:
            return counts
        time.sleep(0.05)


@pytest.mark.parametrize("design, kv_cache, precision", RUNS)
def test_greedy_logprobs_equal_the_request_alone_to_the_bit_under_random_traffic(tmp_path, design, kv_cache,
                                                                                   precision):
    checkpoint = checkpoint_of(tmp_path, design)
    # 40 blocks: a full context takes 32, so requests preempt; prompts past 64 tokens (the engine's chunk) chunk
    served = Served(checkpoint, "--kv-cache", kv_cache, "--precision", precision, "--block-tokens", BLOCK_TOKENS,
                    "--blocks", 40, "--max-batch", 12)
    stop = threading.Event()
    try:
        api = openai.OpenAI(base_url=served.api, api_key="unused", max_retries=0, timeout=60)
        asks = requests(seed=len(design), n=200)
        with ThreadPoolExecutor(24) as pool:
            watching = pool.submit(first_counts, served, stop)
            answers = list(pool.map(lambda job: send(api, *job), asks))
            stop.set()
            counts = watching.result()
        with urllib.request.urlopen(served.url + "/metrics", timeout=30) as response:
            metrics = dict(line.rsplit(" ", 1) for line in response.read().decode().splitlines()
                           if not line.startswith("#"))
    finally:
        served.stop()
    assert float(metrics["kvgpt_preemptions_total"]) > 0 and float(metrics["kvgpt_prefix_cache_hit_tokens_total"]) > 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server decodes (tests/serving.py: ENV)
    try:
        model = load_model(checkpoint, precision=precision)[0]
        greedy = 0
        for (ask, drop), answer in zip(asks, answers):
            if answer is None:
                continue
            assert answer.usage.prompt_tokens_details.cached_tokens == counts[answer.id + "-0"], ask
            if ask["temperature"]:
                continue
            logprobs = answer.choices[0].logprobs
            served_scores = list(zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs))
            assert served_scores == alone(model, ask, kv_cache == "int8"), ask
            greedy += 1
    finally:
        torch.set_num_threads(threads)
    assert greedy > 100
