"""The one-token step compiled ahead of time (model/decoding/aot_step.py, sampling/compiled_step.py): at every step it
gives the logits of a full forward over the same context, it reads the weights of the model it is bound to, and
a step kept on disk is loaded, not compiled again, for that shape only."""

import argparse
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import runtime.devices
import sampling.setup

from model import GREEDY, Sampling, generate
from model.decoding.aot_step import AotStep, export_step
from model.decoding.cached_text import text_cache
from model.serving.conversation import Conversation
from model.serving.speculative import PromptLookup, SpeculativeStats, speculative_generate
from sampling.compiled_step import has_compiled_step, load_or_compile_step, step_path
from tiny_models import BLOCK_SIZE, random_model, random_tokens
from tolerance import assert_forward_close
from model.caches.factory import new_kv_cache
from model.caches.ring import Uncached

REPO = Path(__file__).resolve().parents[1]
ROWS, PROMPT = 2, 5
PAD = torch.tensor([0, 3])  # the second row starts with 3 tokens of left padding


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """A rotary model, a cache of two rows, and the step compiled for them, kept in a folder of its own."""
    folder = tmp_path_factory.mktemp("steps")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVGPT_CACHE_DIR", str(folder))
        model = random_model(seed=1, pos_emb="rope")
        cache = new_kv_cache(model, ROWS)
        start = time.perf_counter()
        step = load_or_compile_step(model, cache)
        compile_seconds = time.perf_counter() - start
        yield model, cache, step, folder, compile_seconds


def test_each_step_gives_the_logits_of_a_full_forward(kept):
    """3 x block_size one-token steps through the compiled step, past the ring's wrap, with a left-padded row:
    the logits equal a full forward over each row's whole context, at every step."""
    model, cache, step, _, _ = kept
    seq = random_tokens(ROWS, PROMPT + 3 * BLOCK_SIZE, seed=2)
    cache.reset(PAD)
    model.decode_step(seq[:, :PROMPT], cache)  # the prompt, eagerly
    for t in range(PROMPT, seq.size(1)):
        logits = step.decode_step(seq[:, t:t + 1], cache)
        full = model(seq[:, :t + 1], cache=Uncached(model.config.block_size, PAD))[0][:, -1]
        assert_forward_close(logits, full, model, f"step {t}")


def test_a_step_reads_only_the_slots_filled_so_far(kept):
    """Until the ring is full, a step reads the slots that hold a token and no further, as the eager pass does: with
    NaN in every slot not yet written, each step's logits still equal a full forward's (reading a NaN value, even
    at weight 0, would make them NaN)."""
    model, cache, step, _, _ = kept
    seq = random_tokens(ROWS, BLOCK_SIZE, seed=5)
    cache.reset(PAD)
    for buffer in [*cache.k, *cache.v]:
        buffer.fill_(torch.nan)
    model.decode_step(seq[:, :PROMPT], cache)  # the prompt, eagerly, into the first slots
    for t in range(PROMPT, seq.size(1)):
        logits = step.decode_step(seq[:, t:t + 1], cache)
        full = model(seq[:, :t + 1], cache=Uncached(model.config.block_size, PAD))[0][:, -1]
        assert_forward_close(logits, full, model, f"step {t}")


def test_generate_through_the_step_gives_the_eager_text(kept):
    model, cache, step, _, _ = kept
    prompt = random_tokens(ROWS, PROMPT, seed=3)
    eager = generate(model, prompt, 2 * BLOCK_SIZE, sampling=GREEDY)
    assert torch.equal(generate(model, prompt, 2 * BLOCK_SIZE, sampling=GREEDY, cache=cache, step=step), eager)


