"""Edges of saved conversations (sample.py --interactive --session): a damaged or foreign file is refused in one
line naming it and left as it was, a session keeps its prompt from the start, and one process at a time writes a
session file."""

import subprocess
import sys

import pytest
import torch

from model.serving.conversation import Conversation
from sampling.session import checksum
from test_sample import ENV, SAMPLE, VOCAB, assert_usage_error
from test_sample_sessions_and_lines import chat, models  # noqa: F401  models: a fixture
from tiny_models import random_model, random_tokens

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow


def rewritten(saved: dict, path, *, keep_checksum: bool = False, **changes):
    """The session saved, changed, written to path: with its old checksum (damaged on disk) or a new one (a
    file another program wrote, whose checksum matches what it holds)."""
    contents = {**saved, **changes}
    if not keep_checksum:
        contents["checksum"] = checksum(contents)
    torch.save(contents, path)
    return path


def flipped(cache: dict) -> dict:
    return {name: -t if t.is_floating_point() else t for name, t in cache.items()}


@pytest.mark.parametrize("change, fragment", [
    ("keys flipped", "is damaged: what it holds no longer matches its checksum"),
    ("float tokens", "is damaged (state['tokens'] must be a 1-D tensor of token ids (int64), got ({n},) "
                     "torch.float32)"),
    ("an id outside", "is damaged (state['tokens'] holds ids outside the vocabulary (0..34): 999)"),
    ("2-D tokens", "is damaged (state['tokens'] must be a 1-D tensor of token ids (int64), got (1, {n})"),
    ("start past the text", "is damaged (the saved cache holds tokens 100 to {fed} of a text of {n})"),
    ("the old format", "is not a session file of this version"),
    ("a checkpoint", "is not a session file of this version"),
])
def test_a_damaged_or_foreign_session_is_refused_in_one_line_naming_it_before_any_output(models, tmp_path, change,
                                                                                        fragment):
    """Refused before the checkpoint's line and before any text, the file left as it was: never continued with
    a reply that differs, nor saved back over itself."""
    good = tmp_path / "good.pt"
    assert chat(models["model"], "First Citizen:\n", "--session", good).returncode == 0
    saved = torch.load(good, weights_only=True)
    n = len(saved["tokens"])  # the prompt, the line and the reply; all but the reply's last token are cached
    session = tmp_path / "chat.pt"
    if change == "keys flipped":
        rewritten(saved, session, keep_checksum=True, cache=flipped(saved["cache"]))
    elif change == "float tokens":
        rewritten(saved, session, tokens=saved["tokens"].float())
    elif change == "an id outside":
        rewritten(saved, session, tokens=torch.cat([saved["tokens"][:3], torch.tensor([999]), saved["tokens"][4:]]))
    elif change == "2-D tokens":
        rewritten(saved, session, tokens=saved["tokens"][None])
    elif change == "start past the text":
        rewritten(saved, session, start=100)
    elif change == "the old format":
        rewritten(saved, session, format="kvgpt-session-1")
    else:
        session.write_bytes(models["model"].read_bytes())
    before = session.read_bytes()
    result = chat(models["model"], "All:\n", "--session", session)
    assert_usage_error(result, f"--session {session} ", fragment.format(n=n, fed=100 + n - 1 - saved["start"]),
                       "start a new one under another name")
    assert result.stdout == "" and session.read_bytes() == before


def test_restore_refuses_a_state_that_cannot_be_one_and_leaves_the_conversation_as_it_was():
    model = random_model()
    chat_ = Conversation(model)
    list(chat_.reply(random_tokens(6).tolist(), 4))
    state = chat_.state()
    other = Conversation(model)
    list(other.reply(random_tokens(5, seed=1).tolist(), 3))
    before = other.state()
    for bad, fragment in [({**state, "tokens": state["tokens"].float()}, "1-D tensor of token ids"),
                          ({**state, "tokens": state["tokens"] + 100}, "ids outside the vocabulary"),
                          ({**state, "start": 2.0}, "state\\['start'\\] must be an int"),
                          ({**state, "start": 8}, "the saved cache holds tokens 8 to 17 of a text of 10")]:
        with pytest.raises(ValueError, match=fragment):
            other.restore(bad)
        after = other.state()
        assert torch.equal(after["tokens"], before["tokens"]) and after["start"] == before["start"]
        assert all(torch.equal(after["cache"][n], t) for n, t in before["cache"].items())


