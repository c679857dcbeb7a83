"""train.py and training/: tiny runs in-process (loss, TensorBoard events, checkpoints, resume, divergence), the presets, the
command line's errors and SIGTERM in a subprocess, and DDP with two gloo processes. They train on tests/corpus.py's
text, so they need neither the network nor the real data set."""

import dataclasses
import hashlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from contextlib import nullcontext
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

import corpus
import train
import training.budget
import training.config
import training.loop
import training.optim
import training.summaries
from data import VAL_FRACTION
from model import GPT, GPTConfig, build_model
from training.budget import EXIT_S, steps_within
from runtime.checkpoint import save_checkpoint
from training.config import OptimConfig, validate
from runtime.devices import training_dtype
from training.evaluation import evaluate
from training.loop import Diverged, Stopped, Trainer
from training.optim import decay_begins
from training.text import prepare_data
from training.attention_maps import LabelledHeads
from training.summaries import hparam_name

REPO = corpus.REPO
TINY = ["preset=cpu", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
        "model.dropout=0.1", "train.batch_size=8", "train.max_iters=40", "train.eval_interval=20",
        "train.eval_iters=4", "train.log_interval=5", "train.sample_tokens=20", "optim.lr=1e-2",
        "optim.warmup_iters=5"]
SCALARS = ["loss/train", "loss/val", "loss/train_eval", "loss/val_best", "optim/lr", "optim/lr_muon",
           "optim/grad_norm", "perf/tokens_per_sec"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """One prepared copy of the corpus for every run of this module."""
    return tmp_path_factory.mktemp("data")


def data_overrides(data_root: Path) -> list[str]:
    """The corpus as a text of one's own, prepared in data_root by the first run that needs it."""
    return [f"data.text={corpus_file(data_root)}", f"data.root={data_root}"]


def corpus_file(data_root: Path) -> Path:
    return corpus.write_corpus(data_root.parent / f"{data_root.name}-source" / "corpus.txt")


def training_counts(path: Path, vocab: str) -> list[int]:
    """How often the training split of the text at path (all but its last VAL_FRACTION) holds each character."""
    text = path.read_text(encoding="utf-8")
    return [text[:int(len(text) * (1 - VAL_FRACTION))].count(char) for char in vocab]


def config(tmp_path: Path, data_root: Path, *overrides: str):
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=[*TINY, *data_overrides(data_root), f"runs_dir={tmp_path / 'runs'}",
                                            *overrides])


def events(run_dir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    accumulator.Reload()
    return accumulator


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in events(run_dir).Scalars(tag)}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, data_root):
    tmp_path = tmp_path_factory.mktemp("tiny")
    run_dir = tmp_path / "runs" / "tiny"
    val_loss = train.main(config(tmp_path, data_root), run_dir)
    return run_dir, val_loss


# --- a tiny run ---------------------------------------------------------------------------------------------------

def test_tiny_run_loss_decreases(tiny_run):
    run_dir, val_loss = tiny_run
    losses = scalars(run_dir, "loss/train")
    assert sorted(losses) == list(range(40))  # every step logged
    assert losses[0] == pytest.approx(math.log(65), abs=0.15)  # uniform over the 65 characters at first
    first = sum(losses[s] for s in range(5)) / 5
    last = sum(losses[s] for s in range(30, 40)) / 10
    assert last < first - 0.4
    val = scalars(run_dir, "loss/val")
    assert sorted(val) == [0, 20, 40] and val[40] < val[20] < math.log(65) - 0.5
    assert val[0] == pytest.approx(math.log(65), abs=0.15)  # evaluated before the first step
    assert val_loss == pytest.approx(val[40])


def test_events_hold_every_tag(tiny_run):
    run_dir, val_loss = tiny_run
    accumulator = events(run_dir)
    tags = accumulator.Tags()
    assert set(SCALARS) <= set(tags["scalars"])
    lrs = scalars(run_dir, "optim/lr")
    assert lrs[0] == pytest.approx(1e-2 / 5) and lrs[4] < lrs[5] == pytest.approx(1e-2) and lrs[39] < 2e-3

    text = accumulator.PluginTagToContent("text")
    assert {"sample/text_summary", "config/text_summary"} <= set(text)
    samples = accumulator.Tensors("sample/text_summary")
    assert [s.step for s in samples] == [0, 20, 40]
    sample = "\n".join(line[4:] for line in samples[-1].tensor_proto.string_val[0].decode().split("\n"))
    prompt = "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n"
    assert sample.startswith(prompt) and len(sample) > len(prompt)  # indented 4: Markdown's verbatim text

    images = accumulator.PluginTagToContent("images")
    assert set(images) == {f"sample/attention/layer{l}" for l in range(2)}
    width, height, png = accumulator.Tensors("sample/attention/layer0")[-1].tensor_proto.string_val
    if training.summaries.MATPLOTLIB:  # the labelled figure (tests/test_tensorboard.py) for two heads on the text
        shape = LabelledHeads(2, prompt[-16:]).frame.shape[:2]
    else:  # the last block_size (16) prompt tokens, 16 pixels a cell, two heads and a bar between them
        shape = (16 * 16, 2 * 16 * 16 + 16)
    assert (int(height), int(width)) == shape and png.startswith(b"\x89PNG")

    hparams = accumulator.PluginTagToContent("hparams")
    session = plugin_data_pb2.HParamsPluginData.FromString(hparams["_hparams_/session_start_info"])
    assert session.session_start_info.hparams[hparam_name("model.n_layer")].string_value == "2"
    assert session.session_start_info.hparams[hparam_name("model.bias")].HasField("bool_value")
    assert session.session_start_info.hparams[hparam_name("device")].string_value == "cpu"  # the device used, not "auto"
    assert scalars(run_dir, "loss/val_best")[40] == pytest.approx(min(scalars(run_dir, "loss/val").values()))
    assert not [tag for tag in tags["scalars"] if tag not in SCALARS]  # no lone hparams metric scalar