def test_a_kept_step_is_loaded_and_reads_the_weights_it_is_given(kept, monkeypatch):
    """Another model of the same shape loads the kept step at once, and the step computes with that model's
    weights, not those it was compiled with."""
    first, _, _, folder, compile_seconds = kept
    monkeypatch.setenv("KVGPT_CACHE_DIR", str(folder))
    model = random_model(seed=7, pos_emb="rope")
    cache = new_kv_cache(model, ROWS)
    assert has_compiled_step(model, cache)
    start = time.perf_counter()
    step = load_or_compile_step(model, cache)
    assert time.perf_counter() - start < compile_seconds / 5
    tokens = random_tokens(ROWS, 1, seed=4)
    cache.reset()
    reference = new_kv_cache(model, ROWS)
    assert_forward_close(step.decode_step(tokens, cache), model.decode_step(tokens, reference), model)
    assert not torch.allclose(first.decode_step(tokens, new_kv_cache(first, ROWS)), model.decode_step(tokens, reference))
    model.load_state_dict(random_model(seed=8, pos_emb="rope").state_dict())  # in place: the step sees it
    cache.reset()
    fresh = new_kv_cache(model, ROWS)
    assert_forward_close(step.decode_step(tokens, cache), model.decode_step(tokens, fresh), model)