@pytest.mark.parametrize("first_run", ["no line", "a line refused", "from a file"])
def test_a_new_session_keeps_its_prompt_from_the_start(models, tmp_path, first_run):
    """Input that ends before any line is used still saves the prompt: taken up, the session goes on from it,
    as one session given the prompt and the line goes on. Its own prompt is then never needed again."""
    prompt, line = "First Citizen:\n", "All:\n"
    whole = chat(models["model"], line, "--session", tmp_path / "whole.pt", "--prompt", prompt)
    assert whole.returncode == 0, whole.stderr
    session = tmp_path / "chat.pt"
    typed = "Speak\u00e9\n" if first_run == "a line refused" else ""  # é: not in the vocabulary
    if first_run == "from a file":
        (tmp_path / "prompt.txt").write_text(prompt)
        first = chat(models["model"], typed, "--session", session, "--prompt-file", tmp_path / "prompt.txt")
    else:
        first = chat(models["model"], typed, "--session", session, "--prompt", prompt)
    assert first.returncode == 0 and first.stdout == prompt, first.stderr
    assert torch.load(session, weights_only=True)["tokens"].tolist() == \
        torch.load(tmp_path / "whole.pt", weights_only=True)["tokens"][:len(prompt)].tolist()
    later = chat(models["model"], line, "--session", session)
    assert later.returncode == 0, later.stderr
    assert later.stdout == whole.stdout


def started_chat(checkpoint, session, *args) -> subprocess.Popen:
    """A --interactive session that has taken up (or started) session and waits for its first line."""
    process = subprocess.Popen([sys.executable, str(SAMPLE), "--checkpoint", str(checkpoint), "--interactive",
                                "--temperature", "0", "--max-new-tokens", "20", "--session", str(session), *args],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
                               text=True)
    for line in process.stderr:
        if line.startswith("type a line"):
            return process
    process.kill()
    raise AssertionError(f"the session did not start: {process.communicate()}")


def test_one_process_at_a_time_takes_up_and_saves_a_session_under_any_of_its_names(models, tmp_path):
    """A second process on the same session, named by the same path, another spelling of it or a link to it, is
    refused in one line before any output; the first saves its turn, and the second can then take it up. A session
    started by no one yet (no file) is held as well."""
    session = tmp_path / "chat.pt"
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.pt").symlink_to(session)
    text = "\n"  # the default prompt
    for existing in (False, True):
        first = started_chat(models["model"], session)
        try:
            for name in (session, tmp_path / "sub/../chat.pt", tmp_path / "link.pt"):
                second = chat(models["model"], "All:\n", "--session", name)
                assert_usage_error(second, f"--session {name} is in use by process {first.pid}: end that session "
                                           f"first, or choose another file")
                assert second.stdout == "" and session.exists() == existing
            first.communicate("All:\n", timeout=300)
        finally:
            first.kill()
        assert first.returncode == 0
        saved = VOCAB.decode(torch.load(session, weights_only=True)["tokens"].tolist())
        assert saved.startswith(text + "All:\n") and len(saved) > len(text + "All:\n")  # its turn, and all before
        text = saved
    later = chat(models["model"], "Speak.\n", "--session", tmp_path / "link.pt")
    assert later.returncode == 0, later.stderr
    assert (tmp_path / "link.pt").is_symlink()  # saving through the link wrote the file it names
    assert VOCAB.decode(torch.load(session, weights_only=True)["tokens"].tolist()).startswith(text + "Speak.\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.pt", "link.pt", "sub"]  # no lock file left


def test_a_session_whose_process_was_killed_is_taken_up_by_the_next(models, tmp_path):
    """The lock goes with the process that held it: kill -9 leaves its file, which the next process takes over."""
    session = tmp_path / "chat.pt"
    assert chat(models["model"], "First Citizen:\n", "--session", session).returncode == 0
    saved = session.read_bytes()
    first = started_chat(models["model"], session)
    first.kill()
    first.communicate()
    assert (tmp_path / ".chat.pt.lock").exists() and session.read_bytes() == saved
    later = chat(models["model"], "All:\n", "--session", session)
    assert later.returncode == 0, later.stderr
    assert not (tmp_path / ".chat.pt.lock").exists()