def test_checkpoints_load_with_weights_only(tiny_run, data_root):
    run_dir, val_loss = tiny_run
    last = torch.load(run_dir / "last.pt", weights_only=True)
    best = torch.load(run_dir / "best.pt", weights_only=True)
    assert last["training"]["step"] == 40 and best["training"]["step"] in (20, 40)
    assert last["training"]["best_val_loss"] == best["training"]["best_val_loss"] == pytest.approx(min(scalars(run_dir, "loss/val").values()))
    assert last["training"]["config"]["model"]["n_layer"] == 2 and last["training"]["config"]["data"]["text"] == str(corpus_file(data_root))
    assert last["text"] == best["text"] == {"source": str(corpus_file(data_root)), "sha256": corpus.SHA256,
                                            "char_counts": training_counts(corpus_file(data_root), last["vocab"])}
    assert set(last["training"]["rng"][0]) == {"torch", "batches"}
    model = build_model(GPTConfig(**last["model_config"]))
    model.load_state_dict(last["model"])  # strict: same keys, no wrapper prefixes
    decayed, not_decayed = last["training"]["optimizers"][0]["param_groups"]  # weight decay on matrices and embeddings only
    assert (decayed["weight_decay"], not_decayed["weight_decay"]) == (0.1, 0.0)
    assert len(not_decayed["params"]) == sum(p.dim() == 1 for p in model.parameters()) == 2 * 2 + 1  # LayerNorms
    assert len(last["vocab"]) == model.config.vocab_size == 65
    assert [p.name for p in run_dir.parent.iterdir()] == [run_dir.name]  # no `latest` link: TensorBoard would show it


# --- resume -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [["optim=adamw"], ["optim=muon"], ["optim=adamw", "train.ema_decay=0.9"]],
                         ids=["adamw", "muon", "adamw-ema"])
