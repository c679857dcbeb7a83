"""Thread counts a run will not start (runtime/devices.py, threads_refused): more than the cores this process may
run on, named as train.threads, sample.py's --threads, OMP_NUM_THREADS or a benchmark's --threads, is one line with
status 2 before any thread starts. 100,000 threads made train.py crash (status 139) and sample.py die silently."""

import os
import subprocess
import sys

import pytest

from programs import (ENV, REPO, SHORT, assert_one_line_error, checkpoint, data_root,  # noqa: F401 (fixtures)
                      sample_command, train_cli)
from runtime.devices import threads_refused, usable_cores
from test_train import TINY, data_overrides

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow

CORES = usable_cores()
TOO_MANY = [CORES + 1, 100_000]
BOUND = f"must be from 1 to {CORES} (the cores this process may run on)"


def test_the_rule_allows_one_thread_up_to_the_cores_this_process_may_run_on():
    assert CORES == (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    assert [threads_refused(n) for n in range(1, CORES + 1)] == [None] * CORES
    assert threads_refused(0) == f"must be from 1 to {CORES} (the cores this process may run on), got 0"
    assert threads_refused(CORES + 1).endswith(f"got {CORES + 1}")


@pytest.mark.parametrize("threads", TOO_MANY)
def test_train_threads_beyond_the_cores_are_refused_before_the_run_begins(tmp_path, data_root, threads):
    result = train_cli(*TINY, *SHORT, *data_overrides(data_root), f"train.threads={threads}",
                       f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120)
    assert_one_line_error(result, "train.py", f"train.threads {BOUND}, got {threads}")
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


def without_omp(**more) -> dict:
    return {**{key: value for key, value in ENV.items() if key != "OMP_NUM_THREADS"}, **more}


def test_omp_num_threads_beyond_the_cores_is_refused_by_train_py(tmp_path, data_root):
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, *SHORT, *data_overrides(data_root),
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                            env=without_omp(OMP_NUM_THREADS=str(CORES + 1)), capture_output=True, text=True,
                            timeout=120)
    assert_one_line_error(result, "train.py", f"OMP_NUM_THREADS {BOUND}, got {CORES + 1}: set it lower, or unset it")
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("threads", TOO_MANY)
def test_sample_py_refuses_threads_beyond_the_cores_before_any_output(checkpoint, threads):
    result = subprocess.run(sample_command(checkpoint, "--threads", threads, "--max-new-tokens", 5), env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, "sample.py", f"--threads {BOUND}, got {threads}")
    assert result.stdout == ""


def test_sample_py_refuses_omp_num_threads_beyond_the_cores_before_any_output(checkpoint):
    result = subprocess.run(sample_command(checkpoint, "--max-new-tokens", 5), capture_output=True, text=True,
                            env=without_omp(OMP_NUM_THREADS=str(CORES + 1)), timeout=120)
    assert_one_line_error(result, "sample.py", f"OMP_NUM_THREADS {BOUND}, got {CORES + 1}")
    assert result.stdout == ""


def test_the_quality_benchmark_refuses_threads_beyond_the_cores_before_any_run(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "bench" / "train_quality.py"), "--threads", str(CORES + 1)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, "train_quality.py", f"--threads: {BOUND}, got {CORES + 1}")
    assert result.stdout == "" and list(tmp_path.iterdir()) == []
