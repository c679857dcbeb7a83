"""Edges of saved conversations, continued: a conversation at any --precision is saved and taken up exactly, what
can be neither taken up nor saved (a pipe, a folder, a name too long) is refused before the first line is read, and
a session that cannot go on says what differs and what to do."""

import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest
import torch

from model.decoding.quantize import to_precision
from model.serving.conversation import Conversation
from runtime.checkpoint import load_model
from sampling.session import SessionError, load_session, save_session
from test_edges_sessions import rewritten
from test_sample import ENV, SAMPLE, assert_usage_error
from test_sample_sessions_and_lines import models, taken_up_after_two_turns  # noqa: F401  (models: a fixture)
from tiny_models import random_model, random_tokens

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow

TIMEOUT = 120  # seconds: a session that waits on its file fails the test, never hangs the suite


def converse(checkpoint, typed: str, *args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SAMPLE), "--checkpoint", str(checkpoint), "--interactive",
                           "--temperature", "0", "--max-new-tokens", "20", *map(str, args)], input=typed, env=ENV,
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd)


@pytest.mark.parametrize("design", [{}, {"pos_emb": "rope", "n_head": 4, "n_kv_head": 2},
                                    {"kv_latent": 8, "pos_emb": "rope", "kv_latent_rope": 4},
                                    {"window_pattern": "LG", "local_window": 4}])
def test_a_conversation_decoded_at_int8_is_saved_and_goes_on_exactly_when_taken_up(tmp_path, design):
    """The int8 model refuses state_dict (it is no fp32 model); the session's fingerprint reads its tensors."""
    model = to_precision(random_model(**design), "int8")
    turns, replies, _, later = taken_up_after_two_turns(model, tmp_path)
    assert list(later.reply(turns[2], 9)) == replies[2]


def test_sample_saves_an_int8_conversation_and_takes_it_up_as_one_uninterrupted(models, tmp_path):
    lines = ["First Citizen:\n", "All:\n"]
    whole, parts = tmp_path / "whole.pt", tmp_path / "parts.pt"
    uninterrupted = converse(models["model"], "".join(lines), "--session", whole, "--precision", "int8")
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    first = converse(models["model"], lines[0], "--session", parts, "--precision", "int8")
    assert first.returncode == 0 and "saved the session" in first.stderr, first.stderr
    second = converse(models["model"], lines[1], "--session", parts, "--precision", "int8")
    assert second.returncode == 0 and "the next line is all the model reads" in second.stderr, second.stderr
    assert torch.equal(*(torch.load(path, weights_only=True)["tokens"] for path in (whole, parts)))


def test_a_session_that_could_not_be_saved_at_the_end_is_refused_before_the_first_line(models, tmp_path):
    """A name the file takes but the temporary file beside it (written, then renamed) does not; a loop of links."""
    long_name = tmp_path / ("a" * 240)
    result = converse(models["model"], "All:\n", "--session", long_name)
    assert_usage_error(result, f"--session {long_name}: cannot make a file in {tmp_path} (File name too long); "
                               f"choose a shorter name")
    assert result.stdout == ""
    (tmp_path / "loop.pt").symlink_to("loop.pt")
    result = converse(models["model"], "All:\n", "--session", tmp_path / "loop.pt")
    assert_usage_error(result, f"--session {tmp_path / 'loop.pt'}: cannot follow its links (", "give a file")
    assert result.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == ["loop.pt"]


@pytest.mark.parametrize("kind", ["a pipe (FIFO)", "a folder", "a device", "a socket", "a link to a pipe"])
def test_a_session_that_is_no_regular_file_is_refused_before_any_output_without_waiting(models, tmp_path, kind):
    path, link = tmp_path / "chat.pt", tmp_path / "link.pt"
    if kind in ("a pipe (FIFO)", "a link to a pipe"):
        os.mkfifo(path)
    elif kind == "a folder":
        path.mkdir()
    elif kind == "a device":
        path = "/dev/null"
    else:
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
    given = path
    if kind == "a link to a pipe":
        link.symlink_to(path)
        given, kind = link, "a pipe (FIFO)"
    result = converse(models["model"], "All:\n", "--session", given)
    assert_usage_error(result, f"--session {given} is {kind}, not a session file: give a file (a new name starts a "
                               f"new session)")
    assert result.stdout == ""


def test_load_session_refuses_a_pipe_without_waiting_for_a_writer(tmp_path):
    """What is opened is checked again: a pipe put in the file's place after the options were checked."""
    fifo = tmp_path / "chat.pt"
    os.mkfifo(fifo)
    model, refused = random_model(), []

    def take_up():
        with pytest.raises(SessionError) as error:
            load_session(fifo, "model.pt", model)
        refused.append(str(error.value))

    thread = threading.Thread(target=take_up, daemon=True)
    thread.start()
    thread.join(timeout=30)
    if thread.is_alive():  # waiting on open: a writer lets it go
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert refused == [f"{fifo} is not a regular file: give a session file, or a new name to start one"]