def test_a_kept_step_loads_without_importing_the_compiler(kept, tmp_path):
    """A new process loads the kept step and decodes with it, and torch's compiler, whose import alone costs about a
    second of start-up, was never imported."""
    model, _, _, folder, _ = kept
    program = textwrap.dedent(f"""
        import sys, torch
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
        from sampling.compiled_step import has_compiled_step, load_or_compile_step
        from tiny_models import random_model
        from model.caches.factory import new_kv_cache
        model = random_model(seed=1, pos_emb="rope")
        if not has_compiled_step(model, new_kv_cache(model, {ROWS})):
            sys.exit("no step is kept for this model: model/'s code changed since it was compiled?")
        step = load_or_compile_step(model, new_kv_cache(model, {ROWS}), say=lambda line: sys.exit(line))
        torch.save(step.decode_step(torch.ones({ROWS}, 1, dtype=torch.long), new_kv_cache(model, {ROWS})),
                   "logits.pt")
        print("torch._inductor" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "KVGPT_CACHE_DIR": str(folder), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "loading the kept step imported torch's compiler"
    tokens = torch.ones(ROWS, 1, dtype=torch.long)
    assert_forward_close(torch.load(tmp_path / "logits.pt", weights_only=True),
                         model.decode_step(tokens, new_kv_cache(model, ROWS)), model)


def test_another_shape_or_cache_has_another_step(kept, monkeypatch):
    model, cache, _, folder, _ = kept
    monkeypatch.setenv("KVGPT_CACHE_DIR", str(folder))
    paths = {step_path(model, cache),
             step_path(model, new_kv_cache(model, ROWS + 1)),
             step_path(model, new_kv_cache(model, ROWS, dtype=torch.int8)),
             step_path(random_model(pos_emb="rope", n_layer=3), cache),
             step_path(random_model(pos_emb="learned"), cache),
             step_path(random_model(seed=1, pos_emb="rope").to(torch.bfloat16), cache)}
    assert len(paths) == 6


def test_a_step_for_another_thread_count_is_another_step(kept, monkeypatch):
    """Inductor writes a step's loops for the thread count it compiles under (serial for one thread): a step kept
    for one thread is not the step for two."""
    model, cache, _, folder, _ = kept
    monkeypatch.setenv("KVGPT_CACHE_DIR", str(folder))
    one = step_path(model, cache)
    torch.set_num_threads(2)
    try:
        two, kept_for_two = step_path(model, cache), has_compiled_step(model, cache)
    finally:
        torch.set_num_threads(1)
    assert one != two and step_path(model, cache, threads=2) == two
    assert has_compiled_step(model, cache) and not kept_for_two


@pytest.mark.parametrize("asked", [None, 2])
def test_sample_takes_the_thread_count_of_a_kept_step_unless_a_count_was_asked_for(monkeypatch, asked):
    """With no --threads (nor OMP_NUM_THREADS), a step kept for another thread count is loaded at its count;
    with --threads, the count asked for stays, and a short run without a step kept for it decodes eagerly."""
    kept_for = {1}  # a step is kept for one thread
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(runtime.devices, "DEFAULT_THREADS", 2)
    monkeypatch.setattr(sampling.setup, "has_compiled_step",
                        lambda model, cache, tokens=1, packed=False, threads=None:
                        (threads or torch.get_num_threads()) in kept_for)
    monkeypatch.setattr(sampling.setup, "load_or_compile_step", lambda *a, **k: ("step", torch.get_num_threads()))
    model = random_model(seed=1, pos_emb="rope")
    args = argparse.Namespace(compile=None, kv_cache="float", max_new_tokens=10, threads=asked)
    torch.set_num_threads(2)  # the count the thread race chose
    try:
        step = sampling.setup.kept_or_compiled_step(args, model, new_kv_cache(model, ROWS))
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(1)
    assert (step, threads) == ((("step", 1), 1) if asked is None else (None, 2))


def test_a_step_refuses_a_cache_of_another_shape(kept):
    model, _, step, _, _ = kept
    with pytest.raises(ValueError, match="compiled for another cache"):
        generate(model, random_tokens(ROWS + 1, PROMPT), 3, cache=new_kv_cache(model, ROWS + 1), step=step)
    with pytest.raises(ValueError, match="drop compile"):
        generate(model, random_tokens(ROWS, PROMPT), 3, step=step, compile=True)


def test_a_cache_that_decodes_eagerly_is_refused():
    from model.caches.factory import new_cache
    model = random_model(pos_emb="rope")
    with pytest.raises(ValueError, match="decodes eagerly"):
        export_step(model, new_cache(model, "h2o", 1, budget=8))


@pytest.mark.slow
def test_speculative_decoding_verifies_through_a_compiled_pass(kept, monkeypatch):
    """A compiled pass of up to k + 1 tokens takes every pass after the prompt's, shorter drafts' too: greedy text
    is plain greedy text past the ring's wrap, sampled text is the eager verification's for the same seed."""
    model, _, _, folder, _ = kept
    monkeypatch.setenv("KVGPT_CACHE_DIR", str(folder))
    k, prompt = 3, random_tokens(1, PROMPT, seed=6)
    verify_pass = load_or_compile_step(model, text_cache(model, k), k + 1)  # before the hook: tracing runs forward
    eager_passes = []
    hook = model.register_forward_hook(lambda m, args, out: eager_passes.append(args[0].size(1)))
    try:
        stats = SpeculativeStats()
        greedy = speculative_generate(model, prompt, 3 * BLOCK_SIZE, draft=PromptLookup(), k=k, stats=stats,
                                      verify_pass=verify_pass)
        assert torch.equal(torch.cat([prompt[0], *greedy]), generate(model, prompt, 3 * BLOCK_SIZE,
                                                                    sampling=GREEDY)[0])
        assert stats.accepted and stats.drafted < k * stats.passes  # full drafts and shorter ones
        assert not eager_passes  # every pass after the prompt's prefill was compiled
        sampled = [speculative_generate(model, prompt, 2 * BLOCK_SIZE, draft=PromptLookup(), k=k,
                                        sampling=Sampling(temperature=1.0), generator=torch.Generator().manual_seed(0),
                                        verify_pass=passes) for passes in (verify_pass, None)]
        assert torch.equal(*[torch.cat(list(tokens)) for tokens in sampled])
    finally:
        hook.remove()
    with pytest.raises(ValueError, match="verify_pass must be compiled for passes of up to k \\+ 1 = 3 tokens"):
        list(speculative_generate(model, prompt, 4, draft=PromptLookup(), k=2, verify_pass=verify_pass))


@pytest.mark.slow
def test_a_conversation_takes_its_steps_through_a_compiled_step(kept, monkeypatch):
    """Each reply equals the eager conversation's, past block_size, and the reply's steps never run eagerly."""
    model, _, _, folder, _ = kept
    monkeypatch.setenv("KVGPT_CACHE_DIR", str(folder))
    step = load_or_compile_step(model, text_cache(model))
    eager, compiled = Conversation(model), Conversation(model)
    compiled.decode_through(step)
    eager_steps = []
    hook = model.register_forward_hook(lambda m, args, out: eager_steps.append(args[0].size(1)))
    try:
        for turn in range(3):
            line = random_tokens(1, 4, seed=10 + turn)[0].tolist()
            expected = list(eager.reply(line, BLOCK_SIZE))
            eager_steps.clear()
            assert list(compiled.reply(line, BLOCK_SIZE)) == expected
            assert 1 not in eager_steps
    finally:
        hook.remove()
    with pytest.raises(ValueError, match="one-token step compiled for text_cache"):
        Conversation(model).decode_through(load_or_compile_step(model, text_cache(model, 3), 4))


@pytest.mark.slow
def test_a_folder_that_cannot_be_written_still_gives_a_step(tmp_path, monkeypatch):
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("KVGPT_CACHE_DIR", str(tmp_path / "a file" / "kvgpt"))  # no folder can be made there
    model = random_model(seed=1)
    cache = new_kv_cache(model, 1)
    said = []
    step = load_or_compile_step(model, cache, say=said.append)
    assert len(said) == 1 and "it serves this run only" in said[0]
    assert isinstance(step, AotStep) and not has_compiled_step(model, cache)
    prompt = random_tokens(1, PROMPT)
    assert torch.equal(generate(model, prompt, BLOCK_SIZE, sampling=GREEDY, cache=cache, step=step),
                       generate(model, prompt, BLOCK_SIZE, sampling=GREEDY))


@pytest.mark.slow
@pytest.mark.parametrize("design, int8", [
    (dict(n_kv_head=1), False),
    (dict(), True),
    (dict(window_pattern="LG", local_window=5), False),
    (dict(kv_latent=12, kv_latent_rope=4), False),
    (dict(learned_sink=True), False),
], ids=["mqa", "int8 cache", "local and global", "latent", "learned sink"])
def test_each_design_compiles_to_a_step_equal_to_a_full_forward(design, int8, tmp_path, monkeypatch):
    monkeypatch.setenv("KVGPT_CACHE_DIR", str(tmp_path))
    model = random_model(seed=3, pos_emb="rope", n_head=2, n_embd=24, **design)
    cache = new_kv_cache(model, ROWS, dtype=torch.int8 if int8 else None)
    step = load_or_compile_step(model, cache)
    seq = random_tokens(ROWS, PROMPT + 2 * BLOCK_SIZE, seed=5)
    cache.reset(PAD)
    model.decode_step(seq[:, :PROMPT], cache)
    reference = new_kv_cache(model, ROWS, dtype=torch.int8 if int8 else None)  # int8: the eager step's rounding
    reference.reset(PAD)
    model.decode_step(seq[:, :PROMPT], reference)
    for t in range(PROMPT, seq.size(1)):
        logits = step.decode_step(seq[:, t:t + 1], cache)
        expected = model.decode_step(seq[:, t:t + 1], reference) if int8 else model(seq[:, :t + 1], cache=Uncached(model.config.block_size, PAD))[0][:, -1]
        assert_forward_close(logits, expected, model, f"step {t}")


@pytest.mark.slow
def test_a_damaged_kept_step_is_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGPT_CACHE_DIR", str(tmp_path))
    model = random_model(seed=1)
    cache = new_kv_cache(model, 1)
    path = step_path(model, cache)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a package")
    said = []
    step = load_or_compile_step(model, cache, say=said.append)
    assert len(said) == 1 and "could not be loaded" in said[0] and said[0].endswith("compiling it again")
    assert path.stat().st_size > 1000  # kept anew
    prompt = random_tokens(1, PROMPT)
    assert torch.equal(generate(model, prompt, BLOCK_SIZE, sampling=GREEDY, cache=cache, step=step),
                       generate(model, prompt, BLOCK_SIZE, sampling=GREEDY))
