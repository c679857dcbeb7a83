"""sample.py's many-request and saved-cache features, end to end: a conversation saved with its KV cache and taken
up again (sampling/session.py, --session) goes on exactly as the uninterrupted one, reading only the new line, and
another model's file or a damaged one is refused; --each-line continues every line of a file over one pool of
blocks (model/serving/engine.py), each as it would be alone."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import GREEDY, GPTConfig, generate
from model.serving.conversation import Conversation
from runtime.checkpoint import load_model, save_checkpoint
from sampling.session import SessionError, load_session, save_session
from test_sample import ENV, SAMPLE, SEPARATOR, VOCAB, assert_usage_error, checkpoint_state, tiny_model
from tiny_models import random_model, random_tokens
from tolerance import assert_forward_close


class CountingTokens:
    """Counts the tokens a model's passes read (forward and decode_step both run its trunk)."""

    def __init__(self, model):
        self.read, self.trunk = 0, model._trunk
        model._trunk = self

    def __call__(self, idx, *args, **kwargs):
        self.read += idx.size(1)
        return self.trunk(idx, *args, **kwargs)


def taken_up_after_two_turns(model, tmp_path):
    """Three turns, each replied to with 9 tokens (48 tokens: past block_size), in one conversation; and the first
    two saved after their turns and taken up again from the file. (turns, replies, the first, the one taken up)"""
    turns = [random_tokens(7, seed=s).tolist() for s in range(3)]
    whole = Conversation(model)
    replies = [list(whole.reply(turn, 9)) for turn in turns]
    first = Conversation(model)
    for turn in turns[:2]:
        list(first.reply(turn, 9))
    save_session(tmp_path / "chat.pt", first.state(), "model.pt", model)
    return turns, replies, first, Conversation(model, sampling=GREEDY).restore(
        load_session(tmp_path / "chat.pt", "model.pt", model))


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_a_conversation_taken_up_from_a_saved_file_goes_on_exactly_and_reads_only_the_new_tokens(tmp_path,
                                                                                                   pos_emb):
    model = random_model(pos_emb=pos_emb)
    turns, replies, first, later = taken_up_after_two_turns(model, tmp_path)
    assert later.tokens == first.tokens
    counter = CountingTokens(model)
    assert list(later.reply(turns[2], 9)) == replies[2]
    assert counter.read == 1 + len(turns[2]) + 8  # the last reply's last token, the new line, then one per step


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("session")
    return {name: save_checkpoint(checkpoint_state(tiny_model(seed=seed, train_steps=60)), folder / f"{name}.pt")
            for name, seed in (("model", 0), ("other", 1))}


def chat(checkpoint, typed: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SAMPLE), "--checkpoint", str(checkpoint), "--interactive",
                           "--temperature", "0", "--max-new-tokens", "20", *map(str, args)],
                          input=typed, env=ENV, capture_output=True, text=True, timeout=300)


def test_a_session_taken_up_ends_where_one_uninterrupted_session_ends(models, tmp_path):
    lines = ["First Citizen:\n", "Speak, speak.\n", "All:\n"]
    whole, parts = tmp_path / "whole.pt", tmp_path / "parts.pt"
    assert chat(models["model"], "".join(lines), "--session", whole).returncode == 0
    first = chat(models["model"], lines[0], "--session", parts)
    assert first.returncode == 0 and "saved the session" in first.stderr
    second = chat(models["model"], "".join(lines[1:]), "--session", parts)
    assert second.returncode == 0, second.stderr
    assert "the next line is all the model reads" in second.stderr
    shown = "\n" + lines[0] + first.stdout[1:].rstrip("\n")  # the prompt, the typed line, the reply
    assert second.stdout.startswith(shown)  # the text so far is shown again
    saved = [torch.load(path, weights_only=True) for path in (whole, parts)]
    assert torch.equal(saved[0]["tokens"], saved[1]["tokens"])
    config = GPTConfig(**torch.load(models["model"], weights_only=True)["model_config"])
    for name, tensor in saved[0]["cache"].items():  # keys and values prefilled in other chunks: forward_atol apart
        if tensor.is_floating_point():
            assert_forward_close(saved[1]["cache"][name], tensor, config, name)
        else:
            assert torch.equal(saved[1]["cache"][name], tensor), name


