"""train.py's one-line refusals: a flag mistake, a text that is no regular file, a run beyond memory, under torchrun."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_train import TINY, data_overrides
from programs import ENV, REPO, assert_one_line_error, checkpoint, data_root, sample_command, train_cli

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow


@pytest.mark.parametrize("argv, fragment", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["preset=cpu", "-m", "train.seed=1,2"], "unrecognized arguments: train.seed=1,2"),
    (["--cfg"], "argument --cfg/-c: expected one argument"),
])
def test_a_flag_mistake_is_one_line(tmp_path, argv, fragment):
    result = train_cli(*argv, cwd=tmp_path)
    assert_one_line_error(result, "train.py", fragment, "the flags, which go before the overrides")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["a pipe with no writer", "a device without end", "a folder"])
def test_a_text_that_is_not_a_regular_file_is_refused_before_it_is_read(tmp_path, kind, checkpoint):
    path = {"a pipe with no writer": tmp_path / "pipe", "a device without end": Path("/dev/zero"),
            "a folder": tmp_path / "folder"}[kind]
    if kind == "a pipe with no writer":
        os.mkfifo(path)
    elif kind == "a folder":
        path.mkdir()
    result = train_cli(*TINY, f"data.text={path}", f"data.root={tmp_path / 'data'}", cwd=tmp_path, timeout=60)
    assert_one_line_error(result, "train.py", f"the text {path} is not a regular file")
    result = subprocess.run(sample_command(checkpoint, "--prompt-file", path), env=ENV, capture_output=True,
                            text=True, timeout=60)
    assert_one_line_error(result, "sample.py", f"--prompt-file {path} is not a regular file")


@pytest.mark.parametrize("override", ["train.batch_size=1000000000000", "model.n_embd=10000000",
                                      f"train.batch_size={10**400}"])  # bytes past a float's 1e308
def test_a_training_beyond_memory_is_refused_before_it_starts(tmp_path, data_root, override):
    result = train_cli(*TINY, *data_overrides(data_root), override, cwd=tmp_path)
    assert_one_line_error(result, "train.py", "need at least", "GiB, and the cpu device has", "smaller model or batch")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_a_mistake_is_told_once_and_every_rank_exits_alike(tmp_path, rank):
    env = {**ENV, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, "model.n_head=5"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    if rank == 0:
        assert_one_line_error(result, "train.py", "model: n_embd 32 is not divisible by n_head 5")
    else:
        assert result.stderr == ""
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []


def test_under_torchrun_itself_our_line_comes_first_with_the_cause(tmp_path):
    """torchrun adds its own report of the failed process after ours, and exits 1 (README)."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(REPO / "train.py"), *TINY, "model.n_head=5"], cwd=tmp_path, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.splitlines()[0] == "train.py: error: model: n_embd 32 is not divisible by n_head 5"
    assert result.stderr.count("train.py: error:") == 1  # rank 0's; the other rank is silent
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []
