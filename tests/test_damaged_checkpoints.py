"""Checkpoints that still load but are damaged: resuming from them and sampling from them are refused in one line."""

import subprocess

import pytest
import torch

import train
from test_train import config
from runtime.checkpoint import save_checkpoint
from training.config import ConfigError
from programs import ENV, SHORT, assert_one_line_error, data_root, sample_command, short_run

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow


def damage(contents: dict, how: str) -> dict:
    model, state = contents["model"], contents["training"]
    if how == "a weight missing":
        del model["lm_head.weight"]
    elif how == "a weight of the wrong shape":
        model["wte.weight"] = model["wte.weight"][:, :3]
    elif how == "a weight that is no tensor":
        model["wpe.weight"] = "weights"
    elif how == "an optimizer of other weights":
        state["optimizers"][0]["param_groups"] = state["optimizers"][0]["param_groups"][:1]
    elif how == "optimizer moments of the wrong shape":
        moments = next(iter(state["optimizers"][0]["state"].values()))
        moments["exp_avg"] = moments["exp_avg"].flatten()[:1]
    elif how == "one optimizer too many":
        state["optimizers"].append(state["optimizers"][0])
    elif how == "a scheduler that is no dict":
        state["schedulers"] = [[1, 2]]
    elif how == "best_val_loss of the wrong type":
        state["best_val_loss"] = "low"
    elif how == "rng of the wrong type":
        state["rng"] = {"torch": 1}
    elif how == "a step that is a string":
        state["step"] = "2"
    elif how == "the training state missing a key":
        del state["schedulers"]
    elif how == "the text recorded as a string":
        contents["text"] = "corpus.txt"
    elif how == "character counts one short":
        contents["text"]["char_counts"].pop()
    return contents


@pytest.mark.parametrize("how", ["a weight missing", "a weight of the wrong shape", "a weight that is no tensor",
                                 "an optimizer of other weights", "optimizer moments of the wrong shape",
                                 "one optimizer too many",
                                 "a scheduler that is no dict", "best_val_loss of the wrong type",
                                 "rng of the wrong type", "a step that is a string",
                                 "the training state missing a key", "the text recorded as a string",
                                 "character counts one short"])
def test_a_damaged_checkpoint_that_still_loads_is_refused_in_one_line(tmp_path, data_root, short_run, how):
    path = tmp_path / "damaged.pt"
    save_checkpoint(damage(torch.load(short_run / "last.pt", weights_only=True), how), path)
    with pytest.raises(ConfigError) as caught:
        train.main(config(tmp_path, data_root, *SHORT, f"train.resume={path}"), tmp_path / "runs/resumed")
    message = str(caught.value)
    assert message.startswith(f"train.resume: {path} is damaged (") and "\n" not in message


@pytest.mark.parametrize("how", ["a weight that is no tensor", "best_val_loss of the wrong type",
                                 "a step that is a string", "the training state missing a key",
                                 "the text recorded as a string"])
def test_a_damaged_checkpoint_that_still_loads_is_one_line_for_sample(tmp_path, short_run, how):
    path = tmp_path / "damaged.pt"
    save_checkpoint(damage(torch.load(short_run / "last.pt", weights_only=True), how), path)
    result = subprocess.run(sample_command(path, "--max-new-tokens", "3"), env=ENV, capture_output=True, text=True,
                            timeout=60)
    assert_one_line_error(result, "sample.py", f"{path} is ")
    assert result.stdout == ""
