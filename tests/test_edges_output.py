"""Output that stops part-way (a disk that fills, a file-size limit) is one line with status 1, in every way the
programs write, and buffered or not (PYTHONUNBUFFERED): a short write is never taken for a whole one."""

import resource
import subprocess
import sys

import pytest

import corpus
from data import CharVocab
from runtime.checkpoint import build_checkpoint, save_checkpoint
from tiny_models import random_model, trained_on

from programs import ENV, REPO, assert_one_line_error, checkpoint, sample_command  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow

LIMIT = 1 << 22  # the file-size limit: the output file starts this close to it, every other file stays far below
SPARE = 5  # bytes of the whole output that do not fit: the last write is the one cut short


def run_near_limit(command, tmp_path, room: int, unbuffered: bool, stdin: str | None = None):
    """Run command with standard output appended to a file that has `room` bytes left below the size limit.
    Returns the process and what it wrote."""
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        f.truncate(LIMIT - room)  # sparse: no disk is used for the bytes already there
    env = {**ENV, "PYTHONUNBUFFERED": "1"} if unbuffered else {k: v for k, v in ENV.items() if k != "PYTHONUNBUFFERED"}
    with open(out, "ab") as f:
        result = subprocess.run(command, stdout=f, stderr=subprocess.PIPE, input=stdin, text=True, env=env,
                                cwd=tmp_path, timeout=120,
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT)))
    return result, out.read_bytes()[LIMIT - room:]


def whole_output(command, tmp_path, stdin: str | None = None) -> bytes:
    result = subprocess.run(command, capture_output=True, input=None if stdin is None else stdin.encode(), env=ENV,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


MODES = {
    "one sample": ["--max-new-tokens", 1000],  # written every 64 tokens: the last write holds the 40 after
    "several samples": ["--max-new-tokens", 300, "--num-samples", 3],  # written at the end, at once
    "draft": ["--max-new-tokens", 1000, "--draft", "lookup"],
    "each line": ["--each-line", "--max-new-tokens", 8],
    "interactive": ["--interactive", "--max-new-tokens", 40, "--prompt", "ROMEO: the"],
}
LINES = "".join(f"line {'i' * i} of the play\n" for i in range(30))


@pytest.mark.parametrize("mode, unbuffered", [*((mode, True) for mode in MODES), ("several samples", False)],
                         ids=[*(f"{mode}-unbuffered" for mode in MODES), "several samples-buffered"])
def test_output_cut_short_is_one_line_with_status_1_in_every_mode(checkpoint, tmp_path, mode, unbuffered):
    (tmp_path / "lines.txt").write_text(LINES)
    args = [*MODES[mode], "--temperature", 0, "--no-compile", *(["--prompt-file", "lines.txt"]
                                                                 if mode == "each line" else [])]
    stdin = "the king\n" * 20 if mode == "interactive" else None
    command = sample_command(checkpoint, *args)
    whole = whole_output(command, tmp_path, stdin)
    # interactive: its replies are written a character at a time, so only the text shown first can be cut short
    room = len("ROMEO: the") - SPARE if mode == "interactive" else len(whole) - SPARE
    result, written = run_near_limit(command, tmp_path, room, unbuffered, stdin)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1] == \
        "sample.py: error: cannot write the samples to standard output (File too large)", result.stderr
    assert written == whole[:room]


@pytest.mark.parametrize("unbuffered", [True, False], ids=["unbuffered", "buffered"])
@pytest.mark.parametrize("program, args", [
    ("train.py", ["--cfg", "job"]),  # Hydra's composed config, as `> config.yaml` keeps it
    ("sample.py", ["--help"]),
    ("export.py", ["--help"]),
], ids=["train.py --cfg job", "sample.py --help", "export.py --help"])
def test_a_program_whose_text_is_cut_short_does_not_end_with_success(tmp_path, program, args, unbuffered):
    command = [sys.executable, str(REPO / program), *args]
    whole = whole_output(command, tmp_path)
    result, written = run_near_limit(command, tmp_path, len(whole) - SPARE, unbuffered)
    line = assert_one_line_error(result, program, "standard output", "File too large", status=1)
    assert line in (f"{program}: error: cannot write to standard output (File too large)",
                    f"{program}: error: File too large: standard output")
    assert written == whole[:len(whole) - SPARE]


@pytest.mark.parametrize("unbuffered", [True, False], ids=["unbuffered", "buffered"])
def test_an_export_whose_last_line_cannot_be_written_says_it_is_whole(tmp_path, unbuffered):
    """The folder is written before the line that says so: a script told only "failed" would retry, and be refused."""
    pytest.importorskip("transformers", reason="export.py's packages are not installed")
    vocab = CharVocab.from_text(corpus.TEXT)
    model = random_model(vocab_size=len(vocab))
    # with its text's character counts, as train.py records them: the export has nothing to warn of
    checkpoint = save_checkpoint(build_checkpoint(model, vocab, text=trained_on(vocab, vocab.chars[-1])),
                                 tmp_path / "best.pt")
    command = [sys.executable, str(REPO / "export.py"), "--checkpoint", str(checkpoint), str(tmp_path / "out")]
    result, written = run_near_limit(command, tmp_path, 10, unbuffered)
    assert_one_line_error(result, "export.py", f"exported {checkpoint} to {tmp_path / 'out'} (hf), but could not say "
                                               "so on standard output", "File too large", status=1)
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()
