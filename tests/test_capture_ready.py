"""The one-token step as a GPU captures it, proven on the CPU, over a ring that reads every slot through its mask:
- it makes no read back to the host: run on fake tensors, which hold no values, it still runs, while any .item(),
  int() or Python branch on a tensor's value raises;
- it compiles into one graph with fullgraph=True, and never again over 3 x block_size steps past the ring's wrap;
- its logits are the eager step's, and its greedy text is full recomputation's."""

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from model import GREEDY, Sampling, generate, new_kv_cache
from model.decoding.aot_step import swap_buffers
from model.decoding.cuda_graph import CapturedStep
from model.decoding.generate import prefill
from test_kv_designs import design_model
from tiny_models import BLOCK_SIZE, random_model, random_tokens

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
    torch.testing.assert_close(logits["compiled"], logits["eager"], atol=1e-4, rtol=0)


@torch.no_grad()
def step_on_fake_tensors(model, cache, sampling=None):
    """One step of model through cache, and a draw from its logits, with every tensor fake: shapes, no values."""
    mode = FakeTensorMode()
    weights = {name: mode.from_tensor(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    own = swap_buffers(cache, {name: mode.from_tensor(t) for name, t in cache.named_buffers()})
    try:
        with mode:
            idx = torch.zeros(cache.batch_size, 1, dtype=torch.long)
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