def test_resume_equals_uninterrupted_run(tmp_path, data_root, monkeypatch, extra):
    overrides = ["train.max_iters=30", "train.eval_interval=10", "train.grad_accum_steps=2", *extra]
    uninterrupted = tmp_path / "runs/uninterrupted"
    train.main(config(tmp_path, data_root, *overrides), uninterrupted)

    # SIGTERM in the middle of step 13 (0-based, 2 micro-steps each); the run stops after that step
    forward, calls = GPT.forward, []

    def forward_then_sigterm(model, *args, **kwargs):
        calls.append(model.training)
        if calls.count(True) == 13 * 2 + 1:
            signal.raise_signal(signal.SIGTERM)
        return forward(model, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", forward_then_sigterm)
    interrupted = tmp_path / "runs/interrupted"
    with pytest.raises(Stopped, match=f"stopped by SIGTERM at step 14: saved {interrupted}/last.pt"):
        train.main(config(tmp_path, data_root, *overrides), interrupted)
    monkeypatch.undo()
    assert torch.load(interrupted / "last.pt", weights_only=True)["training"]["step"] == 14

    resumed = tmp_path / "runs/resumed"
    train.main(config(tmp_path, data_root, *overrides, f"train.resume={interrupted}"), resumed)
    expected, got = scalars(uninterrupted, "loss/train"), scalars(resumed, "loss/train")
    assert sorted(got) == list(range(14, 30))
    assert [got[s] for s in got] == pytest.approx([expected[s] for s in got], rel=1e-5)
    assert scalars(resumed, "optim/lr") == pytest.approx({s: scalars(uninterrupted, "optim/lr")[s] for s in got})
    resumed_val = scalars(resumed, "loss/val")
    assert sorted(resumed_val) == [20, 30]  # evaluated where the uninterrupted run is, and nowhere else
    assert resumed_val == pytest.approx({s: scalars(uninterrupted, "loss/val")[s] for s in (20, 30)}, rel=1e-5)
    assert 0 in scalars(uninterrupted, "loss/val")
    a = torch.load(uninterrupted / "last.pt", weights_only=True)
    b = torch.load(resumed / "last.pt", weights_only=True)
    assert a["training"]["step"] == b["training"]["step"] == 30
    for name, weight in a["model"].items():
        torch.testing.assert_close(b["model"][name], weight, rtol=1e-5, atol=1e-6)


def test_a_resumed_run_picks_the_best_pt_of_the_uninterrupted_run_and_draws_its_curves(tmp_path, data_root,
                                                                                          monkeypatch):
    """The val losses are scripted by step so that the one at the step where the run stops (14, between
    evaluations every 10 steps) is the lowest: a resumed run that evaluated there would keep step 10's best.pt
    while the uninterrupted run's is step 20's."""
    scripted = {0: 4.0, 10: 3.0, 14: 1.0, 20: 2.0, 30: 2.5}
    evaluate, at = training.loop.evaluate, {}

    def scripted_evaluate(*args, **kwargs):
        return {**evaluate(*args, **kwargs), "val": scripted[at["step"]]}

    def step_then_note(trainer):
        train_step(trainer)
        at["step"] = trainer.step

    train_step = Trainer.train_step
    monkeypatch.setattr(training.loop, "evaluate", scripted_evaluate)
    monkeypatch.setattr(Trainer, "train_step", step_then_note)
    overrides = ["train.max_iters=30", "train.eval_interval=10"]
    uninterrupted = tmp_path / "runs/uninterrupted"
    at["step"] = 0
    train.main(config(tmp_path, data_root, *overrides), uninterrupted)

    def sigterm_at_14(trainer):
        step_then_note(trainer)
        if trainer.step == 14:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(Trainer, "train_step", sigterm_at_14)
    run_dir = tmp_path / "runs/stopped"
    at["step"] = 0
    with pytest.raises(Stopped):
        train.main(config(tmp_path, data_root, *overrides), run_dir)
    monkeypatch.setattr(Trainer, "train_step", step_then_note)
    at["step"] = 14
    train.main(config(tmp_path, data_root, *overrides, f"train.resume={run_dir}"), run_dir)  # in place

    for name in ("best.pt", "last.pt"):
        ours, theirs = (torch.load(d / name, weights_only=True)["training"] for d in (run_dir, uninterrupted))
        assert (ours["step"], ours["best_val_loss"]) == (theirs["step"], theirs["best_val_loss"]), name
    assert torch.load(run_dir / "best.pt", weights_only=True)["training"]["step"] == 20
    for tag in ("loss/val", "loss/val_best"):
        assert scalars(run_dir, tag) == scalars(uninterrupted, tag), tag
    assert scalars(run_dir, "loss/val_best") == {10: 3.0, 20: 2.0, 30: 2.0}  # best.pt's, which step 0 is not


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(tmp_path, data_root):
    run_dir = tmp_path / "runs/muon"
    train.main(config(tmp_path, data_root, "optim=muon", "train.max_iters=3", "train.eval_interval=3",
                      "optim.warmup_iters=2", "optim.min_lr=1e-3"), run_dir)
    last = torch.load(run_dir / "last.pt", weights_only=True)
    adamw, muon = last["training"]["optimizers"]
    model = build_model(GPTConfig(**last["model_config"]))
    names = [name for name, _ in model.named_parameters()]
    hidden = [n for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    assert len(hidden) == 2 * 4  # qkv, out_proj, fc, proj in each of 2 layers
    assert len(muon["param_groups"][0]["params"]) == len(hidden) and "momentum_buffer" in muon["state"][0]
    assert sum(len(g["params"]) for g in adamw["param_groups"]) == len(names) - len(hidden)
    adamw_lr, muon_lr = (s["_last_lr"][0] for s in last["training"]["schedulers"])
    assert muon_lr / adamw_lr == pytest.approx(0.02 / 1e-2) and adamw_lr < 1e-2  # one schedule, two peaks


def newton_schulz_float64(g, steps=5, a=3.4445, b=-4.7750, c=2.0315):
    """Muon's quintic iteration X <- a X + (b A + c A^2) X with A = X X^T, written out here in float64."""
    x = g.double().T if g.size(0) > g.size(1) else g.double()
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.size(0) > g.size(1) else x


@pytest.mark.parametrize("shape", [(48, 16), (16, 64), (32, 32)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_muon_orthogonalizes_in_float32_and_follows_torchs_muon(shape):
    """The iteration equals the formula in float64 to float32 precision; five steps of the optimiser agree with
    torch.optim.Muon's (which iterates in bfloat16) to within bfloat16's rounding."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(training.optim.orthogonalize(g, (3.4445, -4.7750, 2.0315), 5, 1e-7),
                               newton_schulz_float64(g).float(), atol=1e-5, rtol=1e-4)
    start = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours, torchs = (start.clone().requires_grad_() for _ in range(2))
    optimizers = [training.optim.Muon([ours], lr=0.02, weight_decay=0.1),
                  torch.optim.Muon([torchs], lr=0.02, weight_decay=0.1, adjust_lr_fn="original")]
    for step in range(5):
        ours.grad = torchs.grad = torch.randn(shape, generator=torch.Generator().manual_seed(10 + step))
        for optimizer in optimizers:
            optimizer.step()
    ours_moved, torchs_moved = (ours - start).detach(), (torchs - start).detach()
    assert ((ours_moved - torchs_moved).norm() / torchs_moved.norm()).item() < 0.01
    assert optimizers[0].state_dict()["state"][0].keys() == optimizers[1].state_dict()["state"][0].keys()


def test_muon_settings_are_refused_without_muon(tmp_path, data_root):
    with pytest.raises(train.ConfigError, match="muon_lr applies to optim=muon only"):
        train.main(config(tmp_path, data_root, "optim=adamw", "optim.muon_lr=0.05"), tmp_path / "runs/refused")


# --- a moving average of the weights -----------------------------------------------------------------------------

EMA = ["train.ema_decay=0.9", "train.max_iters=10", "train.eval_interval=5"]


def autocast_of(settings):
    """What a run with these settings evaluated under on this CPU: bf16 autocast where train.precision chose it."""
    bf16 = training_dtype(settings.train.precision, torch.device("cpu")) == torch.bfloat16
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory, data_root) -> Path:
    tmp_path = tmp_path_factory.mktemp("ema")
    run_dir = tmp_path / "runs/ema"
    train.main(config(tmp_path, data_root, *EMA), run_dir)
    return run_dir


def test_the_moving_average_starts_at_the_initial_weights_and_follows_each_step(tmp_path, data_root):
    decay = 0.8
    settings = validate(config(tmp_path, data_root, f"train.ema_decay={decay}"))
    data = prepare_data(settings)
    model = build_model(dataclasses.replace(settings.model, vocab_size=len(data.vocab)))
    trainer = Trainer(settings, model, data, torch.device("cpu"), tmp_path, summaries=None)
    expected = {name: weight.clone() for name, weight in model.state_dict().items()}
    for _ in range(5):
        trainer.train_step()
        for name, weight in model.state_dict().items():
            expected[name] = decay * expected[name] + (1 - decay) * weight
    average, trained = trainer.eval_model.state_dict(), model.state_dict()
    assert average.keys() == expected.keys()
    for name, weight in expected.items():
        torch.testing.assert_close(average[name], weight, msg=name)
    assert max((average[name] - trained[name]).abs().max() for name in trained) > 1e-3  # no copy of the weights


def test_evaluations_see_the_moving_average_and_best_pt_holds_it(tmp_path, data_root, ema_run):
    best = torch.load(ema_run / "best.pt", weights_only=True)
    settings = validate(config(tmp_path, data_root, *EMA))
    tc, data = settings.train, prepare_data(settings)

    def val_loss(weights: dict) -> float:
        model = build_model(GPTConfig(**best["model_config"]))
        model.load_state_dict(weights)
        return evaluate(model, data, model.config.block_size, tc.batch_size, tc.eval_iters, tc.seed,
                        torch.device("cpu"), autocast_of(settings), world_size=1)["val"]

    logged = scalars(ema_run, "loss/val")[best["training"]["step"]]
    assert val_loss(best["model"]) == pytest.approx(logged, rel=1e-6)
    assert abs(val_loss(best["training"]["raw_model"]) - logged) > 1e-3  # the weights trained score otherwise


def test_a_resume_keeps_the_moving_average_of_the_run_it_continues(tmp_path, data_root, tiny_run, ema_run):
    def resume(path, *overrides):
        train.main(config(tmp_path, data_root, *overrides, f"train.resume={path}"), tmp_path / "runs/resumed")

    with pytest.raises(train.ConfigError, match=r"add them to the command: train.ema_decay=0.9$"):
        resume(ema_run, *EMA, "train.ema_decay=0.95")
    with pytest.raises(train.ConfigError, match=r"add them to the command: train.ema_decay=null$"):
        resume(tiny_run[0], "train.ema_decay=0.9")
    older = torch.load(tiny_run[0] / "last.pt", weights_only=True)  # saved before train.ema_decay existed
    del older["training"]["config"]["train"]["ema_decay"]
    older["training"]["step"] = 20
    save_checkpoint(older, tmp_path / "older.pt")
    with pytest.raises(train.ConfigError, match=r"add them to the command: train.ema_decay=null$"):
        resume(tmp_path / "older.pt", "train.ema_decay=0.9")
    damaged = torch.load(ema_run / "last.pt", weights_only=True)
    del damaged["training"]["raw_model"]
    damaged["training"]["step"] = 5
    save_checkpoint(damaged, tmp_path / "damaged.pt")
    with pytest.raises(train.ConfigError, match=rf"^train.resume: {tmp_path / 'damaged.pt'} is damaged \("):
        resume(tmp_path / "damaged.pt", *EMA)


# --- a time budget, and extending a run ---------------------------------------------------------------------------

BUDGET = ["train.max_iters=null", "train.max_minutes=0.1"]  # 6 seconds, start-up included
ROOMY_MINUTES = 0.3
ROOMY_BUDGET = ["train.max_iters=null", f"train.max_minutes={ROOMY_MINUTES}"]  # for steps that sleep
HOLD = ["optim.decay_frac=0.5"]  # the rate holds at its peak for half the run: the length is fixed halfway
# Tests that check a budget's plan aim at half of it, so that a noisy machine never ends the run at its budget
# before the plan's last step (see the test of a run whose steps slow down)
AIM_AT_HALF = 0.5


def chosen_steps(printed: str, minutes: float = 0.1) -> int:
    (steps, _), = re.findall(rf"^train.max_minutes={minutes:g} fits (\d+) steps \(.*\); to repeat this run exactly, give "
                             r"train.max_iters=\1 (model.n_layer=2 train.batch_size=8 )?train.threads=1 in place of "
                             r"train.max_minutes$",
                             printed, flags=re.MULTILINE)
    return int(steps)


@pytest.fixture(scope="module")
def budget_run(tmp_path_factory, data_root) -> tuple[Path, int]:
    """A run sized by an 18 s budget: its directory and the steps it chose. Each step sleeps 50 ms more, so that a
    core that the other tests' worker slows twice over slows a step by half, within the half budget the plan keeps;
    the budget leaves a busy start-up room for more than the warm-up's steps."""
    tmp_path = tmp_path_factory.mktemp("budget")
    with pytest.MonkeyPatch.context() as patch:
        printed = []
        patch.setattr(training.loop, "write_line", printed.append)
        patch.setattr(training.budget, "MARGIN", AIM_AT_HALF)
        step = Trainer.train_step
        patch.setattr(Trainer, "train_step", lambda trainer: time.sleep(0.05) or step(trainer))
        train.main(config(tmp_path, data_root, *ROOMY_BUDGET, *HOLD), tmp_path / "runs/budget")
    return tmp_path / "runs/budget", chosen_steps("\n".join(printed), ROOMY_MINUTES)


def test_a_budget_records_the_steps_it_chose(budget_run):
    run_dir, steps = budget_run
    last = torch.load(run_dir / "last.pt", weights_only=True)["training"]
    assert last["step"] == steps > 5  # past the warm-up
    assert (last["config"]["train"]["max_iters"], last["config"]["train"]["max_minutes"]) == (steps, ROOMY_MINUTES)
    assert sorted(scalars(run_dir, "loss/train")) == list(range(steps))
    lrs = scalars(run_dir, "optim/lr")  # the warm-up, the peak held until the decay's half of the run, the decay
    begins = decay_begins(OptimConfig(warmup_iters=5, decay_frac=0.5), steps)
    assert begins in (steps // 2, steps // 2 + 1)
    assert [lrs[step] for step in range(5, begins + 1)] == [pytest.approx(1e-2)] * (begins - 4)
    assert lrs[begins + 1] < lrs[begins]
    session = plugin_data_pb2.HParamsPluginData.FromString(
        events(run_dir).PluginTagToContent("hparams")["_hparams_/session_start_info"])
    assert session.session_start_info.hparams[hparam_name("train.max_iters")].string_value == str(steps)


def test_the_steps_a_budget_chose_repeat_its_run_exactly(tmp_path, data_root, budget_run):
    run_dir, steps = budget_run
    train.main(config(tmp_path, data_root, *HOLD, f"train.max_iters={steps}"), tmp_path / "runs/steps")
    assert scalars(tmp_path / "runs/steps", "loss/train") == scalars(run_dir, "loss/train")
    budget, planned = (torch.load(d / "last.pt", weights_only=True) for d in (run_dir, tmp_path / "runs/steps"))
    for name, weight in budget["model"].items():
        assert torch.equal(planned["model"][name], weight), name
    moments = [state for o in (budget, planned) for state in o["training"]["optimizers"][0]["state"].values()]
    assert all(torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in zip(moments[:len(moments) // 2],
                                                                         moments[len(moments) // 2:]))


def test_a_budget_too_short_for_the_warm_up_is_one_line(tmp_path, data_root):
    with pytest.raises(train.ConfigError, match=r"^train.max_minutes=0.1 leaves time for \d+ steps here \(.* s "
                                                r"since the start, .*\), no more than optim.warmup_iters=100000; give a "
                                                r"longer budget$"):
        train.main(config(tmp_path, data_root, "train.max_iters=null", "train.max_minutes=0.1",
                          "optim.warmup_iters=100000"), tmp_path / "r")


@pytest.mark.parametrize("step", [0, 3, 20, 199])
@pytest.mark.parametrize("seconds, step_s, evaluation_s, eval_interval", [
    (10.0, 0.1, 1.0, 20), (10.0, 0.1, 0.5, 7), (3.05, 0.1, 1.0, 20), (0.5, 0.1, 1.0, 5), (100.0, 0.25, 3.0, 200),
    (2.95, 0.1, 0.95, 10), (-1.0, 0.1, 1.0, 5)])
def test_the_steps_within_a_budget_are_the_most_that_fit_with_their_evaluations(seconds, step_s, evaluation_s,
                                                                                eval_interval, step):
    def cost(n):  # n steps after `step`, and an evaluation after each one at a multiple of eval_interval and the last
        evaluated = {s for s in range(step + 1, step + n + 1) if s % eval_interval == 0} | ({step + n} if n else set())
        return n * step_s + len(evaluated) * evaluation_s

    most = max(n for n in range(2_000) if cost(n) <= max(seconds, 0) + 1e-9)
    assert steps_within(seconds, step_s, evaluation_s, eval_interval, step) == most


@pytest.mark.parametrize("budget_s", [6, 60, 66.7, 67, 300])
def test_a_plan_ends_where_the_early_end_would_not(budget_s):
    """The plan aims MARGIN below the budget, and never into the EXIT_S that the early end keeps free: a short
    budget's plan is never cut short by the early end's own rule."""
    margin = training.budget.MARGIN
    assert training.budget.planned_seconds(budget_s) == pytest.approx(min(budget_s * (1 - margin), budget_s - EXIT_S))


def test_the_budget_counts_from_the_start_of_the_process():
    """The interpreter's start-up and the imports before training count: a process that waited a second has
    spent at least that much, to within what /proc resolves (a clock tick of its start, 10 ms of the uptime)."""
    code = ("import time; time.sleep(1); from training.budget import process_started; "
            "print(time.perf_counter() - process_started())")
    spent = float(subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                                 check=True, timeout=60).stdout)
    resolution = 1 / os.sysconf("SC_CLK_TCK") + 0.01
    assert 1.0 - resolution <= spent < 60


def sigterm_at(patch, step: int) -> None:
    """SIGTERM during the step-th training step: the run stops after it, its last.pt at that step."""
    forward, calls = GPT.forward, []

    def forward_then_sigterm(model, *args, **kwargs):
        calls.append(model.training)
        if calls.count(True) == step:
            signal.raise_signal(signal.SIGTERM)
        return forward(model, *args, **kwargs)

    patch.setattr(GPT, "forward", forward_then_sigterm)


def stopped_at(tmp_path: Path, data_root: Path, step: int, overrides: list[str], run_dir: Path, named=None):
    """Run until SIGTERM stops it after `step` steps (its last.pt holds that step)."""
    with pytest.MonkeyPatch.context() as patch:
        sigterm_at(patch, step)
        with pytest.raises(Stopped):
            train.main(config(tmp_path, data_root, *overrides), run_dir, named)


def test_a_resumed_budget_run_keeps_its_steps(tmp_path, data_root, monkeypatch):
    """Aimed at half its budget, the plan leaves the resumed life's start-up room: it is not planned again. The
    budget is 18 s, so that a busy machine's start-up, a few seconds, still fits in the half left spare. Each step
    sleeps 50 ms more: a core that the other tests' worker slows twice over then slows a step by half, not twice."""
    monkeypatch.setattr(training.budget, "MARGIN", AIM_AT_HALF)
    step = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda trainer: time.sleep(0.05) or step(trainer))
    run_dir = tmp_path / "runs/stopped"
    roomy = ["train.max_iters=null", "train.max_minutes=0.3", "optim.decay_frac=1"]
    stopped_at(tmp_path, data_root, 14, roomy, run_dir)  # fixed at the warm-up's end
    planned = torch.load(run_dir / "last.pt", weights_only=True)["training"]["config"]["train"]["max_iters"]
    assert planned > 14
    printed = []
    monkeypatch.setattr(training.loop, "write_line", printed.append)
    train.main(config(tmp_path, data_root, *roomy, f"train.resume={run_dir}"), run_dir)
    assert not [line for line in printed if "fits" in line or "plans the run again" in line]  # sized once
    assert torch.load(run_dir / "last.pt", weights_only=True)["training"]["step"] == planned
    with pytest.raises(train.ConfigError, match=rf"^train.resume: a resumed run keeps the {planned} steps it was "
                                                rf"planned for, sized by train.max_minutes=0.3; the run has ended "
                                                rf"at step {planned}: give train.max_iters=N \(N above {planned}\) "
                                                rf"in place of train.max_minutes to train it on$"):
        train.main(config(tmp_path, data_root, "train.max_iters=null", "train.max_minutes=1", "optim.decay_frac=1",
                          f"train.resume={run_dir}"), run_dir)


@pytest.mark.parametrize("left_s, due, ends", [(EXIT_S / 2, False, True), (EXIT_S + 0.5, False, False),
                                                (EXIT_S + 0.4, True, True), (EXIT_S + 0.6, True, False)],
                         ids=["less than the exit's reserve", "more", "less, after this step's own evaluation",
                              "more, after this step's own evaluation"])
def test_a_slowed_run_ends_early_enough_for_the_process_to_exit(tmp_path, data_root, monkeypatch, left_s, due,
                                                                ends):
    """A planned run ends when one more step and the final evaluation would leave less than EXIT_S of the
    budget (0.1 min) for the process to exit: steps of 0.1 s, evaluations of 0.5 s, left_s to spare after both.
    A step that evaluates anyway (due) must leave room for that evaluation too. Its plan then ends there."""
    settings = validate(config(tmp_path, data_root, *BUDGET, *HOLD))
    data = prepare_data(settings)
    trainer = Trainer(settings, build_model(dataclasses.replace(settings.model, vocab_size=len(data.vocab))), data,
                      torch.device("cpu"), tmp_path, summaries=None)
    monkeypatch.setattr(training.loop, "write_line", lambda line: None)
    trainer.summaries = SimpleNamespace(plan=lambda step, steps: None)
    trainer.settings = trainer.settings.planned(40, 0.1)
    trainer.tc, trainer.schedule = trainer.settings.train, training.optim.Schedule(trainer.settings.optim, 40)
    now = time.perf_counter()
    trainer.step, trainer.budget.planned_step_s = 10, 0.1
    trainer.budget.recent = deque([(0, now - 1.0)])  # 10 steps in the last second
    trainer.budget.since = (10, now)  # no step since: no new plan is measured
    trainer.budget.evaluations = [(now - 2.0, 0.5)]  # the latest evaluation, before those steps
    trainer.budget.started_at = now + 0.1 + 0.5 + left_s - 6.0  # the budget ends left_s after a step and evaluation
    trainer.keep_to_budget(due)
    assert trainer.tc.max_iters == (10 if ends else 40)


@pytest.mark.parametrize("command", ["with its budget", "train.resume alone"])
def test_a_budget_run_stopped_before_its_length_was_fixed_resumes_and_fixes_it(tmp_path, data_root, monkeypatch,
                                                                               command):
    """Resumed with its own budget on the command, or with train.resume alone (the preset's budget differs and is
    not named), the run goes on with the budget it was given."""
    run_dir = tmp_path / "runs/open"
    stopped_at(tmp_path, data_root, 3, [*BUDGET, *HOLD], run_dir)
    stopped = torch.load(run_dir / "last.pt", weights_only=True)["training"]
    assert stopped["config"]["train"]["max_iters"] is None and stopped["seconds"] > 0
    printed = []
    monkeypatch.setattr(training.loop, "write_line", printed.append)
    monkeypatch.setattr(training.budget, "MARGIN", AIM_AT_HALF)
    if command == "with its budget":
        train.main(config(tmp_path, data_root, *BUDGET, *HOLD, f"train.resume={run_dir}"), run_dir)
    else:
        train.main(config(tmp_path, data_root, *HOLD, f"train.resume={run_dir}"), run_dir, named={"train.resume"})
        assert "train.max_minutes=0.1 fits" in "\n".join(printed)
    steps = chosen_steps("\n".join(printed))
    last = torch.load(run_dir / "last.pt", weights_only=True)["training"]
    assert last["step"] == last["config"]["train"]["max_iters"] == steps > 3
    assert sorted(scalars(run_dir, "loss/train")) == list(range(steps))  # one curve


def test_a_resumed_budget_counts_the_time_its_run_spent_before(tmp_path, data_root):
    """An earlier life that spent 1,000 s leaves nothing of a 6 s budget."""
    run_dir = tmp_path / "runs/open"
    stopped_at(tmp_path, data_root, 3, [*BUDGET, *HOLD], run_dir)
    contents = torch.load(run_dir / "last.pt", weights_only=True)
    contents["training"]["seconds"] = 1000.0
    save_checkpoint(contents, run_dir / "last.pt")
    with pytest.raises(train.ConfigError, match=r"^train.max_minutes=0.1 \(6 s\) cannot hold this run: 100\d\.\d s are "
                                                r"spent already, .*train.max_iters=N \(N above 3\) in place of "
                                                r"train.max_minutes$"):
        train.main(config(tmp_path, data_root, *BUDGET, *HOLD, f"train.resume={run_dir}"), run_dir)


def test_a_resume_naming_no_length_keeps_the_runs_plan(tmp_path, data_root):
    """What the command line leaves unnamed, the preset's steps (here 40), gives way to the checkpoint's."""
    run_dir = tmp_path / "runs/stopped"
    stopped_at(tmp_path, data_root, 7, ["train.max_iters=30"], run_dir)
    train.main(config(tmp_path, data_root, f"train.resume={run_dir}"), run_dir, named={"train.resume"})
    last = torch.load(run_dir / "last.pt", weights_only=True)["training"]
    assert last["step"] == last["config"]["train"]["max_iters"] == 30


@pytest.mark.parametrize("optim, decay, warmup", [("adamw", "cosine", 5), ("muon", "linear", 5), ("adamw", "cosine", 0),
                                                  ("muon", "linear", 0)])
def test_an_extended_run_follows_the_longer_plan_from_where_it_resumed(tmp_path, data_root, optim, decay, warmup):
    run_dir, fresh = tmp_path / "runs/extended", tmp_path / "runs/fresh"
    overrides = [f"optim={optim}", f"optim.decay={decay}", f"optim.warmup_iters={warmup}", "optim.min_lr=1e-3",
                 "train.eval_interval=10"]
    train.main(config(tmp_path, data_root, *overrides, "train.max_iters=20"), run_dir)
    train.main(config(tmp_path, data_root, *overrides, "train.max_iters=35", f"train.resume={run_dir}"), run_dir)
    train.main(config(tmp_path, data_root, *overrides, "train.max_iters=35"), fresh)
    extended, planned = scalars(run_dir, "optim/lr"), scalars(fresh, "optim/lr")
    assert sorted(extended) == list(range(35))  # one curve
    assert {s: extended[s] for s in range(20, 35)} == {s: planned[s] for s in range(20, 35)}  # float32 as logged
    assert extended[19] != planned[19]  # the shorter plan decayed sooner
    last = torch.load(run_dir / "last.pt", weights_only=True)["training"]
    assert last["step"] == last["config"]["train"]["max_iters"] == 35
    lrs = [group["lr"] for o in last["optimizers"] for group in o["param_groups"]]
    assert lrs == [group["lr"] for o in torch.load(fresh / "last.pt", weights_only=True)["training"]["optimizers"]
                   for group in o["param_groups"]]


@pytest.mark.parametrize("steps, message", [
    (12, "train.max_iters=12 is below step 20, which the run in {run_dir} has reached; give a larger train.max_iters "
         "to extend it"),
    (20, "train.resume: the checkpoint is at step 20, the end of its schedule (train.max_iters=20); there is nothing "
         "left to train; give a larger train.max_iters to extend it")])
def test_a_resume_to_a_step_already_reached_is_one_line(tmp_path, data_root, steps, message):
    run_dir = tmp_path / "runs/done"
    train.main(config(tmp_path, data_root, "train.max_iters=20", "train.eval_interval=10"), run_dir)
    with pytest.raises(train.ConfigError) as caught:
        train.main(config(tmp_path, data_root, f"train.max_iters={steps}", f"train.resume={run_dir}"), run_dir)
    assert str(caught.value) == message.format(run_dir=run_dir)


# --- divergence ---------------------------------------------------------------------------------------------------

def test_nonfinite_loss_stops_with_message(tmp_path, data_root, monkeypatch):
    forward, training_calls = GPT.forward, []

    def forward_nan_from_step_25(model, *args, **kwargs):
        logits, loss = forward(model, *args, **kwargs)
        if model.training:
            training_calls.append(None)
            if len(training_calls) > 25:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward_nan_from_step_25)
    run_dir = tmp_path / "runs/nan"
    with pytest.raises(Diverged) as caught:
        train.main(config(tmp_path, data_root), run_dir)
    message = str(caught.value)
    assert "non-finite training loss nan" in message and "at step 25;" in message
    assert f"the last good checkpoint is {run_dir}/last.pt" in message and "\n" not in message
    last = torch.load(run_dir / "last.pt", weights_only=True)
    assert last["training"]["step"] == 20  # the evaluation before the NaN, never overwritten with NaN weights
    assert all(torch.isfinite(w).all() for w in last["model"].values())


# --- presets and the command line ---------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(p.stem for p in (REPO / "conf/preset").glob("*.yaml")))
def test_every_preset_composes(preset):
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"preset={preset}"], return_hydra_config=True)
    assert cfg.hydra.job.chdir is False
    dirs = {mode: OmegaConf.to_container(cfg.hydra[mode], resolve=False)["dir"] for mode in ("run", "sweep")}
    assert dirs == {"run": "???", "sweep": "${runs_dir}/multirun/${now:%Y-%m-%d_%H-%M-%S}"}  # ???: training/runs.py's
    assert cfg.data.text is None and cfg.data.root == "datasets" and cfg.train.resume is None
    model_config = validate(cfg).model  # a preset is a config that can work
    if preset == "gpu":  # nanoGPT's shakespeare-char recipe
        assert (model_config.n_layer, model_config.n_head, model_config.n_embd, model_config.block_size,
                model_config.dropout) == (6, 6, 384, 256, 0.2)
        assert (cfg.train.batch_size, cfg.train.max_iters, cfg.train.eval_interval, cfg.train.eval_iters) == \
               (64, 5000, 250, 200)
        assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_iters, cfg.optim.beta2) == (1e-3, 1e-4, 100, 0.99)


@pytest.mark.parametrize("found, overrides, preset, why", [
    ("cpu", [], "cpu", "picked for the cpu found"), ("cuda", [], "gpu", "picked for the cuda found"),
    ("mps", [], "gpu", "picked for the mps found"), ("cuda", ["preset=cpu"], "cpu", "as named")])
def test_preset_is_picked_from_the_device(monkeypatch, found, overrides, preset, why):
    for module in (training.config, train):
        monkeypatch.setattr(module, "choose_device", lambda name: torch.device(found if name == "auto" else name))
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    assert cfg.hydra.runtime.choices.preset == preset
    assert (cfg.train.max_iters, cfg.train.max_minutes) == ((None, 5) if preset == "cpu" else (5000, None))
    assert train.preset_picked(cfg.hydra) == f"preset {preset}, {why}"  # what the first line says


def train_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("override, message", [
    ("model.n_layr=3", "model.n_layr is not a setting; did you mean model.n_layer?"),
    ("model.n_head=5", "model: n_embd 32 is not divisible by n_head 5"),
    ("train.resume=runs/nowhere", "train.resume: no checkpoint at runs/nowhere"),
    ("data.url=file:///my.txt", "data.url is not a setting; python train.py --cfg job lists them"),
    ("model=huge", "model=huge is not an option; choose one of classic, small"),
    ("optim=sgd", "optim=sgd is not an option; choose one of adamw, muon"),
    ("preset=tpu", "preset=tpu is not an option; choose one of cpu, gpu"),
    ("+devise=cpu", "devise is not a setting; did you mean device?"),
    ("train.ema_decay=1", "train.ema_decay must be in (0, 1), or null for no average, got 1.0"),
])
def test_bad_override_fails_fast(tmp_path, override, message):
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, override], cwd=tmp_path,
                            env=train_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith(f"train.py: error: {message}") and result.stderr.count("\n") == 1
    # before any work: no data prepared, no run directory left behind
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.name != "runs"] == []


OWN_TEXT = "Le café est très bon, dit-elle.\nNaïve, il rit : déjà vu !\n" * 60  # no 'J', unlike the default prompt


def test_own_text_trains_in_a_folder_of_its_own_and_is_recorded(tmp_path):
    shakespeare = corpus.write_corpus(tmp_path / "datasets/tiny_shakespeare/input.txt")  # present, and not used
    (tmp_path / "notes.txt").write_text(OWN_TEXT, encoding="utf-8")
    command = [sys.executable, str(REPO / "train.py"), *TINY, "train.max_iters=4", "train.eval_interval=2",
               "train.eval_iters=1", "optim.warmup_iters=1", "data.text=notes.txt"]
    refused = subprocess.run([*command, "train.sample_prompt=Romeo"], cwd=tmp_path, env=train_env(),
                             capture_output=True, text=True, timeout=120)  # a prompt named: the user's own
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("train.py: error: train.sample_prompt has characters not in the vocabulary of "
                                     "notes.txt ('R', 'm'); set train.sample_prompt='...' to text made of its")
    result = subprocess.run(command, cwd=tmp_path, env=train_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert ("train.sample_prompt: the default line of Romeo and Juliet has characters not in notes.txt ('?', 'E', "
            "'I', 'J', 'O', 'R', 'T', 'U', 'h', 'm', 'w'); each evaluation samples after the text's first line instead: "
            "'Le café est très bon, dit-elle.\\n'") in result.stdout.splitlines()
    sha256 = hashlib.sha256(OWN_TEXT.encode("utf-8")).hexdigest()
    assert sorted(p.name for p in (tmp_path / f"datasets/notes-{sha256[:12]}").iterdir()) == \
        ["meta.json", "train.bin", "val.bin"]
    assert [p.name for p in shakespeare.parent.iterdir()] == ["input.txt"]
    last = torch.load(next((tmp_path / "runs").glob("*/last.pt")), weights_only=True)
    assert last["training"]["config"]["train"]["sample_prompt"] == "Le café est très bon, dit-elle.\n"  # recorded
    assert last["vocab"] == "".join(sorted(set(OWN_TEXT)))
    assert last["text"] == {"source": "notes.txt", "sha256": sha256,
                            "char_counts": training_counts(tmp_path / "notes.txt", last["vocab"])}
    sampled = subprocess.run([sys.executable, str(REPO / "sample.py"), "--prompt", "Le", "--max-new-tokens", "5"],
                             cwd=tmp_path, env=train_env(), capture_output=True, text=True, timeout=120)
    best = next((tmp_path / "runs").glob("*/best.pt"))
    step, loss = (torch.load(best, weights_only=True)["training"][key] for key in ("step", "best_val_loss"))
    assert sampled.returncode == 0 and sampled.stdout.startswith("Le")
    assert sampled.stderr.splitlines()[0] == f"sampling {best.relative_to(tmp_path)} (step {step}, best val loss " \
        f"{loss:.4f}), trained on notes.txt (sha256 {sha256[:12]})"


def test_a_checkpoint_saved_before_its_first_evaluation_is_sampled_as_not_yet_evaluated(tmp_path, data_root):
    """A run stopped before its first evaluation after step 0 holds no best val loss yet (best.pt does not exist)."""
    run_dir = tmp_path / "runs/early"
    stopped_at(tmp_path, data_root, 3, ["train.max_iters=20", "train.eval_interval=10"], run_dir)
    assert sorted(p.name for p in run_dir.glob("*.pt")) == ["last.pt"]
    sampled = subprocess.run([sys.executable, str(REPO / "sample.py"), "--checkpoint", str(run_dir),
                              "--max-new-tokens", "5"], env=train_env(), capture_output=True, text=True, timeout=120)
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stderr.splitlines()[0].startswith(f"sampling {run_dir / 'last.pt'} (step 3, not yet evaluated), ")


@pytest.mark.slow  # its budget must outlast the start-up of a busy machine
def test_a_budget_on_the_command_line_and_a_resume_that_names_no_length(tmp_path, data_root):
    """The budget counts the process's start-up; a resume naming no length keeps the plan the budget chose (and
    changed, if the machine's speed did), which the preset's budget (5 minutes) does not size again."""
    run_dir = tmp_path / "run"
    command = [sys.executable, str(REPO / "train.py"), *[o for o in TINY if not o.startswith("train.max_iters=")],
               *data_overrides(data_root), f"hydra.run.dir={run_dir}"]
    result = subprocess.run([*command, "train.max_minutes=0.5"], env=train_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^train.max_minutes=0.5 fits (\d+) steps \(\d+\.\d s since the start, ", result.stdout,
                     flags=re.MULTILINE)
    last = torch.load(run_dir / "last.pt", weights_only=True)["training"]
    steps = last["config"]["train"]["max_iters"]
    assert last["step"] == steps == last["plan"][-1][1]
    resumed = subprocess.run([*command, f"train.resume={run_dir}"], env=train_env(), capture_output=True, text=True,
                             timeout=120)
    assert resumed.returncode == 2 and resumed.stderr == (
        f"train.py: error: train.resume: the checkpoint is at step {steps}, the end of its schedule (train.max_iters="
        f"{steps}); there is nothing left to train; give a larger train.max_iters to extend it\n")


def test_piped_output_gives_the_training_speed_on_each_evaluation_line(tmp_path, data_root):
    """Piped, stderr is no terminal and no progress bar shows: each evaluation line after step 0's gives the
    training tokens/s since the line before, at least the tokens of its steps over the process's whole time."""
    steps = ["train.max_iters=8", "train.eval_interval=4"]
    cfg = config(tmp_path, data_root, *steps)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, *data_overrides(data_root), *steps,
                             f"hydra.run.dir={tmp_path / 'run'}"],
                            env=train_env(), capture_output=True, text=True, timeout=120)
    whole_s = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 4", "step 8"], result.stdout
    assert "tokens/s" not in lines[0]
    least = cfg.train.batch_size * cfg.model.block_size * 4 / whole_s
    for line in lines[1:]:
        speed = re.search(r", ([\d,]+) tokens/s$", line)
        assert speed and int(speed[1].replace(",", "")) >= least, (line, least)


def test_sigterm_leaves_loadable_last_pt(tmp_path, data_root):
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, str(REPO / "train.py"), *TINY, *data_overrides(data_root),
                                "train.max_iters=1000000", "train.eval_interval=1000000", f"hydra.run.dir={run_dir}"],
                               cwd=tmp_path, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        first = process.stdout.readline()  # once printed, the signal handlers are in place
        assert first.startswith("training ") and " (preset cpu, as named; 1 process, " in first
        time.sleep(2)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert f"saved {run_dir}/last.pt" in stderr and stderr.count("\n") == 1
    step = int(stderr.split("stopped by SIGTERM at step ")[1].split(":")[0])
    last = torch.load(run_dir / "last.pt", weights_only=True)
    assert last["training"]["step"] == step > 0 and not (run_dir / "best.pt").exists()  # saved on the signal, not by an eval


