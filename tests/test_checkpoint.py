"""runtime/checkpoint.py and training/runs.py: atomic writes, safe loads, versions, the newest-checkpoint lookup."""

import os
import stat

import pytest
import torch

from data import CharVocab
from model import GPTConfig, build_model
from runtime.checkpoint import (FORMAT, VERSION, CheckpointError, build_checkpoint, load_checkpoint, load_model,
                                 save_checkpoint)
from runtime.checkpoint import find_latest_checkpoint

STATE = {"format": FORMAT, "version": VERSION, "model_config": {"n_layer": 1}, "vocab": "ab",
         "model": {"w": torch.arange(3.0)}}


def test_round_trip_keeps_the_format_marker_and_version(tmp_path):
    ckpt = load_checkpoint(save_checkpoint(STATE, tmp_path / "best.pt"))
    assert (ckpt["format"], ckpt["version"]) == ("kvgpt-checkpoint", 2) and ckpt["vocab"] == "ab"
    assert torch.equal(ckpt["model"]["w"], STATE["model"]["w"])


def test_build_checkpoint_and_load_model_round_trip(tmp_path):
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=3, block_size=4, n_layer=1, n_head=1, n_embd=4))
    save_checkpoint(build_checkpoint(model, CharVocab("abc")), tmp_path / "best.pt")
    loaded, vocab, _ = load_model(tmp_path, "cpu")  # a run directory means its best.pt
    assert vocab == CharVocab("abc") and loaded.config == model.config and not loaded.training
    for name, weight in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], weight)


DESIGN_FIELDS = ("n_kv_head", "kv_share", "window_pattern", "local_window", "learned_sink", "kv_latent",
                 "kv_latent_rope")


@pytest.mark.parametrize("design", [dict(n_head=2, n_kv_head=1), dict(n_layer=2, kv_share=2),
                                    dict(n_layer=2, window_pattern="LG", local_window=2), dict(learned_sink=True),
                                    dict(kv_latent=4, pos_emb="rope", kv_latent_rope=2)])
def test_a_checkpoint_records_the_cache_design_and_one_written_before_it_loads_as_plain_attention(tmp_path, design):
    torch.manual_seed(0)
    model = build_model(GPTConfig(**{**dict(vocab_size=3, block_size=4, n_layer=1, n_head=2, n_embd=4), **design}))
    contents = build_checkpoint(model, CharVocab("abc"))
    assert {k: contents["model_config"][k] for k in design} == design
    save_checkpoint(contents, tmp_path / "best.pt")
    loaded, _, _ = load_model(tmp_path, "cpu")
    assert loaded.config == model.config
    # a checkpoint from before the fields existed: plain multi-head attention, every layer its own keys and values
    plain = build_model(GPTConfig(vocab_size=3, block_size=4, n_layer=1, n_head=2, n_embd=4))
    old = build_checkpoint(plain, CharVocab("abc"))
    old["model_config"] = {k: v for k, v in old["model_config"].items() if k not in DESIGN_FIELDS}
    save_checkpoint(old, tmp_path / "last.pt")
    loaded, _, _ = load_model(tmp_path / "last.pt", "cpu")
    assert loaded.config == plain.config and loaded.config.plain_attention
    idx = torch.tensor([[0, 1, 2]])
    assert torch.equal(loaded(idx)[0], plain(idx)[0])


@pytest.mark.parametrize("marker", [{"format": "kvgpt-checkpoint-v1"}, {"format": FORMAT, "version": 3}])
def test_another_format_version_is_a_one_line_error_that_says_what_to_do(tmp_path, marker):
    path = save_checkpoint({**STATE, "version": None, **marker}, tmp_path / "old.pt")
    if "version" not in marker:
        contents = torch.load(path, weights_only=True)
        del contents["version"]
        torch.save(contents, path)
    with pytest.raises(CheckpointError, match=r"format version (1|3).*reads version 2; train a new one") as caught:
        load_checkpoint(path)
    assert "\n" not in str(caught.value)


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
    old, new = tmp_path / "runs/2024-01-02_00-00-00/best.pt", tmp_path / "runs/multirun/2024-01-01_00-00-00/0/best.pt"
    for path in (old, new):
        path.parent.mkdir(parents=True)
        save_checkpoint(STATE, path)
    os.utime(old, ns=(1_000_000_000, 1_000_000_000))
    assert find_latest_checkpoint(tmp_path / "runs") == new
    with pytest.raises(CheckpointError, match="python train.py"):
        find_latest_checkpoint(tmp_path / "nothing")