def test_a_session_of_another_model_or_a_damaged_one_is_refused_and_kept(models, tmp_path):
    session = tmp_path / "chat.pt"
    assert chat(models["model"], "First Citizen:\n", "--session", session).returncode == 0
    saved = session.read_bytes()
    assert_usage_error(chat(models["other"], "All:\n", "--session", session), "was saved with another model")
    assert_usage_error(chat(models["model"], "All:\n", "--session", session, "--prompt", "All:"),
                       "goes on from its own text: drop --prompt")
    assert session.read_bytes() == saved  # nothing saved is lost
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(saved[:len(saved) // 2])
    with pytest.raises(SessionError, match="is damaged or not a session file"):
        load_session(damaged, models["model"], load_model(models["model"])[0])
    result = subprocess.run([sys.executable, str(SAMPLE), "--checkpoint", str(models["model"]), "--session",
                             str(session)], env=ENV, capture_output=True, text=True, timeout=300)
    assert_usage_error(result, "--session saves an --interactive conversation: give --interactive too")


def test_a_session_that_cannot_be_saved_is_one_line_and_the_file_there_is_kept(models, tmp_path):
    """The disk fills as the session is saved: the line names the session, not standard output, and the file
    saved before stays as it was. A folder where no file can be made is refused before the conversation."""
    session = tmp_path / "chat.pt"
    assert chat(models["model"], "First Citizen:\n", "--session", session).returncode == 0
    saved = session.read_bytes()
    script = (f"import errno, runpy, sys, torch\n"
              f"def full_disk(*args, **kwargs):\n"
              f"    raise OSError(errno.ENOSPC, 'No space left on device')\n"
              f"torch.save = full_disk\n"
              f"sys.argv = ['sample.py', '--checkpoint', {str(models['model'])!r}, '--interactive', '--no-compile',\n"
              f"            '--temperature', '0', '--max-new-tokens', '5', '--session', {str(session)!r}]\n"
              f"runpy.run_path({str(SAMPLE)!r}, run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", script], input="All:\n", env=ENV, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1] == (f"sample.py: error: cannot save the session to {session} (No space "
                                              f"left on device); the file there is as it was")
    assert result.stdout.startswith("\nFirst Citizen:")  # the conversation was shown before the save
    assert session.read_bytes() == saved
    if Path("/proc/self").is_dir():  # a folder that exists, in which no file can be made
        assert_usage_error(chat(models["model"], "All:\n", "--session", "/proc/chat.pt"),
                           "--session /proc/chat.pt: cannot make a file in /proc (", "choose another folder")


def test_each_line_of_a_file_is_continued_as_if_alone_and_written_in_order(models, tmp_path):
    """--each-line decodes the lines together over one pool; each greedy continuation is the line's own, and the
    lines come out in the file's order. Blank lines are skipped; a long line is read from its last tokens."""
    lines = ["First Citizen:", "", "Before we proceed any further, hear me speak.", "All:", "Speak, speak."]
    prompts = tmp_path / "lines.txt"
    prompts.write_text("\n".join(lines) + "\n")
    new = 6
    result = subprocess.run([sys.executable, str(SAMPLE), "--checkpoint", str(models["model"]), "--prompt-file",
                             str(prompts), "--each-line", "--temperature", "0", "--max-new-tokens", str(new)],
                            env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    model, vocab, _ = load_model(models["model"])
    expected = []
    for line in filter(None, lines):
        ids = vocab.encode(line + "\n")[-(model.config.block_size - new):]
        drawn = generate(model, torch.tensor([ids]), new, sampling=GREEDY)[0, len(ids):].tolist()
        expected.append(line + "\n" + vocab.decode(drawn) + "\n")
    assert result.stdout == SEPARATOR.join(expected)
    assert re.search(r"24 tokens for 4 lines in .* a pool of \d+ blocks of 16 tokens .* prefix cache hit rate \d+%",
                     result.stderr.splitlines()[-1])


@pytest.mark.parametrize("args, fragment", [
    (["--each-line"], "--each-line continues the lines of --prompt-file"),
    (["--each-line", "--prompt-file", "LINES", "--num-samples", "2"], "--num-samples applies to plain decoding, "
                                                                      "not to --each-line"),
    (["--each-line", "--prompt-file", "LINES", "--max-new-tokens", "16"], "draws 1 to block_size - 1 = 15 tokens"),
    (["--each-line", "--prompt-file", "LINES", "--window", "8"], "--each-line keeps each line and its"),
    (["--each-line", "--prompt-file", "LINES", "--compile"], "--compile applies to plain, --draft and --interactive "
                                                              "decoding, not to --each-line"),
])
def test_each_line_options_that_cannot_work_are_refused(models, tmp_path, args, fragment):
    (tmp_path / "lines.txt").write_text("All:\n")
    args = [str(tmp_path / "lines.txt") if a == "LINES" else a for a in args]
    result = subprocess.run([sys.executable, str(SAMPLE), "--checkpoint", str(models["model"]), *args], env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert_usage_error(result, fragment)


def test_each_line_refuses_a_model_with_local_layers_in_one_line(tmp_path):
    """The engine's pool holds every key a layer attends; a local layer's window is not what it holds."""
    model = random_model(window_pattern="LG", local_window=4, vocab_size=len(VOCAB))
    checkpoint = save_checkpoint(checkpoint_state(model), tmp_path / "local.pt")
    (tmp_path / "lines.txt").write_text("All:\n")
    result = subprocess.run([sys.executable, str(SAMPLE), "--checkpoint", str(checkpoint), "--prompt-file",
                             str(tmp_path / "lines.txt"), "--each-line"], env=ENV, capture_output=True, text=True,
                            timeout=300)
    assert_usage_error(result, "--each-line: the engine's pool serves layers that attend everything, and this "
                               "model has local layers (window_pattern)")
    assert result.stdout == ""
