"""Edges of sampling: a model converted for decoding is never converted again, --each-line on a vocabulary
without a newline, and Ctrl-C keeping what was generated in every mode."""

import subprocess
import sys

import pytest
import torch

from data import CharVocab
from model import GREEDY, GPTConfig, build_model, generate
from model.decoding.quantize import to_precision
from runtime.checkpoint import build_checkpoint, save_checkpoint
from test_sample import ENV, SAMPLE, assert_usage_error
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


@pytest.fixture(scope="module")
def no_newline(tmp_path_factory):
    """A model of a text with no newline in it."""
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=6, block_size=16, n_layer=1, n_head=2, n_embd=16)).eval()
    vocab = CharVocab("abcde ")
    return save_checkpoint(build_checkpoint(model, vocab), tmp_path_factory.mktemp("nonl") / "best.pt"), model, vocab


def test_each_line_of_a_text_with_no_newline_is_continued_on_its_line(no_newline, tmp_path):
    """The newline each line is given is no character of the user's: where the vocabulary lacks it, the line is
    continued as it is, as --interactive continues a line."""
    checkpoint, model, vocab = no_newline
    (tmp_path / "lines.txt").write_text("abc ed")
    result = subprocess.run([sys.executable, str(SAMPLE), "--checkpoint", str(checkpoint), "--prompt-file",
                             str(tmp_path / "lines.txt"), "--each-line", "--temperature", "0", "--max-new-tokens",
                             "5"], env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    expected = generate(model, torch.tensor([vocab.encode("abc ed")]), 5, sampling=GREEDY)[0, 6:].tolist()
    assert result.stdout == "abc ed" + vocab.decode(expected) + "\n"


def test_the_default_prompt_that_the_vocabulary_lacks_asks_for_a_prompt(no_newline):
    """The default prompt, a newline, is no character the user gave: the line says so and what to give."""
    result = subprocess.run([sys.executable, str(SAMPLE), "--checkpoint", str(no_newline[0])], env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert_usage_error(result, "the default prompt (give --prompt) has characters not in the checkpoint's "
                               "vocabulary: '\\n'")
    assert result.stdout == ""
