"""serve.py run as a user runs it, on a free loopback port, over a checkpoint the tests write: the tests drive it
with OpenAI's own client, plain HTTP and a real browser."""

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from corpus import REPO
from data import CharVocab
from model import GREEDY, build_model, generate
from model.gpt import GPTConfig
from runtime.checkpoint import build_checkpoint, save_checkpoint

pytest.importorskip("fastapi", reason="serve.py's packages are not installed: pip install -r requirements-serve.txt")
pytest.importorskip("uvicorn", reason="serve.py's packages are not installed: pip install -r requirements-serve.txt")

# Newline and printable ASCII: '<' and '>' included, so that a prompt or a model can write HTML.
VOCAB = CharVocab("\n" + "".join(chr(c) for c in range(32, 127)))
BLOCK_SIZE = 256
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
START_SECONDS = 60


def write_checkpoint(folder: Path, block_size: int = BLOCK_SIZE) -> Path:
    """A random GPT with weights well above GPT-2's init, so that every token of the context moves its logits."""
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=len(VOCAB), block_size=block_size, n_layer=4, n_head=4, n_embd=256))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    return save_checkpoint(build_checkpoint(model, VOCAB), folder / "best.pt")


class Served:
    """A serve.py process and its URL, stopped with SIGTERM when the test is done with it."""

    def __init__(self, checkpoint: Path, *args, env: dict | None = None):
        # eager passes: compiling the engine's pass for each test's weights would take most of the suite's time
        self.process = subprocess.Popen([sys.executable, str(REPO / "serve.py"), "--checkpoint", str(checkpoint),
                                         "--port", "0", "--no-compile", *map(str, args)], cwd=checkpoint.parent, env=env or ENV,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.process.stdout], [], [], START_SECONDS)
        line = self.process.stdout.readline() if ready else ""  # serve.py prints its URL once it listens
        if "http://" not in line:
            self.process.kill()
            raise AssertionError(f"serve.py did not start: {line}{self.process.stderr.read()}")
        self.url = "http://" + line.split("http://")[1].split()[0]
        self.api = self.url + "/v1"

    def stop(self, sig=signal.SIGTERM, timeout: float = 10) -> tuple[int, float, str]:
        """Send sig; the exit status, the seconds it took to exit, and stderr."""
        start = time.monotonic()
        self.process.send_signal(sig)
        try:
            status = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        return status, time.monotonic() - start, self.process.stderr.read()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(checkpoint):
    served = Served(checkpoint, "--max-batch", 32)  # room for every client that drops mid-stream to be running
    yield served
    served.stop()


@pytest.fixture(scope="module")
def local_model(checkpoint):
    from runtime.checkpoint import load_model
    return load_model(checkpoint)[0]


def greedy_alone(model, prompt: str, max_tokens: int) -> str:
    """What generate draws greedily for the prompt alone, with the contiguous cache."""
    ids = torch.tensor([VOCAB.encode(prompt)])
    return VOCAB.decode(generate(model, ids, max_tokens, sampling=GREEDY)[0, ids.size(1):].tolist())
