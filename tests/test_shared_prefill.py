"""Many samples of one prompt: the prompt goes through the model once, at batch 1, and its cache is copied to every
row, with the same samples as separate prefills for the same seed."""

import importlib

import pytest
import torch

from model import Sampling, generate
from model.gpt import POSITIONS
from tiny_models import BLOCK_SIZE, random_model, random_tokens
from model.caches.factory import new_kv_cache

N_SAMPLES = 4
generate_module = importlib.import_module("model.decoding.generate")  # `model.decoding.generate` is also the function's name


def sample_rows(model, prompt, n_new, cache_dtype=None):
    cache = new_kv_cache(model, prompt.size(0), dtype=cache_dtype)
    return generate(model, prompt, n_new, sampling=Sampling(temperature=1.0), cache=cache,
                    generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("pos_emb", POSITIONS)
@pytest.mark.parametrize("cache_dtype", [None, torch.int8], ids=["float", "int8"])
def test_one_prefill_at_batch_1_gives_the_samples_of_separate_prefills(pos_emb, cache_dtype, monkeypatch):
    model = random_model(seed=0, pos_emb=pos_emb)
    prompt = random_tokens(1, 7).expand(N_SAMPLES, -1)
    shapes = []
    hook = model.blocks[0].register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape[:2])))
    shared = sample_rows(model, prompt, 2 * BLOCK_SIZE, cache_dtype)  # past block_size too
    hook.remove()
    # the prompt once at batch 1, then one token per row per step (and, for learned positions, refills of all rows)
    assert shapes[0] == (1, 7) and shapes[1] == (N_SAMPLES, 1) and {rows for rows, _ in shapes[1:]} == {N_SAMPLES}
    assert len({tuple(row) for row in shared[:, 7:].tolist()}) > 1  # the rows are separate samples

    monkeypatch.setattr(generate_module, "_same_rows", lambda idx: False)  # each row prefilled on its own
    separate = sample_rows(model, prompt, 2 * BLOCK_SIZE, cache_dtype)
    assert torch.equal(shared, separate)


def test_rows_that_differ_or_a_prompt_longer_than_the_block_are_prefilled_together():
    model = random_model(seed=0, pos_emb="rope")
    shapes = []
    model.blocks[0].register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape[:2])))
    different = random_tokens(2, 5)
    sample_rows(model, different, 3)
    assert shapes[0] == (2, 5)
    shapes.clear()
    long = random_tokens(1, BLOCK_SIZE + 4).expand(2, -1)
    sample_rows(model, long, 3)
    assert shapes[0] == (2, BLOCK_SIZE)  # the ring's first chunk, then a token at a time
