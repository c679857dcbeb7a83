"""Edges of sampling: a model converted for decoding is never converted again, --each-line on a vocabulary
without a newline, and Ctrl-C keeping what was generated in every mode."""

import pytest
import torch

from model.decoding.quantize import to_precision
from tiny_models import random_model, random_tokens


@pytest.mark.parametrize("first, second", [("int8", "int8"), ("int8", "bf16"), ("int8", "fp32"), ("bf16", "int8"),
                                           ("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "int8")])
def test_a_converted_model_is_refused_by_to_precision_and_left_as_it_was(first, second):
    """Converting twice would quantize rounded weights again (int8 twice moved logits by hundreds), and fp32
    would hand back a bf16 or int8 model as if it were fp32. A model halved by hand is no fp32 model either."""
    model = random_model().half() if first == "fp16" else to_precision(random_model(), first)
    idx = random_tokens(1, 8)
    before = model(idx)[0]
    with pytest.raises(ValueError, match=r"^model holds .* weights, converted for decoding already; to_precision "
                                         r"takes a model with fp32 weights"):
        to_precision(model, second)
    assert torch.equal(model(idx)[0], before)


def test_an_fp32_model_converts_to_fp32_any_number_of_times():
    model = random_model()
    assert to_precision(to_precision(model, "fp32"), "fp32") is model
