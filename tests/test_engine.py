"""Many requests over one pool of blocks (model/serving/paged.py, model/serving/engine.py), under random schedules: every draw's
logits equal a full forward over the request's own text, each greedy text equals the request decoded alone with
the contiguous cache, a shared block is never written, and every block is free at the end."""

import random

import pytest
import torch
import torch.nn.functional as F

from model import GREEDY, Sampling, generate
from model.serving import buckets as buckets_module, engine as engine_module
from model.serving.engine import Engine
from model.serving.rowwise import RowsAlone
from tiny_models import VOCAB, random_model
from tolerance import assert_forward_close, assert_within, linear_bound
from model.caches.factory import new_kv_cache

BLOCK = 40  # the models' block_size: room for a shared prefix, a request's own prompt and its draws


class CheckedPass(engine_module.PagedPass):
    """A PagedPass that first checks that no slot it writes belongs to a block another sequence reads."""

    def __init__(self, pool, *tensors):
        super().__init__(pool, *tensors)
        written = {int(slot) // pool.block_tokens for slot in self.write if slot != pool.scratch}
        assert all(pool.refs[block] == 1 for block in written), "a shared block was written"


def random_schedule(model, seed: int, n_blocks: int, block_tokens: int, chunk: int, max_batch: int, int8=False,
                    sampling=GREEDY, buckets=False):
    """Requests arriving between steps, half of them after one of two common prefixes; returns the engine and
    each request's prompt, draws and max_new_tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(6, 14))] for _ in range(2)]
    arrivals = []
    for i in range(10):
        own = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))]
        prompt = (rng.choice(prefixes) if rng.random() < 0.6 else []) + own
        arrivals.append((f"r{i}", prompt, rng.randrange(1, BLOCK - len(prompt) + 1)))
    engine = Engine(model, n_blocks=n_blocks, block_tokens=block_tokens, chunk=chunk, max_batch=max_batch,
                    keep_logits=True, int8=int8, sampling=sampling, buckets=buckets)
    requests, drawn = {}, {name: [] for name, _, _ in arrivals}
    pending = list(arrivals)
    while pending or engine.waiting or engine.running:
        while pending and (rng.random() < 0.4 or not (engine.waiting or engine.running)):
            name, prompt, new = pending.pop(0)
            seeded = torch.Generator().manual_seed(int(name[1:])) if sampling is not GREEDY else None
            requests[name] = (prompt, new, engine.add(name, prompt, new, generator=seeded))
        for name, token in engine.step() if (engine.waiting or engine.running) else []:
            drawn[name].append(token)
    return engine, requests, drawn


SCHEDULES = [(0, 10, 4, 5, 4),  # a pool just large enough for the longest request: preemptions
             (1, 40, 4, 64, 8), (2, 12, 8, 3, 3), (3, 24, 2, 7, 16)]
DESIGNS = [dict(), dict(pos_emb="rope", n_kv_head=1), dict(kv_share=2), dict(kv_latent=8), dict(learned_sink=True)]


@pytest.mark.parametrize("overrides, seed, n_blocks, block_tokens, chunk, max_batch",
                         [(design, *schedule) for design in DESIGNS[:2] for schedule in SCHEDULES]
                         + [(design, *SCHEDULES[0]) for design in DESIGNS[2:]])
@torch.no_grad()
def test_random_schedules_decode_every_request_as_if_alone(monkeypatch, overrides, seed, n_blocks, block_tokens,
                                                           chunk, max_batch):
    model = random_model(block_size=BLOCK, **overrides)
    monkeypatch.setattr(engine_module, "PagedPass", CheckedPass)
    engine, requests, drawn = random_schedule(model, seed, n_blocks, block_tokens, chunk, max_batch)
    for name, (prompt, new, request) in requests.items():
        assert request.tokens == prompt + drawn[name] and len(drawn[name]) == new
        for k, logits in enumerate(request.logits):
            context = torch.tensor([request.tokens[:len(prompt) + k]])
            assert_forward_close(logits, model(context)[0][0, -1], model)
        alone = generate(model, torch.tensor([prompt]), new, sampling=GREEDY)
        assert alone[0].tolist() == request.tokens
    pool = engine.pool
    assert pool.refs == [0] * n_blocks and pool.available() == n_blocks
    if n_blocks == 10:
        assert engine.stats.preemptions > 0


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("overrides", DESIGNS, ids=["plain", "rope-mqa", "shared", "latent", "sink"])
@torch.no_grad()
def test_decoding_steps_padded_to_a_batch_bucket_give_each_request_the_logits_it_gets_unpadded(monkeypatch,
                                                                                              overrides, int8):
    """The fixed-shape passes that a GPU captures, run eagerly: batches of 3, 5, 7 ... rows padded to 4, 8, 16."""
    model = random_model(block_size=BLOCK, **overrides)
    monkeypatch.setattr(engine_module, "PagedPass", CheckedPass)
    monkeypatch.setattr(buckets_module, "PagedPass", CheckedPass)
    padded = []
    decode = buckets_module.DecodeBuckets.decode
    monkeypatch.setattr(buckets_module.DecodeBuckets, "decode",
                        lambda self, ids, *rest: padded.append(len(ids)) or decode(self, ids, *rest))
    _, requests, drawn = random_schedule(model, 3, 24, 2, 7, 16, int8=int8, buckets=True)
    _, unpadded, unpadded_drawn = random_schedule(model, 3, 24, 2, 7, 16, int8=int8)
    assert drawn == unpadded_drawn
    for name, (_, _, request) in requests.items():
        assert torch.equal(torch.stack(request.logits), torch.stack(unpadded[name][2].logits)), name
    assert set(padded) - set(buckets_module.bucket_sizes(16)), "no batch needed padding"


@pytest.mark.parametrize("seed, n_blocks, block_tokens, chunk, max_batch", SCHEDULES[:2])
@torch.no_grad()
def test_an_int8_pool_decodes_every_request_as_the_int8_cache_decodes_it_alone(seed, n_blocks, block_tokens,
                                                                                chunk, max_batch):
    model = random_model(block_size=BLOCK, pos_emb="rope", n_kv_head=1)
    engine, requests, drawn = random_schedule(model, seed, n_blocks, block_tokens, chunk, max_batch, int8=True)
    assert engine.pool.k[0].dtype == torch.int8
    for name, (prompt, new, request) in requests.items():
        cache = new_kv_cache(model, 1, dtype=torch.int8)
        alone = [model.decode_step(torch.tensor([prompt]), cache)]
        for token in drawn[name][:-1]:
            alone.append(model.decode_step(torch.tensor([[token]]), cache))
        assert_forward_close(torch.stack(request.logits), torch.cat(alone), model)
        assert drawn[name] == [int(logits.argmax()) for logits in alone]


@pytest.mark.parametrize("seed, n_blocks, block_tokens, chunk, max_batch", SCHEDULES[:2])
@torch.no_grad()
def test_seeded_sampling_gives_each_request_its_text_alone(seed, n_blocks, block_tokens, chunk, max_batch):
    """Each request draws with a generator of its own: its sampled text is the one generate draws with the same
    seed, whatever the schedule."""
    model = random_model(block_size=BLOCK, pos_emb="rope")
    sampling = Sampling(temperature=0.8, top_k=8)
    engine, requests, drawn = random_schedule(model, seed, n_blocks, block_tokens, chunk, max_batch, sampling=sampling)
    for name, (prompt, new, request) in requests.items():
        alone = generate(model, torch.tensor([prompt]), new, sampling=sampling,
                         generator=torch.Generator().manual_seed(int(name[1:])))
        assert alone[0].tolist() == request.tokens


def test_the_prefix_cache_computes_a_shared_prompt_once():
    model = random_model(block_size=BLOCK)
    engine = Engine(model, n_blocks=32, block_tokens=4)
    preamble = list(range(VOCAB)) + [1, 2, 3]  # 16 tokens: 4 full blocks
    for i in range(4):
        engine.add(i, preamble + [i], 3)
    list(engine.run())
    # the first computes the 4 blocks; the others read them (admitted one per step after the first's prefill)
    assert engine.stats.reused_tokens == 3 * 16 and engine.stats.prompt_tokens == 4 * 17


@torch.no_grad()
def test_a_block_is_named_by_every_token_before_it():
    """The same four tokens as a text's second block are not its first block: B reads A's first block only."""
    model = random_model(block_size=BLOCK)
    engine = Engine(model, n_blocks=32, block_tokens=4, keep_logits=True)
    same = [3, 1, 4, 1]
    engine.add("a", same + [5, 9], 2)
    list(engine.run())
    b = engine.add("b", same + same + [5, 9], 2)
    list(engine.run())
    assert engine.stats.reused_tokens == 4
    assert_forward_close(b.logits[0], model(torch.tensor([b.tokens[:10]]))[0][0, -1], model)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(n_blocks=0), "n_blocks must be an integer >= 1, got 0"),
    (dict(n_blocks=4, model=dict(window_pattern="LG", local_window=4)),
     r"this model has local layers \(window_pattern\)"),
    (dict(n_blocks=4, block_tokens=2.5), "block_tokens must be an integer >= 1"),
])
def test_settings_that_cannot_work_are_refused(kwargs, fragment):
    model = random_model(**kwargs.pop("model", {}))
    with pytest.raises(ValueError, match=fragment):
        Engine(model, **kwargs)


@pytest.mark.parametrize("prompt, new, fragment", [
    ([], 3, "at least one prompt token"), ([1] * 10, 7, "pass block_size=16"), ([1] * 9, 4, "more than the pool")])
def test_requests_that_cannot_be_served_are_refused(prompt, new, fragment):
    engine = Engine(random_model(), n_blocks=3, block_tokens=4)
    with pytest.raises(ValueError, match=fragment):
        engine.add("r", prompt, new)


@torch.no_grad()
def test_a_prefix_saved_and_loaded_into_another_engine_is_read_not_computed(tmp_path):
    """The blocks go through a file (sampling/session.py), and the request that reads them decodes as if alone."""
    from sampling.session import load_session, save_session
    model = random_model(block_size=BLOCK)
    preamble = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]  # 3 full blocks of 4, then 2 tokens
    first = Engine(model, n_blocks=16, block_tokens=4)
    first.add("a", preamble + [1], 2)
    list(first.run())
    save_session(tmp_path / "prefix.pt", first.pool.export_prefix(preamble), "model.pt", model)
    second = Engine(model, n_blocks=16, block_tokens=4, keep_logits=True)
    assert second.pool.import_prefix(load_session(tmp_path / "prefix.pt", "model.pt", model)) == 3
    b = second.add("b", preamble + [2, 7], 3)
    list(second.run())
    assert second.stats.reused_tokens == 12
    assert b.tokens == generate(model, torch.tensor([preamble + [2, 7]]), 3, sampling=GREEDY)[0].tolist()
    for k, logits in enumerate(b.logits):
        full = model(torch.tensor([b.tokens[:len(preamble) + 2 + k]]))[0][0, -1]
        assert_forward_close(logits, full, model)
    other = Engine(random_model(block_size=BLOCK, n_kv_head=1), n_blocks=16, block_tokens=4)
    with pytest.raises(ValueError, match="do not fit this pool"):
        other.pool.import_prefix(first.pool.export_prefix(preamble))


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("overrides", DESIGNS[:2], ids=["plain", "rope-mqa"])
@torch.no_grad()
def test_a_request_decodes_to_the_same_bits_whatever_decodes_beside_it(overrides, int8):
    """Decoding is batch-invariant: once prefilled, a request's logits are those it gets alone, to the last bit,
    while 0 to 6 others of every length decode beside it. A matmul may round by how many rows share it, and an
    int8 pool turns such a rounding into a whole int8 step of a key."""
    model = random_model(block_size=BLOCK, **overrides)
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(5)]
    engines = [Engine(model, n_blocks=80, block_tokens=4, max_batch=8, keep_logits=True, int8=int8)
               for _ in range(2)]
    alone, beside = (engine.add("r", prompt, 30) for engine in engines)
    list(engines[0].run())
    engines[1].step()  # its prompt, alone: the others join as it decodes
    others = [engines[1].add(i, [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))], rng.randrange(1, 25))
              for i in range(8)]
    forward, batches = engines[1]._forward, []
    engines[1]._forward = lambda requests, counts: batches.append(len(requests) * (beside in requests)) or \
        forward(requests, counts)
    list(engines[1].run())
    assert len(set(batches) - {0, 1}) >= 3 and all(other.drawn for other in others)  # many batch sizes
    assert torch.equal(torch.stack(beside.logits), torch.stack(alone.logits))


def test_rows_alone_computes_what_f_linear_computes():
    """Inside RowsAlone, F.linear of any rows (with and without bias) gives F.linear's values, row by row the
    bits of that row alone."""
    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 32), torch.randn(48), torch.randn(3, 7, 32)
    with RowsAlone():
        y, no_bias = F.linear(x, weight, bias), F.linear(x, weight)
        alone = torch.stack([F.linear(x[b, i:i + 1], weight, bias)[0] for b in range(3) for i in range(7)])
    # two float32 sums of 32 products (and a bias), each in its own order: 2 gamma(33) sum |x||w| + |b| apart at most
    assert_within(y, F.linear(x, weight, bias), 2 * linear_bound(x, weight, bias))
    assert_within(no_bias, F.linear(x, weight), 2 * linear_bound(x, weight))
    assert torch.equal(y.reshape(21, 48), alone)


@torch.no_grad()
def test_each_request_draws_with_its_own_sampling_and_generator():
    """Three requests side by side, each with its own settings, each drawing what generate draws for it alone."""
    model = random_model(block_size=BLOCK, pos_emb="rope")
    settings = [GREEDY, Sampling(temperature=0.7, top_k=5), Sampling(temperature=1.3, top_p=0.9)]
    prompt = [3, 1, 4, 1, 5]
    engine = Engine(model, n_blocks=32, block_tokens=4, sampling=Sampling(temperature=2.0))
    requests = [engine.add(i, prompt, 20, generator=torch.Generator().manual_seed(i), sampling=sampling)
                for i, sampling in enumerate(settings)]
    list(engine.run())
    for i, (sampling, request) in enumerate(zip(settings, requests)):
        alone = generate(model, torch.tensor([prompt]), 20, sampling=sampling,
                         generator=torch.Generator().manual_seed(i))
        assert request.tokens == alone[0].tolist(), i


@torch.no_grad()
def test_a_cancelled_request_gives_its_blocks_back_at_once_and_the_others_decode_as_if_alone():
    model = random_model(block_size=BLOCK)
    engine = Engine(model, n_blocks=12, block_tokens=4, max_batch=2)
    kept = engine.add("kept", [5, 6, 7], 20)
    running = engine.add("running", [1, 2, 3, 4, 5, 6], 20)
    waiting = engine.add("waiting", [2, 2], 20)
    for _ in range(3):
        engine.step()
    assert running in engine.running and waiting in engine.waiting
    held = len(running.blocks)
    before = engine.pool.available()
    engine.cancel(running)
    engine.cancel(waiting)
    assert engine.pool.available() == before + held and not engine.waiting and engine.running == [kept]
    list(engine.run())
    assert kept.tokens == generate(model, torch.tensor([[5, 6, 7]]), 20, sampling=GREEDY)[0].tolist()
    assert engine.pool.refs == [0] * 12 and engine.pool.available() == 12
