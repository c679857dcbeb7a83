"""The API benchmarks run end to end on a tiny run: the determinism protocol's table, and the val loss through
echo and logprobs beside kvgpt's own. A Python without the other tool (lm-eval, llama.cpp's or vLLM's server) is
refused in one line."""

import re
import subprocess
import sys

import pytest

from programs import REPO
from test_edges_benches import runs  # noqa: F401  runs: a fixture

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow


def bench(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_determinism_counts_one_completion_in_each_phase_with_the_same_bits(runs, tmp_path):
    result = bench(REPO / "bench/determinism.py", "--checkpoint", runs / "plain", "--sends", 4, "--traffic", 6,
                   "--clients", 3, "--new", 4, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| alone") or line.startswith("| mixed")]
    assert rows == ["| alone | 4 | 1 | 4 of 4 |", "| mixed traffic | 4 | 1 | 4 of 4 |"], result.stdout


def test_the_loss_through_the_api_is_kvgpts_own(runs, tmp_path):
    result = bench(REPO / "bench/eval_api.py", "--checkpoint", runs / "plain", "--chars", 300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    means = [float(m) for m in re.findall(r"^\| [^|]+ \| (\d+\.\d+) \|", result.stdout, re.M)]
    assert len(means) == 2 and abs(means[0] - means[1]) <= 1e-5, result.stdout
    assert "lm-evaluation-harness" in result.stdout


@pytest.mark.parametrize("script, option, module", [("lm_eval_api.py", "--lm-eval-python", "lm_eval"),
                                                     ("determinism.py", "--llama-cpp-python", "llama_cpp.server"),
                                                     ("determinism.py", "--vllm-python", "vllm")])
def test_a_python_without_the_other_tool_is_refused_in_one_line(runs, tmp_path, script, option, module):
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')  # -S: no site-packages, so no other tool
    bare.chmod(0o755)
    result = bench(REPO / "bench" / script, "--checkpoint", runs / "plain", option, bare, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and f"has no {module}" in result.stderr, result.stderr
    assert "was not run" in result.stderr, result.stderr