# --- DDP ----------------------------------------------------------------------------------------------------------

def ddp_worker(rank: int, world_size: int, port: int, cfg, run_dir: Path, out: Path):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    wrapped, no_sync_calls = [], []

    class SpyDDP(training.loop.DDP):
        """DDP that remembers the module it wraps and counts the micro-steps without gradient sync."""

        def __init__(self, module, *args, **kwargs):
            super().__init__(module, *args, **kwargs)
            wrapped.append(module)

        def no_sync(self):
            no_sync_calls.append(None)
            return super().no_sync()

    training.loop.DDP = SpyDDP
    fit, evaluated = Trainer.fit, []

    def fit_and_keep_what_was_evaluated(trainer):
        last_val_loss = fit(trainer)
        evaluated.append(trainer.eval_model.state_dict())
        return last_val_loss

    Trainer.fit = fit_and_keep_what_was_evaluated
    train.main(cfg, run_dir)
    torch.save({"model": wrapped[0].state_dict(), "evaluated": evaluated[0], "no_sync_calls": len(no_sync_calls)},
               out / f"rank{rank}.pt")


@pytest.mark.parametrize("ema", [[], pytest.param(["train.ema_decay=0.5"], marks=pytest.mark.slow)],
                         ids=["weights", "moving-average"])
