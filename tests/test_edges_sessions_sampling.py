"""Edges of sampling: a model converted for decoding is never converted again, --each-line on a vocabulary
without a newline, and Ctrl-C keeping what was generated in every mode."""

import io
import os
import signal
import subprocess
import sys

import pytest
import torch

from data import CharVocab
from model import GREEDY, GPTConfig, build_model, generate
from model.decoding.quantize import to_precision
from model.serving.engine import Engine
from runtime.checkpoint import build_checkpoint, load_model, save_checkpoint
from sampling.output import SAMPLE_SEPARATOR, continue_lines, write_samples
from programs import child_signal
from test_sample import ENV, SAMPLE, assert_usage_error
from test_sample_sessions_and_lines import chat, models  # noqa: F401  models: a fixture
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


def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("num_samples", [1, 4])
def test_ctrl_c_writes_what_sampling_generated_even_if_pressed_again_as_it_is_written(num_samples):
    """In-process, so that Ctrl-C comes at a known step: sampling stops between two steps, and a second Ctrl-C as
    the samples are written does not lose them (side by side, they are all written at the end)."""
    vocab = CharVocab("abcdefgh")

    def steps():
        for i in range(10**6):
            if i == 5:
                ctrl_c()
            yield torch.full((num_samples,), i % len(vocab))

    class Terminal(io.StringIO):
        def write(self, text):
            ctrl_c()  # pressed again
            return super().write(text)

    out = Terminal()
    with pytest.raises(KeyboardInterrupt):
        write_samples(steps(), "x", vocab, num_samples, out, every=64)
    samples = out.getvalue().split(SAMPLE_SEPARATOR)
    assert len(samples) == num_samples and all(sample == "xabcdef\n" for sample in samples)


def test_ctrl_c_writes_each_line_begun_as_far_as_it_got_in_the_files_order(models, monkeypatch):
    model, vocab, _ = load_model(models["model"])
    lines = ["First Citizen:", "All:"]
    run = Engine.run

    def interrupted_run(self):
        for i, step in enumerate(run(self)):
            if i == 3:
                ctrl_c()
            yield step

    monkeypatch.setattr(Engine, "run", interrupted_run)
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        continue_lines(model, vocab, "\n".join(lines), 10, GREEDY, torch.Generator(), out)
    written = out.getvalue().split(SAMPLE_SEPARATOR)
    assert len(written) == 2
    for line, text in zip(lines, written):
        ids = vocab.encode(line + "\n")[-(model.config.block_size - 10):]  # what continue_lines reads
        alone = vocab.decode(generate(model, torch.tensor([ids]), 10, sampling=GREEDY)[0, len(ids):].tolist())
        continuation = text.removeprefix(line + "\n").removesuffix("\n")
        assert text.startswith(line + "\n") and 0 < len(continuation) < 10 and alone.startswith(continuation)


def run_sample_with(checkpoint, script: str, *args, typed: str = "") -> subprocess.CompletedProcess:
    """sample.py run as __main__ after script, which patches it."""
    argv = ["sample.py", "--checkpoint", str(checkpoint), *map(str, args)]
    code = f"import runpy, sys\n{script}\nsys.argv = {argv!r}\nrunpy.run_path({str(SAMPLE)!r}, run_name='__main__')\n"
    return subprocess.run([sys.executable, "-c", code], input=typed, env=ENV, capture_output=True, text=True,
                          timeout=300, preexec_fn=child_signal(signal.SIGINT))  # Ctrl-C as at a terminal


def test_ctrl_c_between_two_replies_saves_the_session_so_far(models, tmp_path):
    """Ctrl-C as the second line is read (outside a reply, which it would only end): exit 130, the first turn saved."""
    session = tmp_path / "chat.pt"
    script = ("import os, signal, sampling.output as output\n"
              "encode, calls = output.encode_prompt, []\n"
              "def encode_prompt(*args):\n"
              "    calls.append(1)\n"
              "    if len(calls) == 2:\n"
              "        os.kill(os.getpid(), signal.SIGINT)\n"
              "    return encode(*args)\n"
              "output.encode_prompt = encode_prompt\n")
    result = run_sample_with(models["model"], script, "--interactive", "--temperature", 0, "--max-new-tokens", 20,
                             "--session", session, typed="First Citizen:\nAll:\n")
    assert result.returncode == 130 and result.stderr.splitlines()[-1] == "sample.py: error: interrupted", \
        result.stderr
    assert "saved the session" in result.stderr
    saved = torch.load(session, weights_only=True)["tokens"].tolist()
    _, vocab, _ = load_model(models["model"])
    assert vocab.decode(saved).startswith("\nFirst Citizen:\n") and len(saved) > 16  # the prompt, line and reply


def test_ctrl_c_as_the_process_exits_is_no_traceback(models, tmp_path):
    """A Ctrl-C that lands once the session is saved, as the interpreter runs its exit callbacks: nothing is left
    to stop, so nothing is said. The callback registered first runs last, after every other."""
    script = "import atexit, os, signal\natexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\n"
    result = run_sample_with(models["model"], script, "--interactive", "--temperature", 0, "--max-new-tokens", 5,
                             "--session", tmp_path / "chat.pt", typed="All:\n")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1].startswith("saved the session")
