"""What the engine keeps of a request for its caller (model/serving/request.py: Kept): the raw logits of each draw
and of every prompt position, equal to a plain forward's, and how many prompt tokens it read from the cache."""

import pytest
import torch

from model import Sampling
from model.serving.engine import Engine
from model.serving.request import Kept
from tiny_models import random_model
from tolerance import assert_forward_close

BLOCK = 40  # the model's block_size
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]  # three full blocks of 4, then one token


def assert_kept_like_a_plain_forward(model, kept: Kept, tokens: list[int], prompt_len: int) -> None:
    """Every prompt row and every draw's logits against the model's own forward over the whole text."""
    plain = model(torch.tensor([tokens]))[0][0]  # (len(tokens), vocab_size): position i predicts token i + 1
    assert_forward_close(torch.cat(kept.prompt_logits), plain[:prompt_len - 1], model, "prompt rows")
    drawn = torch.stack(kept.logits)
    assert_forward_close(drawn, plain[prompt_len - 1:prompt_len - 1 + len(drawn)], model, "draws")


@torch.no_grad()
def test_a_scored_prompt_is_computed_whole_though_cached_and_its_raw_logits_are_kept():
    model = random_model(block_size=BLOCK)
    engine = Engine(model, n_blocks=40, block_tokens=4, chunk=5, sampling=Sampling(temperature=0.5),
                    generator=torch.Generator().manual_seed(0))
    engine.add("first", PROMPT, 4)
    list(engine.run())
    reused = engine.stats.reused_tokens
    kept = Kept(draws=True, prompt=True)
    scored = engine.add("scored", PROMPT, 6, kept=kept)
    list(engine.run())
    assert kept.cached_tokens == 0 and engine.stats.reused_tokens == reused  # computed, not read
    assert len(torch.cat(kept.prompt_logits)) == len(PROMPT) - 1 and len(kept.logits) == 6
    assert_kept_like_a_plain_forward(model, kept, scored.tokens, len(PROMPT))
    plain = Kept()
    engine.add("plain", PROMPT, 2, kept=plain)
    list(engine.run())
    assert plain.cached_tokens == (len(PROMPT) - 1) // 4 * 4 == engine.stats.reused_tokens - reused
    assert plain.logits == [] and plain.prompt_logits == []  # nothing asked, nothing kept


@torch.no_grad()
def test_a_request_of_no_new_tokens_computes_its_prompt_and_leaves():
    model = random_model(block_size=BLOCK)
    engine = Engine(model, n_blocks=8, block_tokens=4, chunk=3)
    kept = Kept(draws=True, prompt=True)
    engine.add("scored", PROMPT, 0, kept=kept)
    assert list(engine.run()) == [("scored", None)]
    assert engine.pool.refs == [0] * 8 and not engine.running
    rows, logits = kept.take()
    assert logits == [] and (kept.prompt_logits, kept.logits) == ([], [])
    assert_forward_close(rows, model(torch.tensor([PROMPT]))[0][0, :-1], model)


@pytest.mark.parametrize("prompt", [True, False], ids=["scored", "plain"])
@torch.no_grad()
def test_a_preempted_request_keeps_its_prompt_rows_once_every_draw_and_its_first_cached_count(prompt):
    """Two requests outgrow a pool of 7 blocks: the later one is preempted and prefilled again with its draws,
    reading its own blocks where it may. Its prompt read none of the cache when it first joined."""
    model = random_model(block_size=BLOCK)
    engine = Engine(model, n_blocks=7, block_tokens=4, chunk=4)
    engine.add("first", [7, 7, 1, 2, 3], 10)
    kept = Kept(draws=True, prompt=prompt)
    later = engine.add("later", PROMPT[:6], 14, kept=kept)
    list(engine.run())
    assert later.preemptions > 0
    assert kept.cached_tokens == 0 and later.cached == (0 if prompt else 12)  # 12: its own blocks, on rejoining
    assert len(kept.logits) == 14
    if prompt:
        assert len(torch.cat(kept.prompt_logits)) == 5
        assert_kept_like_a_plain_forward(model, kept, later.tokens, 6)


def shown_cached(engine: Engine, name) -> int:
    """The cached tokens that the engine's census shows for a running request."""
    (count,) = [r.cached_tokens for r in engine.census().requests if r.name == name]
    return count


@torch.no_grad()
def test_a_request_is_fed_before_a_decoding_pass_can_preempt_it_and_counts_the_cache_it_read_then():
    """A prompt cached but for its last token joins while two running ones each need a block. It is fed first, in
    a pass that reads its cached prefix; only then does a decoding pass, short of blocks, preempt it. Its count is
    what it read when it first ran, as the census showed it."""
    model = random_model(block_size=BLOCK)
    engine = Engine(model, n_blocks=5, block_tokens=4)
    engine.add("seed", PROMPT[:9], 1)
    list(engine.run())  # its two full blocks stay cached
    for name in ("a", "b"):
        engine.add(name, [name == "a", 7, 7, 7], 8)
    engine.step()  # both prefill: each needs a second block for its next token
    kept = Kept()
    late = engine.add("late", PROMPT[:9], 2, kept=kept)
    reused = engine.stats.reused_tokens
    engine.step()
    assert late.drawn == 1 and kept.cached_tokens == shown_cached(engine, "late") == 8
    assert engine.stats.reused_tokens == reused + 8
    engine.step()
    assert late.preemptions == 1 and late in engine.waiting
    list(engine.run())
    assert kept.cached_tokens == 8 and late.drawn == 2


@torch.no_grad()
def test_a_request_joining_beside_a_prefilling_one_is_fed_in_the_same_pass():
    """Its prompt is cached but for its last token, the other's not at all. Were it left for a decoding pass, it
    would hold its cached blocks unread, shown running, and could be preempted before it read them."""
    model = random_model(block_size=BLOCK)
    engine = Engine(model, n_blocks=10, block_tokens=4)
    engine.add("seed", PROMPT[:9], 1)
    list(engine.run())
    fresh = engine.add("fresh", [7] * 6, 2)
    kept = Kept()
    late = engine.add("late", PROMPT[:9], 2, kept=kept)
    engine.step()
    assert fresh.drawn == late.drawn == 1
    assert kept.cached_tokens == shown_cached(engine, "late") == 8