@pytest.mark.parametrize("saved_at, taken_at", [("fp32", "int8"), ("fp32", "bf16"), ("bf16", "fp32")])
def test_a_session_taken_up_at_another_precision_names_the_one_to_give(models, tmp_path, saved_at, taken_at):
    """Not "damaged", nor "another model": the same weights at another precision, and the option that takes it up."""
    session = tmp_path / "chat.pt"
    assert converse(models["model"], "First Citizen:\n", "--session", session, "--precision",
                    saved_at).returncode == 0
    before = session.read_bytes()
    result = converse(models["model"], "All:\n", "--session", session, "--precision", taken_at)
    assert_usage_error(result, f"--session {session} was saved at --precision {saved_at}, and its cache holds what "
                               f"the weights computed at that precision: take it up with --precision {saved_at}")
    assert result.stdout == "" and session.read_bytes() == before
    followed = converse(models["model"], "All:\n", "--session", session, "--precision", saved_at)
    assert followed.returncode == 0 and "took up" in followed.stderr, followed.stderr


def test_a_session_of_an_earlier_version_which_records_no_precision_names_both_causes(models, tmp_path):
    """Its weights differ at another precision, or once the checkpoint has changed: the file cannot tell which."""
    session = tmp_path / "chat.pt"
    assert converse(models["model"], "First Citizen:\n", "--session", session).returncode == 0
    saved = torch.load(session, weights_only=True)
    rewritten({key: value for key, value in saved.items() if key not in ("precision", "device")}, session,
              checkpoint=str(models["model"]))
    result = converse(models["model"], "All:\n", "--session", session, "--precision", "bf16")
    assert_usage_error(result, f"--session {session} was saved with {models['model']} at another --precision than "
                               f"bf16, or with weights it no longer holds: take it up at the --precision it was "
                               f"saved at, or start a new session under another name")
    followed = converse(models["model"], "All:\n", "--session", session)
    assert followed.returncode == 0 and "took up" in followed.stderr, followed.stderr


def test_a_session_whose_checkpoint_has_trained_since_says_that_its_weights_changed(models, tmp_path):
    checkpoint = tmp_path / "run/best.pt"
    checkpoint.parent.mkdir()
    shutil.copy(models["model"], checkpoint)
    session = tmp_path / "chat.pt"
    assert converse(checkpoint, "First Citizen:\n", "--session", session).returncode == 0
    shutil.copy(models["other"], checkpoint)  # the run trained on and wrote its best.pt again
    result = converse(checkpoint, "All:\n", "--session", session)
    line = assert_usage_error(result, f"--session {session} was saved with the weights {checkpoint} held then; "
                                      f"they have changed since (trained further, or written again), and its cache "
                                      f"holds what the old ones computed: start a new session under another name")
    assert line.count(str(checkpoint)) == 1 and result.stdout == ""
    followed = converse(checkpoint, "All:\n", "--session", tmp_path / "new.pt")
    assert followed.returncode == 0, followed.stderr


def test_a_session_names_its_checkpoint_as_a_path_that_works_from_any_folder_or_says_it_is_gone(models, tmp_path):
    """Saved with a relative path from one folder, taken up from another: the path given to follow is whole. A
    checkpoint removed since is said to be gone, not to be given."""
    (tmp_path / "here/run").mkdir(parents=True)
    shutil.copy(models["model"], tmp_path / "here/run/best.pt")
    session = tmp_path / "chat.pt"
    assert converse("run/best.pt", "First Citizen:\n", "--session", session, cwd=tmp_path / "here").returncode == 0
    result = converse(models["other"], "All:\n", "--session", session)
    saved_with = tmp_path / "here/run/best.pt"
    assert_usage_error(result, f"--session {session} was saved with another model ({saved_with}), not "
                               f"{models['other']}: take it up with --checkpoint {saved_with}, or start a new "
                               f"session under another name")
    followed = converse(saved_with, "All:\n", "--session", session)
    assert followed.returncode == 0 and "took up" in followed.stderr, followed.stderr
    saved_with.unlink()
    result = converse(models["other"], "All:\n", "--session", session)
    assert_usage_error(result, f"--session {session} was saved with the model in {saved_with}, which is no longer "
                               f"there: start a new session under another name")


def test_a_bf16_session_from_a_gpu_taken_up_on_the_cpu_names_the_device(models, tmp_path):
    """bf16 attention keeps a bfloat16 cache on CUDA and a float32 one on the CPU: the same weights, another cache.
    A session saved there is made here, its cache as CUDA keeps it."""
    model, _, _ = load_model(models["model"], precision="bf16")
    chat = Conversation(model)
    list(chat.reply(random_tokens(6).tolist(), 4))
    session = tmp_path / "chat.pt"
    save_session(session, chat.state(), models["model"], model)
    saved = torch.load(session, weights_only=True)
    rewritten(saved, session, device="cuda", cache={name: t.bfloat16() if t.is_floating_point() else t
                                                     for name, t in saved["cache"].items()})
    with pytest.raises(SessionError, match=f"^{session} was saved on cuda, whose cache holds bfloat16 where cpu's "
                                           f"holds float32: take it up with --device cuda, or start a new session "
                                           f"under another name$"):
        load_session(session, models["model"], model)
