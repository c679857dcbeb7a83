"""The one-token step as a GPU captures it, proven on the CPU, over a ring that reads every slot through its mask:
- it makes no read back to the host: run on fake tensors, which hold no values, it still runs, while any .item(),
  int() or Python branch on a tensor's value raises;
- it compiles into one graph with fullgraph=True, and never again over 3 x block_size steps past the ring's wrap;
- its logits are the eager step's, and its greedy text is full recomputation's.
Speculative decoding's passes of up to k + 1 tokens, a draft model's steps and the engine's passes padded to a
batch bucket are held to the same."""

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from model import GREEDY, Sampling, generate, new_kv_cache
import model.caches.ring as ring_cache
from model.decoding.aot_step import swap_buffers
from model.decoding.cached_text import text_cache
from model.decoding.cuda_graph import CapturedStep
from model.decoding.generate import prefill
from model.serving.buckets import DecodeBuckets
from model.serving.engine import Engine
from model.serving.speculative import speculative_generate
from test_speculative import perturbed
from test_kv_designs import design_model
from tiny_models import BLOCK_SIZE, random_model, random_tokens
from tolerance import assert_forward_close

STEPS = 3 * BLOCK_SIZE  # the ring wraps twice


@torch.no_grad()  # as decoding runs: a compiled step that writes grad-carrying keys into the cache is another graph
def steps_once_compiled(model, dtype, n_pad):
    """The eager and the compiled step's logits over STEPS one-token steps after a prompt, and the graphs compiled."""
    prompt = random_tokens(2, 5, seed=3)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    logits = {}
    for name, step in (("eager", model.decode_step), ("compiled", torch.compile(model.decode_step, fullgraph=True))):
        cache = new_kv_cache(model, 2, dtype=dtype, read_all_slots=True)
        cache.reset(n_pad)
        out = [prefill(model, prompt, cache)]
        out += [step(out[-1].argmax(-1, keepdim=True), cache) for _ in range(STEPS)]
        logits[name] = torch.stack(out)
    return logits, torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("dtype", [None, torch.int8], ids=["float", "int8"])
@pytest.mark.parametrize("design", ["plain", pytest.param("gqa-share2", marks=pytest.mark.slow),
                                    pytest.param("local-sink-gqa", marks=pytest.mark.slow),
                                    pytest.param("mla", marks=pytest.mark.slow)])
def test_the_one_token_step_compiles_into_one_graph_and_never_again_past_the_wrap(design, dtype):
    model = random_model(pos_emb="rope") if design == "plain" else design_model(design, "rope")
    logits, graphs = steps_once_compiled(model, dtype, n_pad=torch.tensor([0, 2]))
    assert graphs == 1, f"{graphs} graphs: the step broke into pieces or compiled again"
    assert_forward_close(logits["compiled"], logits["eager"], model)


