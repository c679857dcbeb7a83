"""train.py and sample.py run as a user runs them: the commands, their one-line errors, a tiny run and model."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import corpus
import train
from data import CharVocab
from model import GPT, GPTConfig, build_model
from test_train import config
from tiny_models import random_model
from runtime.checkpoint import build_checkpoint, save_checkpoint

REPO = corpus.REPO
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SHORT = ["train.max_iters=4", "train.eval_interval=2", "train.eval_iters=1", "train.log_interval=1",
         "optim.warmup_iters=1"]


def child_signal(signum: int, handler=signal.SIG_DFL):
    """A preexec_fn: in the child, signum delivered and handled by handler, whatever the parent left (a disposition
    of SIG_IGN, as nohup or a shell's background job leaves it, or a blocked mask, is inherited across exec)."""
    def preexec() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        signal.signal(signum, handler)
    return preexec


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


def train_cli(*args, cwd, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train.py"), *map(str, args)], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, prog: str, *fragments: str, status: int = 2) -> str:
    assert result.returncode == status, result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("preset=")]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def tree(folder: Path) -> dict:
    """Every file under folder with its contents and modification time."""
    return {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, data_root) -> Path:
    """A run stopped at step 2 of 4: its last.pt can be resumed."""
    tmp_path = tmp_path_factory.mktemp("short")
    run_dir = tmp_path / "runs/short"
    train.main(config(tmp_path, data_root, *SHORT), run_dir)
    last = torch.load(run_dir / "last.pt", weights_only=True)
    last["training"]["step"] = 2
    save_checkpoint(last, run_dir / "last.pt")
    return run_dir


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    vocab = CharVocab.from_text(corpus.TEXT)
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=len(vocab), block_size=16, n_layer=1, n_head=2, n_embd=16))
    return save_checkpoint(build_checkpoint(model, vocab), tmp_path_factory.mktemp("run") / "best.pt")


def sample_command(checkpoint: Path, *args) -> list[str]:
    return [sys.executable, str(REPO / "sample.py"), "--checkpoint", str(checkpoint), *map(str, args)]


@pytest.fixture(scope="module")
def model() -> GPT:
    return random_model()
