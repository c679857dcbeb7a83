"""A budget run on a stand-in clock (training/budget.py's clock): steps that slow down or speed up after the plan
is fixed, and a run that ends on time with its learning rate at optim.min_lr; resumed from any of its checkpoints,
the same run bit for bit. The thread count chosen again on a stand-in step timer (training/threads.py), and
train.patience on a run whose val loss is made to rise."""

import dataclasses
import re
import shutil

import pytest
import torch

import train
import training.budget
import training.loop
import training.threads
from programs import assert_one_line_error, data_root, train_cli  # noqa: F401 (data_root: a fixture)
from test_train import TINY, config, data_overrides, scalars
import training.config
from model import build_model
from training.loop import Trainer
from training.summaries import PLANNED_STEPS, Summaries
from training.text import prepare_data

MIN_LR, LR = 1e-3, 1e-2  # AdamW's floor and peak (Muon's are 0.1 of its own peak)
BUDGET = ["train.max_iters=null", "train.max_minutes=1", "optim.decay_frac=0.5", f"optim.min_lr={MIN_LR}",
          "train.eval_interval=10"]
TINY_CLI = [o for o in TINY if not o.startswith("train.max_iters=")]
STEP_S, EVALUATION_S = 0.75, 1.0  # seconds on the stand-in clock (binary fractions: its sums are exact)


class StandInClock:
    """The budget's clock, moved on by each training step (STEP_S, times `factor` once the plan is fixed) and each
    evaluation that saves (evaluation_s), and by nothing else."""

    def __init__(self, monkeypatch, factor: float, evaluation_s: float = EVALUATION_S):
        self.now, self.factor, self.evaluation_s = 0.0, factor, evaluation_s
        monkeypatch.setattr(training.budget, "clock", lambda: self.now)
        step, evaluate_and_save, evaluate = Trainer.train_step, Trainer.evaluate_and_save, training.loop.evaluate
        saving = []

        def timed_step(trainer):
            step(trainer)
            self.now += STEP_S * (self.factor if trainer.tc.max_iters is not None else 1)

        def timed_evaluation(trainer):
            saving[:] = [trainer.step > trainer.start_step]
            evaluate_and_save(trainer)

        def timed_evaluate(*args, **kwargs):
            self.now += self.evaluation_s if saving[0] else 0.0
            return evaluate(*args, **kwargs)

        monkeypatch.setattr(Trainer, "train_step", timed_step)
        monkeypatch.setattr(Trainer, "evaluate_and_save", timed_evaluation)
        monkeypatch.setattr(training.loop, "evaluate", timed_evaluate)


def budget_run(tmp_path, data_root, monkeypatch, factor, *overrides, run_dir=None, evaluation_s=EVALUATION_S):
    clock = StandInClock(monkeypatch, factor, evaluation_s)
    printed = []
    monkeypatch.setattr(training.loop, "write_line", printed.append)
    run_dir = run_dir or tmp_path / "runs/budget"
    train.main(config(tmp_path, data_root, *BUDGET, *overrides), run_dir, started_at=clock.now)
    return run_dir, clock, printed


