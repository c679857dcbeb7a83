"""sample.py's speculative decoding (--draft, --speculate-k) and --interactive, end to end in a subprocess."""

import io
import os
import signal
import subprocess
import sys

import pytest
import torch

from data import CharVocab, prepare_text
from model import GPTConfig, GREEDY, build_model, generate
from model.serving.conversation import Conversation
from runtime.checkpoint import build_checkpoint, load_model, save_checkpoint
from sampling.output import interact
from test_sample import (BLOCK_SIZE, ENV, NEW_TOKENS, PROMPT, SAMPLE, TEXT, VOCAB, assert_usage_error, run_sample,
                         sample_ok, tiny_model)

REPLY = 40


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The model, the model recording the text it was trained on (prepared under folder/datasets), a draft trained
    less from another seed, and a model of another vocabulary."""
    folder = tmp_path_factory.mktemp("spec")
    paths = {"folder": folder}
    for name, model in (("model", tiny_model(seed=0, train_steps=120)), ("draft", tiny_model(seed=1, train_steps=40))):
        paths[name] = save_checkpoint(build_checkpoint(model, VOCAB), folder / f"{name}.pt")
    (folder / "text.txt").write_text(TEXT)
    text = prepare_text(folder / "text.txt", folder / "datasets")
    paths["model_with_text"] = save_checkpoint(build_checkpoint(load_model(paths["model"])[0], VOCAB, text=text),
                                               folder / "model_with_text.pt")
    torch.manual_seed(0)
    other = build_model(GPTConfig(vocab_size=5, block_size=16, n_layer=1, n_head=1, n_embd=8)).eval()
    paths["other"] = save_checkpoint(build_checkpoint(other, CharVocab("abcde")), folder / "other.pt")
    return paths


@pytest.fixture(scope="module")
def plain_greedy(checkpoints) -> str:
    return sample_ok("--checkpoint", checkpoints["model"], "--prompt", PROMPT, "--temperature", 0,
                     "--max-new-tokens", NEW_TOKENS).stdout


@pytest.mark.parametrize("draft, k", [("lookup", "3"), ("draft", "4")])
def test_speculative_greedy_text_equals_plain_greedy_text(checkpoints, plain_greedy, draft, k):
    result = sample_ok("--checkpoint", checkpoints["model"], "--prompt", PROMPT, "--temperature", 0,
                       "--max-new-tokens", NEW_TOKENS, "--draft", checkpoints.get(draft, draft), "--speculate-k", k)
    assert result.stdout == plain_greedy
    summary = result.stderr.splitlines()[-1]
    assert "draft acceptance " in summary and " tokens per model pass" in summary


def test_the_ngram_draft_counts_the_training_text_and_keeps_the_greedy_text(checkpoints, plain_greedy):
    result = sample_ok("--checkpoint", checkpoints["model_with_text"], "--prompt", PROMPT, "--temperature", 0,
                       "--max-new-tokens", NEW_TOKENS, "--draft", "ngram", cwd=checkpoints["folder"])
    assert result.stdout == plain_greedy
    acceptance = int(result.stderr.splitlines()[-1].split("draft acceptance ")[1].split("%")[0])
    assert acceptance > 100 / len(VOCAB)  # better than a uniform guess


@pytest.mark.slow
def test_compile_verifies_full_drafts_through_a_compiled_pass(checkpoints, plain_greedy, tmp_path):
    result = subprocess.run([sys.executable, str(SAMPLE), "--checkpoint", str(checkpoints["model"]), "--prompt", PROMPT,
                             "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS), "--draft", "lookup",
                             "--speculate-k", "3", "--compile"], env={**ENV, "KVGPT_CACHE_DIR": str(tmp_path)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == plain_greedy
    compiling = (f"compiling the verification pass of up to 4 tokens, with a pass of up to {BLOCK_SIZE} tokens for "
                 "prompts, for these weights, once")
    assert result.stderr.splitlines()[1].startswith(compiling)
    assert ", compiled step), draft acceptance " in result.stderr.splitlines()[-1]


def test_the_ngram_draft_refuses_a_text_that_changed_since_training(checkpoints, tmp_path):
    folder = tmp_path / "moved"
    folder.mkdir()
    (folder / "text.txt").write_text(TEXT + "more")
    contents = load_model(checkpoints["model_with_text"])[2]
    contents["text"]["source"] = str(folder / "text.txt")
    changed = save_checkpoint(contents, folder / "changed.pt")
    assert_usage_error(run_sample("--checkpoint", changed, "--draft", "ngram", cwd=folder),
                       "--draft ngram counts the text the checkpoint was trained on", "has changed since")


@pytest.mark.parametrize("args, fragments", [
    (["--draft", "ngram"], ["--draft ngram counts the text the checkpoint was trained on: the checkpoint does not "
                            "record the text it was trained on; use --draft lookup"]),
    (["--draft", "OTHER"], ["--draft", "another vocabulary (5 characters)", "(35)"]),
    (["--draft", "lookup", "--speculate-k", "0"], ["--speculate-k must be >= 1, got 0"]),
    (["--speculate-k", "2"], ["--speculate-k applies to speculative decoding: give --draft too"]),
    (["--draft", "lookup", "--num-samples", "2"], ["--num-samples applies to plain decoding, not to --draft"]),
    (["--draft", "lookup", "--no-kv-cache"], ["--no-kv-cache applies to plain decoding, not to --draft"]),
    (["--interactive", "--num-samples", "3"], ["--num-samples applies to plain decoding, not to --interactive"]),
    (["--interactive", "--draft", "lookup"], ["--draft applies to sampling, not to --interactive"]),
    (["--interactive", "--kv-cache", "int8"], ["--kv-cache applies to plain decoding, not to --interactive"]),
    (["--draft", "MISSING"], ["--draft: no checkpoint at"]),
    (["--draft", "lookup", "--speculate-k", "10000000"], ["--speculate-k must be at most", "block_size", "10000000"]),
    (["--draft", "lookup", "--speculate-k", str(10**14)], ["--speculate-k must be at most", str(10**14)]),
    (["--draft", "MODEL", "--speculate-k", "100000"], ["--speculate-k must be at most", "100000"]),
    (["--interactive", "--max-new-tokens", "-1"], ["--max-new-tokens", "must be an integer >= 0, got -1"]),
    (["--interactive", "--max-new-tokens", "-20"], ["--max-new-tokens", "got -20"]),
])
def test_options_that_cannot_work_are_one_line_with_status_2(checkpoints, tmp_path, args, fragments):
    args = [{"OTHER": checkpoints["other"], "MODEL": checkpoints["model"], "MISSING": tmp_path / "none.pt"}.get(a, a)
            for a in args]
    assert_usage_error(run_sample("--checkpoint", checkpoints["model"], *args), *fragments)


def expected_conversation(checkpoint, prompt: str, lines: list[str]) -> str:
    """prompt, then for each line a fresh greedy generation over the whole text so far, cut after a blank line."""
    model, vocab, _ = load_model(checkpoint, torch.device("cpu"))
    text = prompt
    shown = prompt
    for line in lines:
        text += line + "\n"
        ids = torch.tensor([vocab.encode(text)])
        reply = vocab.decode(generate(model, ids, REPLY, sampling=GREEDY)[0, ids.size(1):].tolist())
        reply = reply[:reply.index("\n\n") + 2] if "\n\n" in reply else reply
        text += reply
        shown += reply
    return shown + ("" if shown.endswith("\n") else "\n")


@pytest.mark.parametrize("compile", [[], pytest.param(["--compile"], marks=pytest.mark.slow)],
                         ids=["eager", "compiled step"])
def test_interactive_replies_are_fresh_greedy_generations_and_unknown_characters_are_skipped(checkpoints, compile,
                                                                                           tmp_path):
    lines = ["First Citizen:", "Speak, speak.", "All:", "You are all resolved rather to die than to famish?"]
    typed = "\n".join(lines[:2] + ["Speak \u00e9"] + lines[2:]) + "\n"
    result = subprocess.run([sys.executable, str(SAMPLE), "--checkpoint", str(checkpoints["model"]), "--interactive",
                             "--temperature", "0", "--max-new-tokens", str(REPLY), "--prompt", "All:\n", *compile],
                            input=typed, env={**ENV, "KVGPT_CACHE_DIR": str(tmp_path)}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected_conversation(checkpoints["model"], "All:\n", lines)
    assert "the line has characters not in the checkpoint's vocabulary: '\u00e9'" in result.stderr
    compiling = f"compiling the decoding step, with a pass of up to {BLOCK_SIZE} tokens for prompts, for these weights"
    assert (compiling in result.stderr) == bool(compile)


def test_interactive_with_standard_input_closed_is_one_line_with_status_2(checkpoints):
    result = subprocess.run(f"{sys.executable} {SAMPLE} --checkpoint {checkpoints['model']} --interactive <&-",
                            shell=True, env=ENV, capture_output=True, text=True, timeout=300)
    assert_usage_error(result, "--interactive reads lines from standard input, which is closed")


@pytest.mark.parametrize("typed, decoding", [(b"\xff\xfe not text\n", "surrogateescape"), (b"caf\xe9\n", "strict"),
                                             (b"\x80\n", "strict")], ids=["ff fe, escaped", "latin-1, strict", "lone 80, strict"])
def test_interactive_skips_a_line_that_is_not_utf8_and_goes_on(checkpoints, typed, decoding):
    """Bytes that are no UTF-8 are one line on stderr, like a line of unknown characters; the next line is read,
    whether standard input escapes them (a pipe, in the C locale) or raises on them."""
    typed += b"All:\n"
    result = subprocess.run([sys.executable, str(SAMPLE), "--checkpoint", str(checkpoints["model"]), "--interactive",
                             "--temperature", "0", "--max-new-tokens", str(REPLY), "--prompt", "All:\n"],
                            input=typed, env={**ENV, "PYTHONIOENCODING": f"utf-8:{decoding}"}, capture_output=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert b"the line is not UTF-8 text; type another" in result.stderr and b"Traceback" not in result.stderr
    assert result.stdout.decode() == expected_conversation(checkpoints["model"], "All:\n", ["All:"])


def test_ctrl_c_ends_a_reply_between_two_tokens_and_the_session_goes_on(checkpoints, monkeypatch):
    """In-process, so that Ctrl-C comes at a known token. The vocabulary has no newline, so no stop string: a reply
    runs to its limit unless Ctrl-C ends it."""
    model, vocab, _ = load_model(checkpoints["other"], torch.device("cpu"))
    conversation = Conversation(model, sampling=GREEDY)
    typed = iter(["abc", KeyboardInterrupt, "de"])  # Ctrl-C while typing is a line dropped

    def fake_input():
        line = next(typed, EOFError)  # then Ctrl-D
        if isinstance(line, type):
            raise line
        return line

    class Terminal(io.StringIO):
        def write(self, text):
            super().write(text)
            if len(self.getvalue()) == 10:  # Ctrl-C in the first reply's 9th token
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr("builtins.input", fake_input)
    out = Terminal()
    list(conversation.reply(vocab.encode("a"), 0))  # the prompt, as sample.py starts a conversation
    interact(conversation, vocab, 30, out)
    first = generate(model, torch.tensor([vocab.encode("aabc")]), 9, sampling=GREEDY)[0, 4:].tolist()
    text = "aabc" + vocab.decode(first) + "de"
    second = generate(model, torch.tensor([vocab.encode(text)]), 30, sampling=GREEDY)[0, len(text):].tolist()
    assert out.getvalue() == "a" + vocab.decode(first) + vocab.decode(second) + "\n"
    assert conversation.tokens == vocab.encode(text) + second
