"""export.py at its edges: a full disk or a file-size limit, and the umask. Each ends in one line (or a whole
export) and leaves nothing behind."""

import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # requirements-dev.txt installs them; kvgpt runs without them
pytest.importorskip("onnxruntime")

from programs import ENV, REPO, assert_one_line_error  # noqa: E402
from runtime.checkpoint import build_checkpoint, save_checkpoint  # noqa: E402
from test_export import VOCAB, kvgpt_model, run_export  # noqa: E402

HF_FILES = ["README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"]
ONNX_FILES = ["README.md", "model.onnx", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture
def run(tmp_path) -> Path:
    """A run directory holding a tiny model's best.pt, alone in tmp_path."""
    (tmp_path / "run").mkdir()
    save_checkpoint(build_checkpoint(kvgpt_model("learned multi-head"), VOCAB), tmp_path / "run" / "best.pt")
    return tmp_path / "run"


def everything(folder: Path) -> list[Path]:
    """Every path under folder, hidden ones too."""
    return sorted(path.relative_to(folder) for path in folder.rglob("*"))


def export_with(hook: str, *argv, cwd: Path, preexec_fn=None, **popen) -> subprocess.Popen:
    """export.py run as a user runs it, once the Python code hook has changed one of its steps."""
    script = f"""
import os, runpy, signal, sys, time
sys.path.insert(0, {str(REPO)!r})
{hook}
sys.argv = ["export.py", *{[str(a) for a in argv]!r}]
runpy.run_path({str(REPO / "export.py")!r}, run_name="__main__")
"""
    return subprocess.Popen([sys.executable, "-c", script], cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn, **popen)


def finished(process: subprocess.Popen, timeout: float = 120) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def file_size_limit(limit: int):
    """A preexec_fn: the child may write no file larger than limit bytes (Python then gets EFBIG, not SIGXFSZ)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.parametrize("fmt", ["hf", "onnx"])
def test_a_file_size_limit_is_one_line_and_leaves_nothing(run, fmt):
    """The weights (60 KB, 110 KB) pass the limit, the tokenizer does not: status 1, no traceback."""
    before = everything(run.parent)
    result = finished(export_with("", "--checkpoint", run, run.parent / "out", "--format", fmt, cwd=run.parent,
                                  preexec_fn=file_size_limit(20_000)))
    assert_one_line_error(result, "export.py", "cannot export to", "(File too large", "nothing was left there",
                          status=1)
    assert everything(run.parent) == before


def test_the_weights_on_a_full_disk_are_one_line(run, capsys, monkeypatch):
    """model.safetensors meets ENOSPC as it is written, without root to mount a small disk."""
    write_bytes = Path.write_bytes

    def full(path, data):
        if path.name == "model.safetensors":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write_bytes(path, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    monkeypatch.setattr("runtime.errors.silence", lambda stream: None)
    status, err = run_export(capsys, "--checkpoint", run, run.parent / "out")
    assert status == 1 and err.count("\n") == 1 and "(No space left on device" in err, err
    assert sorted(p.name for p in run.parent.iterdir()) == ["run"]


def test_the_export_leaves_the_umask_alone_and_its_files_follow_it(run):
    """Reading the umask means setting it, which races with any thread that makes a file meanwhile: os.umask is
    never called. The folder and its files get the umask's modes, as any new ones."""
    hook = """
def umask(*args):
    raise AssertionError("os.umask called")
os.umask = umask
"""
    result = finished(export_with(hook, "--checkpoint", run, run.parent / "out", cwd=run.parent,
                                  preexec_fn=lambda: os.umask(0o027)))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert (run.parent / "out").stat().st_mode & 0o777 == 0o750
    assert {path.stat().st_mode & 0o777 for path in (run.parent / "out").iterdir()} == {0o640}
