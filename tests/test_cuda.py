"""The GPU path: the suite's proofs again on a CUDA device, where attention reads every slot of the ring, masked.
`python -m pytest -m cuda` runs them on a CUDA machine (bench/gpu_proof.sh does); the default run leaves them out."""

import copy
import subprocess
import sys

import numpy as np
import pytest
import torch

from corpus import REPO
from data import Batches
from model import GREEDY, Sampling, generate
from model.decoding.cached_text import text_cache
from model.decoding.cuda_graph import CapturedStep
from model.serving.conversation import Conversation
from model.serving.engine import Engine
from model.serving.speculative import speculative_generate
from test_speculative import perturbed
from test_train import TINY, data_overrides
from tiny_models import BLOCK_SIZE, random_model, random_tokens
from model.caches.factory import new_kv_cache
from model.caches.ring import Uncached

DEVICE = "cuda"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROWS, PROMPT = 2, 5
PAD = torch.tensor([0, 3])  # the second row starts with 3 tokens of left padding
STEPS = {"learned": BLOCK_SIZE, "rope": 3 * BLOCK_SIZE}  # rotary positions go on past the ring's wrap


def test_batches_on_the_device_are_the_cpus_batches():
    tokens = np.random.default_rng(0).permutation(5000).astype(np.uint16)  # a window's first token is its offset
    cpu = Batches(tokens, block_size=8, batch_size=4, seed=5)
    device = Batches(tokens, block_size=8, batch_size=4, device=DEVICE, seed=5)
    for _ in range(3):
        (x, y), (x_device, y_device) = cpu.next(), device.next()
        assert x_device.device.type == y_device.device.type == DEVICE
        assert torch.equal(x, x_device.cpu()) and torch.equal(y, y_device.cpu())


def assert_steps_give_full_forward_logits(model, decode_step, cache, pos_emb, pad=PAD):
    """One-token steps through decode_step; at each, the logits of a full forward over the same context, on the
    device and on the CPU. pad: each row's left padding."""
    cpu_model = copy.deepcopy(model).cpu()  # the same weights, on the CPU
    seq = random_tokens(cache.batch_size, STEPS[pos_emb], seed=2)
    cache.reset(pad.to(DEVICE))
    model.decode_step(seq[:, :PROMPT].to(DEVICE), cache)  # the prompt, eagerly
    for t in range(PROMPT, seq.size(1)):
        logits = decode_step(seq[:, t:t + 1].to(DEVICE), cache)
        torch.testing.assert_close(logits, model(seq[:, :t + 1].to(DEVICE), cache=Uncached(model.config.block_size, pad.to(DEVICE)))[0][:, -1],
                                   rtol=1e-5, atol=1e-5, msg=f"step {t}, against the device's full forward")
        torch.testing.assert_close(logits.cpu(), cpu_model(seq[:, :t + 1], cache=Uncached(model.config.block_size, pad))[0][:, -1],
                                   rtol=1e-4, atol=1e-4, msg=f"step {t}, against the CPU's full forward")


@pytest.mark.parametrize("pos_emb", STEPS)
def test_cached_steps_give_the_logits_of_a_full_forward(pos_emb):
    model = random_model(seed=1, pos_emb=pos_emb).to(DEVICE)
    cache = new_kv_cache(model, ROWS)
    assert_steps_give_full_forward_logits(model, model.decode_step, cache, pos_emb)


