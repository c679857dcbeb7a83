"""Numbers at float32's edge: a top_p, temperature or count that float32 (or a float) rounds to 0 or to inf is
either drawn with exactly or refused with its range."""

import pytest
import torch

from model import Sampling
from model.checks import FLOAT32_TINY

LOGITS = torch.tensor([[0.3, 2.5, -1.0, 2.4, 0.0], [1.0, -2.0, 0.5, 3.0, 2.9]])


@pytest.mark.parametrize("top_p", [5e-324, 1e-46, 1e-40])
def test_a_top_p_that_float32_rounds_to_0_or_below_normal_keeps_the_likeliest_token_alone(top_p):
    probs = Sampling(temperature=1.0, top_p=top_p).probs(LOGITS)
    assert torch.equal(probs, torch.nn.functional.one_hot(LOGITS.argmax(-1), LOGITS.size(-1)).float())
    ids = Sampling(temperature=1.0, top_p=top_p).next_token(LOGITS.repeat(50, 1), torch.Generator().manual_seed(0))
    assert torch.equal(ids, LOGITS.argmax(-1).repeat(50))


def test_top_p_1_keeps_every_token_though_float32_sums_the_likeliest_to_1():
    """The tail's probabilities, near 1e-9 and 1e-13, are below half of float32's epsilon next to the first's."""
    logits = torch.tensor([[0.0, -21.0, -20.0, -19.5, -30.0, -30.0]])
    kept = Sampling(temperature=1.0, top_p=1.0).probs(logits)
    assert torch.equal(kept, Sampling(temperature=1.0).probs(logits)) and bool((kept > 0).all())


def test_logits_over_a_tiny_temperature_do_not_overflow_to_nan():
    """At 1e-6, logits of 1e33 are 1e39 apart from 0 before the best is taken off: past float32's 3.4e38."""
    logits = torch.tensor([[1e33, 0.0, -1e33, 1e33 - 1e27]])
    assert Sampling(temperature=1e-6).probs(logits).tolist() == [[1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("temperature", [FLOAT32_TINY, 1e-30])
def test_a_temperature_near_float32s_smallest_draws_the_likeliest_and_splits_ties_evenly(temperature):
    """Logits 1e-6 apart over a temperature of 1e-30 are 1e24 apart: exp of minus that is 0 in float32."""
    logits = torch.tensor([[1.0, 1.0 - 1e-6, 0.5, 1.0]])
    assert Sampling(temperature=temperature).probs(logits).tolist() == [[0.5, 0.0, 0.0, 0.5]]


@pytest.mark.parametrize("temperature", [1e-39, 5e-324])
def test_a_temperature_below_float32s_normal_numbers_is_refused_with_the_range(temperature):
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or a finite number >= 1.18e-38 "
                                         r"\(float32's smallest normal number\), got "):
        Sampling(temperature=temperature)


def test_a_huge_temperature_draws_every_token_alike():
    """Any finite temperature past float32's 3.4e38 is inf there: each logit, less the best, over it is 0."""
    probs = Sampling(temperature=1e300).probs(torch.tensor([[1e30, 0.0, -1e30]]))
    assert torch.equal(probs, torch.full((1, 3), 1 / 3))


@pytest.mark.parametrize("written, fragment", [
    ("1e-400", "1e-400 rounds to 0 in a float, whose smallest is about 5e-324: give a value it holds"),
    ("-1e-330", "-1e-330 rounds to 0 in a float, whose smallest is about 5e-324: give a value it holds"),
    ("1e400", "1e400 is beyond a float's range (about 1.8e308)"),
    ("0.5x", "must be a number, got '0.5x'"),
])
@pytest.mark.parametrize("option", ["--temperature", "--top-p"])
def test_a_number_a_float_cannot_hold_is_refused_as_written_not_taken_as_0_or_infinity(option, written, fragment,
                                                                                       capsys):
    """1e-400 would otherwise parse to 0.0: a temperature of 0 decodes greedily, which the value written never
    asked for."""
    from sampling.options import build_parser

    with pytest.raises(SystemExit) as ended:
        build_parser().parse_args([f"{option}={written}"])
    assert ended.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: argument {option}: {fragment}\n")


@pytest.mark.parametrize("written, value", [("0", 0.0), ("5e-324", 5e-324), ("1e308", 1e308), (" 0.8 ", 0.8),
                                            ("inf", float("inf"))])
def test_a_number_a_float_holds_is_taken_as_written(written, value):
    from runtime.errors import float_as_written

    assert float_as_written(written) == value