def test_ddp_two_cpu_processes_end_with_identical_weights(tmp_path, data_root, ema):
    """Every process trains, and averages, the same weights: rank 0's initial ones (each process's own seed draws
    others), which is what evaluations see and last.pt holds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config(tmp_path, data_root, "train.max_iters=6", "train.eval_interval=3", "train.eval_iters=2",
                 "train.grad_accum_steps=2", "train.log_interval=2", *ema)
    run_dir = tmp_path / "runs/ddp"
    mp.spawn(ddp_worker, args=(2, port, cfg, run_dir, tmp_path), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0]["no_sync_calls"] == ranks[1]["no_sync_calls"] == 6  # one of the 2 micro-steps, 6 steps
    for kind in ("model", "evaluated"):
        for name, weight in ranks[0][kind].items():
            assert torch.equal(ranks[1][kind][name], weight), (kind, name)
    last = torch.load(run_dir / "last.pt", weights_only=True)  # rank 0's: the same weights
    assert last["training"]["step"] == 6 and len(last["training"]["rng"]) == 2
    assert last["training"]["best_val_loss"] < math.log(65) + 0.1  # the mean over the processes, not their sum
    assert last["model"].keys() == ranks[0]["model"].keys()  # no "module." prefix
    for name, weight in ranks[0]["evaluated"].items():
        assert torch.equal(last["model"][name], weight), name
    for name, weight in ranks[0]["model"].items():
        assert torch.equal(last["training"]["raw_model"][name] if ema else last["model"][name], weight), name
    model = build_model(GPTConfig(**last["model_config"]))  # the val loss logged last is the saved model's
    model.load_state_dict(last["model"])
    settings = validate(cfg)
    data = prepare_data(settings)
    val = [evaluate(model, data, 16, settings.train.batch_size, 2, settings.train.seed + rank, torch.device("cpu"),
                    autocast_of(settings), 1)["val"] for rank in range(2)]  # each process evaluates batches of its own
    assert scalars(run_dir, "loss/val")[6] == pytest.approx(sum(val) / 2, rel=1e-5)
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1  # rank 0's, hparams included; nobody else's


def ddp_worker_stopped_by_a_signal_to_rank_1(rank: int, world_size: int, port: int, cfg, run_dir: Path, out: Path):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    train_step = Trainer.train_step

    def step_then_sigterm_on_rank_1(trainer):
        train_step(trainer)
        if trainer.rank == 1 and trainer.step == 2:
            signal.raise_signal(signal.SIGTERM)

    Trainer.train_step = step_then_sigterm_on_rank_1
    try:
        train.main(cfg, run_dir)
    except Stopped as e:
        (out / f"rank{rank}.txt").write_text(str(e))


@pytest.mark.slow
def test_under_ddp_a_signal_to_one_process_stops_every_process_at_the_next_step(tmp_path, data_root):
    """Though the steps between two logs (log_interval) outnumber the steps left."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config(tmp_path, data_root, "train.max_iters=30", "train.eval_interval=30", "train.log_interval=100",
                 "train.eval_iters=1")
    run_dir = tmp_path / "runs/ddp"
    mp.spawn(ddp_worker_stopped_by_a_signal_to_rank_1, args=(2, port, cfg, run_dir, tmp_path), nprocs=2)
    stopped = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    assert stopped[0].startswith("stopped by a signal to another process at step 2:"), stopped
    assert stopped[1].startswith("stopped by SIGTERM at step 2:"), stopped
    assert torch.load(run_dir / "last.pt", weights_only=True)["training"]["step"] == 2
