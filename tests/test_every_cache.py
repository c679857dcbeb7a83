"""Every KV cache by name (model/caches/factory.py, sample.py's --kv-cache) with every design of test_kv_designs.py,
both kinds of positions: each is refused in one line, or decodes 3 x block_size tokens. Where it holds the whole
context (a budget of block_size, every token also in full precision), each step's logits equal the float cache's
(budgets with learned positions while the text fits: past it they place tokens their own way); the int8 cache's
stay within its rounding."""

import pytest
import torch

from model.caches.factory import BUDGETED, CACHES, LOWBIT, new_cache
from test_kv_designs import DESIGNS, SHAPE, design_model
from test_sink_cache import cached_logits
from tiny_models import BLOCK_SIZE, random_model, random_tokens
from tolerance import assert_forward_close

PROMPT = 5
EXACT_PAST_BLOCK = ("int4", "int2", "h2o", "tova", "merge")  # with the whole context: the float cache, throughout


def whole_context(name: str) -> dict:
    """The settings under which cache `name` holds every token the float cache holds."""
    return dict(budget=BLOCK_SIZE) if name in BUDGETED else dict(residual=BLOCK_SIZE) if name in LOWBIT else {}


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("design", ["plain", *DESIGNS])
@torch.no_grad()
def test_every_cache_is_refused_in_one_line_or_decodes_as_the_float_cache(design, pos_emb):
    model = random_model(**SHAPE, pos_emb=pos_emb) if design == "plain" else design_model(design, pos_emb)
    seq = random_tokens(2, PROMPT + 3 * BLOCK_SIZE, seed=7)
    reference = cached_logits(model, seq, PROMPT, new_cache(model, "float", 2))  # (B, steps, vocab)
    fits = BLOCK_SIZE - PROMPT  # the steps before the text passes block_size
    decoded = []
    for name in list(CACHES)[1:]:
        try:
            cache = new_cache(model, name, 2, **whole_context(name))
        except ValueError as e:
            assert str(e) and "\n" not in str(e), (name, str(e))
            continue
        logits = cached_logits(model, seq, PROMPT, cache)
        assert logits.shape == reference.shape, name
        if name == "int8":  # its rounding moves logits of spread about 1 by a few thousandths; a wrong key, by ~1
            error = (logits - reference).abs()
            assert error.mean() < 0.01 and error.max() < 0.25, (name, error.mean(), error.max())
            continue
        steps = reference.size(1) if name in EXACT_PAST_BLOCK or (name == "window" and pos_emb == "rope") else fits
        assert_forward_close(logits[:, :steps], reference[:, :steps], model, name)
        decoded.append(name)
    plain_attention = not {"window_pattern", "kv_latent"} & set(DESIGNS.get(design, {}))
    assert ("window" in decoded) == ("sinks" in decoded) == plain_attention  # the budgets serve whole keys