@pytest.mark.parametrize("rows", [1, 8], ids=["batch 1", "a batch bucket of 8"])
@pytest.mark.parametrize("pos_emb", STEPS)
def test_the_captured_step_gives_the_logits_of_a_full_forward_at_every_step(pos_emb, rows):
    """A CUDA graph replayed at every step, past the ring's wrap (rope) and across refills (learned positions):
    each step's logits are a full forward's, and generate's greedy text is the eager step's."""
    model = random_model(seed=1, pos_emb=pos_emb).to(DEVICE)
    cache = new_kv_cache(model, rows)
    step = CapturedStep(model, cache)
    pad = torch.tensor([0, 3] * (rows // 2) if rows > 1 else [0])  # every other row left-padded
    assert_steps_give_full_forward_logits(model, step.decode_step, cache, pos_emb, pad)
    prompt = random_tokens(rows, PROMPT, seed=3).to(DEVICE)
    eager = generate(model, prompt, 3 * BLOCK_SIZE, sampling=GREEDY)
    assert torch.equal(generate(model, prompt, 3 * BLOCK_SIZE, sampling=GREEDY, cache=cache, step=step), eager)


@pytest.mark.parametrize("captured", [True, False], ids=["captured", "eager"])
def test_sampled_steps_never_make_the_host_wait(captured):
    """Top-k and top-p sampling and the step, past the ring's wrap, under torch's sync check set to error."""
    model = random_model(seed=1, pos_emb="rope").to(DEVICE)
    cache = new_kv_cache(model, 2)
    step = CapturedStep(model, cache).decode_step if captured else model.decode_step
    sampling, generator = Sampling(temperature=0.8, top_k=5, top_p=0.9), torch.Generator(DEVICE).manual_seed(0)
    ids = sampling.next_token(model.decode_step(random_tokens(2, PROMPT).to(DEVICE), cache), generator)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3 * BLOCK_SIZE):
            ids = sampling.next_token(step(ids[:, None], cache), generator)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("pos_emb", STEPS)
def test_speculative_decoding_through_captured_passes_keeps_the_greedy_text(pos_emb):
    """The verification passes of 1 to k + 1 tokens and the draft's steps replay graphs, across rollbacks."""
    cpu_model = random_model(seed=1, pos_emb=pos_emb)
    draft, model = perturbed(cpu_model, 0.05).to(DEVICE), cpu_model.to(DEVICE)
    k, prompt = 3, random_tokens(1, PROMPT, seed=3).to(DEVICE)
    verify, draft_step = CapturedStep(model, text_cache(model, k), k + 1), CapturedStep(draft, text_cache(draft, k))
    new = list(speculative_generate(model, prompt, 3 * BLOCK_SIZE, draft=draft, k=k, verify_pass=verify,
                                    draft_step=draft_step))
    assert torch.equal(torch.cat([prompt[0], *new]), generate(model, prompt, 3 * BLOCK_SIZE, sampling=GREEDY)[0])


@pytest.mark.parametrize("pos_emb", STEPS)
def test_a_conversation_through_a_captured_step_replies_as_an_eager_one(pos_emb):
    model = random_model(seed=1, pos_emb=pos_emb).to(DEVICE)
    eager, captured = Conversation(model), Conversation(model)
    captured.decode_through(CapturedStep(model, captured.text.cache))
    for turn in range(4):  # past block_size: learned positions refill, rotary ones roll
        new = random_tokens(1, 3, seed=turn)[0].tolist()
        assert list(captured.reply(new, BLOCK_SIZE // 2)) == list(eager.reply(new, BLOCK_SIZE // 2)), f"turn {turn}"


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_the_engine_replays_a_graph_per_batch_bucket_and_draws_what_eager_passes_draw(int8):
    model = random_model(seed=1, pos_emb="rope", n_kv_head=1).to(DEVICE)
    drawn = {}
    for buckets in (False, None):  # None: captured, on CUDA
        engine = Engine(model, n_blocks=24, block_tokens=4, max_batch=4, int8=int8, buckets=buckets,
                        keep_logits=True)
        assert (engine.buckets is not None and len(engine.buckets.graphs) == 3) == (buckets is None)
        for i in range(6):
            engine.add(i, random_tokens(2, seed=i).tolist(), 3 + 2 * i)
        drawn[buckets] = list(engine.run())
    assert drawn[None] == drawn[False]


def test_train_py_trains_on_the_device_and_sample_py_decodes_there_alike_with_and_without_the_cache(tmp_path):
    run_dir = tmp_path / "run"
    trained = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, *data_overrides(tmp_path / "data"),
                              f"device={DEVICE}", "train.max_iters=200", f"hydra.run.dir={run_dir}"],
                             capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr
    assert f" on {DEVICE} in " in trained.stdout.splitlines()[0], trained.stdout.splitlines()[0]
    assert torch.load(run_dir / "last.pt", weights_only=True)["training"]["step"] == 200
    texts = []
    for flags in [[], ["--no-kv-cache"]]:
        sampled = subprocess.run([sys.executable, str(REPO / "sample.py"), "--checkpoint", str(run_dir),
                                  "--device", DEVICE, "--temperature", "0", "--max-new-tokens", "60",
                                  "--prompt", "ROMEO:", *flags], capture_output=True, text=True, timeout=300)
        assert sampled.returncode == 0, sampled.stderr
        texts.append(sampled.stdout)
    assert texts[0] == texts[1] and texts[0].startswith("ROMEO:\n")
    assert len(set(texts[0])) > 8  # words, not one letter over and over