@torch.no_grad()
def step_on_fake_tensors(model, cache, sampling=None, tokens=1):
    """One pass of `tokens` tokens per row of model through cache, and a draw from its last logits, with every
    tensor fake: shapes, no values."""
    mode = FakeTensorMode()
    weights = {name: mode.from_tensor(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    own = swap_buffers(cache, {name: mode.from_tensor(t) for name, t in cache.named_buffers()})
    try:
        with mode:
            idx = torch.zeros(cache.batch_size, tokens, dtype=torch.long)
            logits = torch.func.functional_call(model, weights, (idx,), {"cache": cache}, strict=False)[0][:, -1]
            return logits if sampling is None else sampling.next_token(logits)
    finally:
        swap_buffers(cache, own)


@pytest.mark.parametrize("dtype", [None, torch.int8], ids=["float", "int8"])
@pytest.mark.parametrize("design", ["plain", "gqa-share2", "local-sink-gqa", "mla"])
def test_a_step_makes_no_read_back_to_the_host(design, dtype):
    model = random_model(pos_emb="rope") if design == "plain" else design_model(design, "rope")
    cache = new_kv_cache(model, 2, dtype=dtype, read_all_slots=True)
    cache.reset(torch.tensor([0, 2]))
    prefill(model, random_tokens(2, 5), cache)  # eagerly: a prefill checks its chunk against the cache
    sampling = Sampling(temperature=0.8, top_k=5, top_p=0.9)
    assert step_on_fake_tensors(model, cache, sampling).shape == (2,)


@pytest.mark.parametrize("design", ["plain", "gqa-share2", "mla"])
def test_a_verification_pass_of_k_plus_1_tokens_makes_no_read_back_to_the_host(design, monkeypatch):
    """Through the ring speculative decoding keeps (k spare slots), rolled back and wrapped, as a capture sees it:
    the chunk's fit is checked by its caller before capture, never inside the pass."""
    model = random_model(pos_emb="rope") if design == "plain" else design_model(design, "rope")
    k = 3
    cache = text_cache(model, k)
    cache.read_all_slots = True
    prefill(model, random_tokens(1, BLOCK_SIZE + 2), cache)  # past the ring's wrap
    cache.rollback(k)
    monkeypatch.setattr(ring_cache, "recording", lambda: True)
    assert step_on_fake_tensors(model, cache, Sampling(temperature=0.7, top_p=0.8), tokens=k + 1).shape == (1,)


class CompiledPasses:
    """A stand-in for CapturedStep on the CPU: the same passes of 1 to `tokens` tokens through its own cache,
    compiled with fullgraph=True instead of captured."""

    def __init__(self, model, cache, tokens=1):
        self.cache, self.tokens = cache, tokens
        self.run = torch.compile(lambda idx, cache: model(idx, cache=cache)[0], fullgraph=True)

    def fits(self, cache, tokens=1):
        return cache is self.cache and self.takes(tokens)

    def takes(self, tokens):
        return 1 <= tokens <= self.tokens

    def __call__(self, idx, cache):
        return self.run(idx.clone(), cache)

    def decode_step(self, idx, cache):
        return self(idx, cache)[:, -1]


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_speculative_passes_compile_once_per_length_and_keep_the_greedy_text(pos_emb):
    """The verification pass of 1 to k + 1 tokens and the draft's one-token step, each through its own cache
    in one graph per length, never compiled again over 3 x block_size tokens of accepts and rollbacks."""
    model = random_model(pos_emb=pos_emb)
    draft = perturbed(model, 0.05)
    k, prompt = 3, random_tokens(1, 5)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    verify = CompiledPasses(model, text_cache(model, k), k + 1)
    draft_step = CompiledPasses(draft, text_cache(draft, k))
    new = list(speculative_generate(model, prompt, STEPS, draft=draft, k=k, verify_pass=verify,
                                    draft_step=draft_step))
    assert torch.equal(torch.cat([prompt[0], *new]), generate(model, prompt, STEPS, sampling=GREEDY)[0])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs <= k + 2, f"{graphs} graphs for {k + 1} pass lengths and the draft's step: some compiled again"


class Call(torch.nn.Module):
    """fn(*inputs) as a module that holds the model, so that functional_call can give the model fake weights."""

    def __init__(self, model, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *inputs):
        return self.fn(*inputs)


def served_engine(model, int8, compile=False):
    """An engine of decoding steps padded to batch buckets of up to 4 rows, and the (request, token) pairs it drew
    for 6 requests that join and leave, so that its running batch takes every size from 1 to 4. compile: its
    bucket pass compiled with fullgraph=True."""
    engine = Engine(model, n_blocks=24, block_tokens=4, max_batch=4, int8=int8, buckets=True)
    if compile:
        engine.buckets.run = torch.compile(engine.buckets.run, fullgraph=True)
    for i in range(6):
        engine.add(i, random_tokens(2, seed=i).tolist(), 3 + 2 * i)
    return engine, list(engine.run())


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@torch.no_grad()
def test_an_engine_bucket_pass_makes_no_read_back_to_the_host(int8):
    model = random_model(pos_emb="rope", n_kv_head=1)
    engine, _ = served_engine(model, int8)
    mode = FakeTensorMode()
    weights = {f"model.{name}": mode.from_tensor(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    pool = engine.pool
    pool.buffers = {name: [mode.from_tensor(t) for t in tensors] for name, tensors in pool.buffers.items()}
    pool.gathered = {name: mode.from_tensor(t) for name, t in pool.gathered.items()}
    inputs = [mode.from_tensor(t) for t in engine.buckets.inputs[4]]
    with mode:
        logits = torch.func.functional_call(Call(model, engine.buckets.run), weights, tuple(inputs), strict=False)
    assert logits.shape == (4, model.config.vocab_size)


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@torch.no_grad()
def test_an_engine_bucket_pass_compiles_once_per_bucket_and_draws_the_same_tokens(int8, monkeypatch):
    model = random_model(pos_emb="rope", n_kv_head=1)
    _, eager = served_engine(model, int8)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    rows = []  # each decoding step's running batch
    decode = DecodeBuckets.decode
    monkeypatch.setattr(DecodeBuckets, "decode", lambda self, ids, *rest: rows.append(len(ids)) or decode(self, ids,
                                                                                                         *rest))
    _, compiled = served_engine(model, int8, compile=True)
    assert compiled == eager
    assert set(rows) == {1, 2, 3, 4}, "the schedule should run batches of every size up to 4"
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 3, f"{graphs} graphs for buckets 1, 2 and 4"


def test_the_fake_run_sees_a_read_back_to_the_host(monkeypatch):
    """The proof's own control: a step that reads the cache's counter back, as len(cache) does, fails there."""
    model = random_model(pos_emb="rope")
    cache = new_kv_cache(model, 1, read_all_slots=True)
    original = type(cache).begin
    monkeypatch.setattr(type(cache), "begin", lambda self, t: original(self, t) if int(self.pos) >= 0 else None)
    with pytest.raises(DataDependentOutputException):
        step_on_fake_tensors(model, cache)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_greedy_text_through_the_capture_ready_step_equals_full_recomputation(pos_emb):
    """generate's compiled step over the masked ring, past block_size (learned positions refill, rotary ones roll)."""
    model = random_model(pos_emb=pos_emb)
    prompt = random_tokens(2, 5)
    torch._dynamo.reset()
    captured = generate(model, prompt, STEPS, sampling=GREEDY, compile=True,
                        cache=new_kv_cache(model, 2, read_all_slots=True))
    assert torch.equal(captured, generate(model, prompt, STEPS, sampling=GREEDY, use_cache=False))


def test_a_step_is_captured_only_on_a_cuda_device():
    """On the CPU the captured step is refused in one line; the CPU's compiled step is AOTInductor's."""
    model = random_model()
    with pytest.raises(ValueError, match="a CUDA graph records a step on a CUDA device, and the cache is on cpu"):
        CapturedStep(model, new_kv_cache(model, 1))