@pytest.mark.parametrize("factor", [3, 1 / 3], ids=["3x slower", "3x faster"])
def test_a_run_whose_steps_change_speed_after_its_plan_ends_on_time_at_min_lr(tmp_path, data_root, monkeypatch,
                                                                              factor):
    run_dir, clock, printed = budget_run(tmp_path, data_root, monkeypatch, factor)
    (fixed,) = [int(m[1]) for line in printed if (m := re.match(r"train.max_minutes=1 fits (\d+) steps", line))]
    changes = [line for line in printed if "plans the run again" in line]
    assert changes, printed
    last = torch.load(run_dir / "last.pt", weights_only=True)["training"]
    steps = last["config"]["train"]["max_iters"]
    assert last["step"] == steps == last["plan"][-1][1] and len(last["plan"]) == 1 + len(changes)
    assert (steps < fixed) if factor > 1 else (steps > fixed)
    assert clock.now <= 60 - training.budget.EXIT_S / 2  # within the budget, the process's exit left free
    if factor < 1:
        assert clock.now >= 60 * (1 - 3 * training.budget.MARGIN)  # and the time was used
    adamw, muon = (o["param_groups"][0]["lr"] for o in last["optimizers"])
    assert (adamw, muon) == (pytest.approx(MIN_LR), pytest.approx(0.02 * MIN_LR / LR))
    assert f"step {steps}: " in printed[-1] and f", lr {MIN_LR:.2e}, " in printed[-1]
    lrs = scalars(run_dir, "optim/lr")
    assert sorted(lrs) == list(range(steps)) and all(b <= a for a, b in zip(list(lrs.values())[fixed // 2:],
                                                                              list(lrs.values())[fixed // 2 + 1:]))
    assert sorted(scalars(run_dir, PLANNED_STEPS).values()) != [fixed]  # the fix and each change after it
    assert len(scalars(run_dir, PLANNED_STEPS)) == 1 + len(changes)


def test_a_slowed_run_resumed_from_any_checkpoint_ends_as_the_uninterrupted_run(tmp_path, data_root, monkeypatch):
    """Evaluations take no time on this clock: a resumed run evaluates again where it resumes, without saving."""
    kept, save = [], training.loop.save_checkpoint

    def save_and_keep(contents, path):
        save(contents, path)
        if path.name == "last.pt":
            kept.append(shutil.copy(path, tmp_path / f"last-{contents['training']['step']}.pt"))

    monkeypatch.setattr(training.loop, "save_checkpoint", save_and_keep)
    run_dir, _, printed = budget_run(tmp_path, data_root, monkeypatch, 3, evaluation_s=0.0)
    assert [line for line in printed if "plans the run again" in line]
    expected = torch.load(run_dir / "last.pt", weights_only=True)
    monkeypatch.setattr(training.loop, "save_checkpoint", save)
    for checkpoint in kept[:-1]:
        resumed = tmp_path / f"runs/from-{checkpoint.stem}"
        resumed.mkdir(parents=True)
        shutil.copy(checkpoint, resumed / "last.pt")
        budget_run(tmp_path, data_root, monkeypatch, 3, f"train.resume={resumed / 'last.pt'}",
                   run_dir=resumed, evaluation_s=0.0)
        got = torch.load(resumed / "last.pt", weights_only=True)
        assert got["training"]["plan"] == expected["training"]["plan"], checkpoint.name
        for name, weight in expected["model"].items():
            assert torch.equal(got["model"][name], weight), (checkpoint.name, name)


# --- the speed on the evaluation lines -----------------------------------------------------------------------------

def test_each_evaluation_line_gives_the_training_tokens_a_second_since_the_one_before(tmp_path, data_root,
                                                                                     monkeypatch):
    """On the stand-in clock a step takes STEP_S and an evaluation EVALUATION_S: each line after step 0's gives a
    step's tokens per STEP_S, the evaluations' time left out. Step 0's line follows no training and gives none."""
    StandInClock(monkeypatch, 1)
    printed = []
    monkeypatch.setattr(training.loop, "write_line", printed.append)
    cfg = config(tmp_path, data_root)
    train.main(cfg, tmp_path / "runs/speed")
    lines = [line for line in printed if line.startswith("step ")]
    speed = f", {cfg.train.batch_size * cfg.model.block_size / STEP_S:,.0f} tokens/s"
    assert len(lines) == 3 and "tokens/s" not in lines[0], lines
    assert all(line.endswith(speed) for line in lines[1:]), (lines, speed)


# --- the thread count, chosen again -------------------------------------------------------------------------------

def test_steps_that_slow_down_make_the_run_time_the_thread_counts_again_and_keep_the_fastest(tmp_path, data_root,
                                                                                             monkeypatch):
    """On a stand-in step timer, steps take 0.1 s at either count until step 30; then 2 threads take 0.5 s and 1
    thread 0.2 s (another program has taken a core). The run times both counts on its next steps, keeps 1 thread
    and says so, once."""
    now, printed = [0.0], []
    step = Trainer.train_step

    def timed_step(trainer):
        step(trainer)
        now[0] += 0.1 if trainer.step <= 30 else {1: 0.2, 2: 0.5}[torch.get_num_threads()]

    monkeypatch.setattr(training.threads, "step_timer", lambda: now[0])
    monkeypatch.setattr(Trainer, "train_step", timed_step)
    monkeypatch.setattr(training.loop, "write_line", printed.append)
    settings = training.config.validate(config(tmp_path, data_root, "train.max_iters=60"))
    data = prepare_data(settings)
    model = build_model(dataclasses.replace(settings.model, vocab_size=len(data.vocab)))
    torch.set_num_threads(2)
    summaries = Summaries(tmp_path / "run", "{}")
    try:
        Trainer(settings, model, data, torch.device("cpu"), tmp_path / "run", summaries, thread_counts=[1, 2]).fit()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(1)
        summaries.close()
    changes = [line for line in printed if line.startswith("threads: ")]
    assert len(changes) == 1 and re.fullmatch(r"threads: 1 from now on, not 2: steps at 2 slowed to \S+ s, over 1.5x "
                                              r"their fastest, as when another program takes a core; timed again: "
                                              r"1 thread took 0.2 s a step, 2 threads took 0.5 s a step",
                                              changes[0]), changes
    (step, threads), = scalars(tmp_path / "run", "perf/threads").items()
    assert threads == 1 and 30 < step < 45


# --- train.patience -----------------------------------------------------------------------------------------------

def test_patience_ends_a_run_whose_val_loss_rises_with_its_best_weights_last(tmp_path, data_root, monkeypatch):
    """Val loss is scripted by step: best at step 20, then rising. With patience 2 the run ends at step 40, the
    second evaluation without improvement; last.pt then holds best.pt's weights, and the closing line says why."""
    scripted, evaluate, at = {0: 4.0, 10: 3.0, 20: 2.0, 30: 2.5, 40: 2.6}, training.loop.evaluate, {}
    monkeypatch.setattr(training.loop, "evaluate",
                        lambda *args, **kwargs: {**evaluate(*args, **kwargs), "val": scripted[at["trainer"].step]})
    step = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda trainer: (at.update(trainer=trainer), step(trainer)))
    monkeypatch.setattr(Trainer, "evaluate_and_save", lambda trainer, real=Trainer.evaluate_and_save: (
        at.update(trainer=trainer), real(trainer))[1])
    printed = []
    monkeypatch.setattr(train, "write_line", printed.append)
    run_dir = tmp_path / "runs/patient"
    train.main(config(tmp_path, data_root, "train.max_iters=100", "train.eval_interval=10", "train.patience=2"),
               run_dir)
    assert sorted(scalars(run_dir, "loss/val")) == [0, 10, 20, 30, 40]  # no step after the patience ran out
    best, last = (torch.load(run_dir / name, weights_only=True) for name in ("best.pt", "last.pt"))
    assert best["training"]["step"] == last["training"]["step"] == 20
    assert all(torch.equal(last["model"][name], weight) for name, weight in best["model"].items())
    assert printed[-1] == (f"done: val loss 2.6000 (best 2.0000) at step 40, ended early by train.patience=2: val "
                           f"loss has not improved for 2 evaluations, since step 20; last.pt holds best.pt's weights; "
                           f"checkpoints in {run_dir}")


# --- a budget too short -------------------------------------------------------------------------------------------

def test_a_budget_refused_after_its_first_steps_leaves_nothing_behind(tmp_path, data_root):
    """A minute leaves no room for a warm-up of ten million steps, which the run learns only once it has measured its
    steps: refused in one line, it leaves no run directory, and the same hydra.run.dir serves the next run. (A
    minute: however slowly a busy machine starts the run, its start leaves the budget room for some steps.)"""
    run_dir = tmp_path / "run"
    refused = train_cli(*TINY_CLI, *data_overrides(data_root), "train.max_iters=null", "train.max_minutes=1",
                        "optim.warmup_iters=10000000", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert_one_line_error(refused, "train.py", "train.max_minutes=1 leaves time for ")
    assert not run_dir.exists()
    again = train_cli(*TINY_CLI, *data_overrides(data_root), "train.max_iters=8", "train.eval_interval=4",
                      f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert torch.load(run_dir / "last.pt", weights_only=True)["training"]["step"] == 8
