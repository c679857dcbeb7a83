"""The benchmarks given a mistake (a bad number, a checkpoint of the wrong design, train.py settings that cannot
train): one line with status 2, before any output, never a traceback; a train.py run that fails keeps its status."""

import subprocess
import sys
from pathlib import Path

import pytest

import train
from bench.configs import training_failed
from programs import REPO, SHORT, assert_one_line_error
from runtime.errors import UsageError
from test_train import config

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow

LOCAL = ["model.window_pattern=LG", "model.local_window=4"]
ROPE = ["model.pos_emb=rope"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Tiny runs of train.py (block_size 16) on the tests' corpus: plain, with local layers, and rotary."""
    tmp_path = tmp_path_factory.mktemp("bench-runs")
    for name, overrides in (("plain", []), ("local", LOCAL), ("rope", ROPE)):
        train.main(config(tmp_path, tmp_path / "data", *SHORT, *overrides), tmp_path / "runs" / name)
    return tmp_path / "runs"


@pytest.mark.parametrize("script, args, fragments", [
    ("kv_budget.py", ["--checkpoint", "RUNS/plain", "--prompt-len", "1000", "--stream-len", "100"],
     ["--prompt-len 1000 leaves nothing to decode", "below 16"]),
    ("kv_budget.py", ["--checkpoint", "RUNS/plain", "--prompt-len", "4"], ["recall task needs block_size >= 40"]),
    ("engine.py", ["--checkpoint", "RUNS/local", "--new", "4"], ["--checkpoint", "local layers"]),
    ("kv_designs.py", ["train", "--seeds", "-1"], ["--seeds", "got '-1'"]),
    ("kv_designs.py", ["train", "--train-overrides", "model.kv_latent=0"], ["--train-overrides", "kv_latent"]),
    ("kv_designs.py", ["train", "--designs", "share2", "--train-overrides", "model.n_layer=3"],
     ["share2", "n_layer 3"]),
    ("train_quality.py", ["--seeds", "-1"], ["--seeds", "got '-1'"]),
    ("train_quality.py", ["--threads", "0"], ["--threads", "got 0"]),
    ("train_quality.py", ["--candidate", "x", "model.kv_latent=0"], ["--candidate x", "kv_latent"]),
    ("decode.py", ["--device", "bogus"], ["--device", "'bogus' is not a device"]),
    ("train_throughput.py", ["--warmup", "-1"], ["--warmup", "got '-1'"]),
    ("curve.py", ["RUNS/none"], ["no folder at"]),
    ("rolling.py", ["--checkpoint", "RUNS/plain"], ["learned positions"]),
    ("rolling.py", ["--no-speed", "--checkpoint", "RUNS/rope", "--precision", "int8"], ["--precision", "--no-speed"]),
    ("speculative.py", ["--ceiling-only", "--context", "1000"], ["--context 1000", "block_size 256"]),
    ("engines.py", ["--vllm-python", "/nonexistent"], ["--vllm-python /nonexistent does not exist"]),
    ("engines.py", ["--vllm-python", "RUNS"], ["--vllm-python", "is a folder"]),
    ("engines.py", ["--vllm-python", "RUNS/plain/last.pt"], ["--vllm-python", "is not executable"]),
    ("engines.py", ["--checkpoint", "RUNS/none"], ["--checkpoint", "no checkpoint at"]),
    ("serve_load.py", ["--checkpoint", "RUNS/plain", "--new", "100"], ["--new 100 leaves no room", "block_size=16"]),
    ("serve_load.py", ["--checkpoint", "RUNS/local"], ["--checkpoint", "local layers", "sample.py decodes it"]),
    ("serve_load.py", ["--checkpoint", "RUNS/plain", "--new", "8", "--requests", "4", "--max-batch", "10000000000"],
     ["serve.py failed: serve.py: error: a pool of", "lower --max-batch"]),
    ("page_screenshot.py", ["--checkpoint", "RUNS/plain", "--out", "RUNS/none/page.png"], ["--out", "no folder"]),
    ("page_screenshot.py", ["--checkpoint", "RUNS/plain", "--out", "page.png", "--max-tokens", "0"],
     ["--max-tokens", "got 0"]),
    ("page_screenshot.py", ["--checkpoint", "RUNS/local", "--out", "page.png"], ["--checkpoint", "local layers"]),
    ("page_screenshot.py", ["--checkpoint", "RUNS/plain", "--out", "page.png"],
     ["--max-tokens 85 leaves no room for the prompt's 42 tokens in block_size=16", "block_size is above 42"]),
    ("engines.py", ["--checkpoint", "RUNS/plain", "--design", "gpt2"], ["--design", "--checkpoint"]),
    ("engines.py", ["--prompts", "0"], ["--prompts", "got 0"]),
    ("engines.py", ["--batch", "0"], ["--batch", "got 0"]),
    ("engines.py", ["--batch", "4", "--prompts", "2"], ["--batch", "--prompts", "give one of them"]),
    ("serve_load.py", ["--threads", "0"], ["--threads", "got 0"]),
    ("serve_load.py", ["--vllm-python", "/nonexistent"], ["--vllm-python races both servers", "--client openai"]),
    ("determinism.py", ["--checkpoint", "RUNS/plain", "--new", "100"], ["--new 100 leaves no room"]),
    ("determinism.py", ["--checkpoint", "RUNS/local"], ["--checkpoint", "local layers"]),
    ("determinism.py", ["--sends", "0"], ["--sends", "got 0"]),
    ("eval_api.py", ["--checkpoint", "RUNS/local"], ["--checkpoint", "local layers"]),
    ("eval_api.py", ["--checkpoint", "RUNS/none"], ["--checkpoint", "no checkpoint at"]),
])
def test_a_benchmark_refuses_a_mistake_in_one_line_with_status_2_before_any_output(runs, tmp_path, script, args,
                                                                                    fragments):
    args = [a.replace("RUNS", str(runs)) for a in args]
    result = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    result.stderr = result.stderr.replace(f"{script} train: ", f"{script}: ")  # argparse names the subcommand too
    assert_one_line_error(result, script, *fragments)
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("status, error", [(2, UsageError), (1, SystemExit), (137, SystemExit)])
def test_a_failed_training_run_keeps_train_pys_verdict_in_one_line(status, error):
    failed = training_failed("mha", subprocess.CompletedProcess([], status, "", "train.py: error: full disk\n"))
    assert isinstance(failed, error) and "mha failed: train.py: error: full disk" in str(failed)
    assert str(training_failed("mha", subprocess.CompletedProcess([], status, "", ""))).endswith(
        f"mha failed: exit status {status}")
