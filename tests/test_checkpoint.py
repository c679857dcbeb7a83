"""checkpoint.py: atomic writes, safe loads, and the newest-checkpoint lookup."""

import os
import stat

import pytest
import torch

from checkpoint import CheckpointError, find_latest_checkpoint, load_checkpoint, save_checkpoint

STATE = {"model_config": {"n_layer": 1}, "vocab": "ab", "model": {"w": torch.arange(3.0)}}


def test_round_trip_adds_the_format_marker(tmp_path):
    ckpt = load_checkpoint(save_checkpoint(STATE, tmp_path / "best.pt"))
    assert ckpt["format"] == "kvgpt-checkpoint-v1" and ckpt["vocab"] == "ab"
    assert torch.equal(ckpt["model"]["w"], STATE["model"]["w"])


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path):
    path = save_checkpoint(STATE, tmp_path / "last.pt")
    with pytest.raises(Exception):
        save_checkpoint({**STATE, "model": {"w": lambda: None}}, path)  # a lambda cannot be pickled
    assert torch.equal(load_checkpoint(path)["model"]["w"], STATE["model"]["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_the_file_gets_an_ordinary_mode_not_a_private_one(tmp_path):
    old = os.umask(0o022)
    try:
        path = save_checkpoint(STATE, tmp_path / "best.pt")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_run_directory_means_its_best_then_its_last_checkpoint(tmp_path):
    save_checkpoint({**STATE, "vocab": "last"}, tmp_path / "last.pt")
    assert load_checkpoint(tmp_path)["vocab"] == "last"
    save_checkpoint({**STATE, "vocab": "best"}, tmp_path / "best.pt")
    assert load_checkpoint(tmp_path)["vocab"] == "best"


def test_newest_best_checkpoint_is_found_in_runs_and_multiruns(tmp_path):
    old = save_checkpoint(STATE, tmp_path / "runs/2024-01-02_00-00-00/best.pt")
    new = save_checkpoint(STATE, tmp_path / "runs/multirun/2024-01-01_00-00-00/0/best.pt")
    os.utime(old, ns=(1_000_000_000, 1_000_000_000))
    assert find_latest_checkpoint(tmp_path / "runs") == new
    with pytest.raises(CheckpointError, match="python train.py"):
        find_latest_checkpoint(tmp_path / "nothing")
