"""Training by the clock, at its edges: options that meet a budget (train.patience, a run that ends before its
length is fixed, a resumed run), budgets that cannot hold what a run must do (an evaluation, the start-up, the
warm-up), refused as soon as that is clear, and the commands a budget run prints, which do what they say.

Most runs here go by tests/test_clock.py's stand-in clock: 0.75 s a step, 1 s an evaluation that saves, a budget
of 60 s whose length is fixed near step 35."""

import math
import re
import shutil

import pytest
import torch
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

import train
import training.budget
import training.clock
import training.loop
import training.threads
from model import build_model
from programs import assert_one_line_error, data_root, train_cli  # noqa: F401 (data_root: a fixture)
from runtime.errors import ConfigError
from test_clock import BUDGET, TINY_CLI, StandInClock, budget_run
from test_sizing import timed  # noqa: F401 (a fixture)
from test_train import AIM_AT_HALF, HOLD, config, data_overrides, events, scalars, sigterm_at
from training.config import validate
from training.loop import Diverged, Stopped, Trainer
from training.summaries import Summaries
from training.text import prepare_data

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow

FIXED = [o for o in BUDGET if not o.startswith(("train.max_iters", "train.max_minutes"))]  # the budget's settings
REPEATS = re.compile(r"\); to repeat this run exactly, give (.*) in place of train.max_minutes$")


def scripted_val(patch, losses: dict[int, float]) -> None:
    """Evaluations report these val losses by step; the rest of each evaluation is real."""
    at, evaluate, evaluate_and_save = {}, training.loop.evaluate, Trainer.evaluate_and_save

    def tracked(trainer):
        at["step"] = trainer.step
        return evaluate_and_save(trainer)

    patch.setattr(training.loop, "evaluate", lambda *args, **kwargs: {**evaluate(*args, **kwargs),
                                                                      "val": losses[at["step"]]})
    patch.setattr(Trainer, "evaluate_and_save", tracked)


def steps_counted(patch) -> list:
    """One item for each training step taken from now on."""
    taken, step = [], Trainer.train_step
    patch.setattr(Trainer, "train_step", lambda trainer: (taken.append(trainer.step), step(trainer))[1])
    return taken


def hparams_session(run_dir) -> tuple[bool, int]:
    """Whether the run's HParams session started, and the status it ended with."""
    content = events(run_dir).PluginTagToContent("hparams")
    end = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_end_info"])
    return "_hparams_/session_start_info" in content, end.session_end_info.status


def same_weights(a, b) -> bool:
    first, second = (torch.load(path, weights_only=True)["model"] for path in (a, b))
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


# --- train.patience, and the ends of a run whose length is still open -----------------------------------------------

def test_patience_ends_a_budget_run_before_its_length_is_fixed_on_its_best_weights(tmp_path, data_root, monkeypatch):
    """Val loss is best at step 10 and worse at step 20, before the budget fixes the length: patience 1 ends the run
    there, last.pt on best.pt's weights. It ended with "'<' not supported between 'int' and 'NoneType'"."""
    scripted_val(monkeypatch, {0: 4.0, 10: 3.0, 20: 3.5})
    said = []
    monkeypatch.setattr(train, "write_line", said.append)
    run_dir, _, printed = budget_run(tmp_path, data_root, monkeypatch, 1, "train.patience=1")
    assert not [line for line in printed if " fits " in line]  # ended before the length was fixed
    assert sorted(scalars(run_dir, "loss/val")) == [0, 10, 20]
    assert torch.load(run_dir / "last.pt", weights_only=True)["training"]["step"] == 10
    assert same_weights(run_dir / "last.pt", run_dir / "best.pt")
    assert said[-1].startswith("done: val loss 3.5000 (best 3.0000) at step 20, ended early by train.patience=1: "
                               "val loss has not improved for 1 evaluations, since step 10; last.pt holds best.pt's "
                               "weights")


def test_patience_ends_a_resumed_budget_run_whose_length_is_still_open(tmp_path, data_root):
    """Stopped at step 12, before its budget fixed its length, the run resumes with train.patience=1: step 20's val
    loss is worse than step 10's, which the checkpoint records as the best, and the run ends there."""
    run_dir = tmp_path / "runs/budget"
    with pytest.MonkeyPatch.context() as patch, pytest.raises(Stopped):
        scripted_val(patch, {0: 4.0, 10: 3.0})
        sigterm_at(patch, 12)
        budget_run(tmp_path, data_root, patch, 1, run_dir=run_dir)
    assert torch.load(run_dir / "last.pt", weights_only=True)["training"]["config"]["train"]["max_iters"] is None
    with pytest.MonkeyPatch.context() as patch:
        scripted_val(patch, {20: 3.5})
        budget_run(tmp_path, data_root, patch, 1, "train.patience=1", f"train.resume={run_dir}", run_dir=run_dir)
    assert sorted(scalars(run_dir, "loss/val")) == [0, 10, 20]
    assert torch.load(run_dir / "last.pt", weights_only=True)["training"]["step"] == 10
    assert same_weights(run_dir / "last.pt", run_dir / "best.pt")


def test_a_budget_run_ended_by_patience_before_its_length_is_fixed_is_in_the_hparams_dashboard(tmp_path, data_root,
                                                                                              monkeypatch):
    """Its HParams session starts when the length is fixed; a run that never gets there started none, and the
    dashboard left it out."""
    scripted_val(monkeypatch, {0: 4.0, 10: 3.0, 20: 3.5})
    run_dir, _, _ = budget_run(tmp_path, data_root, monkeypatch, 1, "train.patience=1")
    assert hparams_session(run_dir) == (True, api_pb2.STATUS_SUCCESS)


def test_a_budget_run_that_diverges_before_its_length_is_fixed_is_in_the_hparams_dashboard(tmp_path, data_root,
                                                                                          monkeypatch):
    step = Trainer.train_step

    def diverging(trainer):
        step(trainer)
        if trainer.step == 15:
            loss, *rest = trainer.pending[-1]
            trainer.pending[-1] = (loss * math.nan, *rest)

    monkeypatch.setattr(Trainer, "train_step", diverging)
    with pytest.raises(Diverged, match="non-finite training loss nan"):
        budget_run(tmp_path, data_root, monkeypatch, 1)
    assert hparams_session(tmp_path / "runs/budget") == (True, api_pb2.STATUS_FAILURE)


# --- budgets that cannot hold what the run must do ------------------------------------------------------------------

def test_a_budget_that_cannot_hold_an_evaluation_is_refused_before_the_first(tmp_path, data_root):
    """An evaluation of a million batches a split: a few of them, timed, foresee it. The run took the whole first
    evaluation (about 30 s of 10,000 batches) before it learned that no step fitted."""
    run_dir = tmp_path / "run"
    result = train_cli(*TINY_CLI, *data_overrides(data_root), "train.max_iters=null", "train.max_minutes=0.2",
                       "train.eval_iters=1000000", f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=90)
    assert_one_line_error(result, "train.py", "train.max_minutes=0.2 (12 s) cannot hold this run: ",
                          " s are spent already, 2 evaluations (at its start and its end) of about ",
                          " s each here, and the exit needs 2 s; lower train.eval_iters, or give a longer budget")
    assert "step 0:" not in result.stdout and not run_dir.exists()


def test_a_budget_spent_by_the_start_up_is_refused_before_the_run_begins(tmp_path, data_root):
    """0.6 s: the interpreter and torch take more to start. It trained and evaluated before it said so."""
    run_dir = tmp_path / "run"
    result = train_cli(*TINY_CLI, *data_overrides(data_root), "train.max_iters=null", "train.max_minutes=0.01",
                       f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert_one_line_error(result, "train.py", "train.max_minutes=0.01 (0.6 s) cannot hold this run: ",
                          " s are spent already, and the exit needs 2 s; give a longer budget")
    assert result.stdout == "" and not run_dir.exists()


def test_a_resumed_budget_run_that_cannot_hold_its_final_evaluation_is_refused_before_a_step(tmp_path, data_root):
    """Stopped at step 12 with 50 s of its 60 s spent, the run resumes; an evaluation takes 10 s (2.5 s a batch on
    the stand-in clock, and the three batches that foresee it take 7.5 s). One more evaluation and the exit do not
    fit: refused before any step, last.pt as it was. The advice, more steps in place of the budget, trains it on."""
    run_dir = tmp_path / "runs/budget"
    with pytest.MonkeyPatch.context() as patch, pytest.raises(Stopped):
        sigterm_at(patch, 12)
        budget_run(tmp_path, data_root, patch, 1, run_dir=run_dir)
    stopped = torch.load(run_dir / "last.pt", weights_only=True)
    stopped["training"]["seconds"] = 50.0
    torch.save(stopped, run_dir / "last.pt")
    kept = (run_dir / "last.pt").read_bytes()
    with pytest.MonkeyPatch.context() as patch:
        clock = StandInClock(patch, 1)
        evaluate = training.clock.evaluate

        def slow_evaluate(*args, **kwargs):
            clock.now += 2.5 * args[4]  # eval_iters batches of each split
            return evaluate(*args, **kwargs)

        patch.setattr(training.clock, "evaluate", slow_evaluate)
        taken = steps_counted(patch)
        with pytest.raises(ConfigError) as refused:
            train.main(config(tmp_path, data_root, *BUDGET, f"train.resume={run_dir}"), run_dir, started_at=clock.now)
    assert str(refused.value) == (
        "train.max_minutes=1 (60 s) cannot hold this run: 57.5 s are spent already, 1 evaluation (at its end) of "
        "about 10 s here, and the exit needs 2 s; train the run on by steps instead: give train.max_iters=N (N above "
        "12) in place of train.max_minutes")
    assert taken == [] and (run_dir / "last.pt").read_bytes() == kept
    train.main(config(tmp_path, data_root, *FIXED, "train.max_iters=17", f"train.resume={run_dir}"), run_dir)
    assert torch.load(run_dir / "last.pt", weights_only=True)["training"]["step"] == 17


def test_a_budget_that_cannot_hold_the_warm_up_is_refused_once_its_steps_are_measured(tmp_path, data_root,
                                                                                      monkeypatch):
    """About 75 steps fit in the stand-in budget, and the warm-up takes 1,000: refused once the steps that measure
    a plan are taken, not when the decay would begin, at the budget's end."""
    taken = steps_counted(monkeypatch)
    with pytest.raises(ConfigError, match=r"^train.max_minutes=1 leaves time for \d+ steps here \(.*\), no more than "
                                          r"optim.warmup_iters=1000; give a longer budget$"):
        budget_run(tmp_path, data_root, monkeypatch, 1, "optim.warmup_iters=1000")
    assert len(taken) == training.budget.REPLAN_STEPS


# --- what a budget run prints does what it says ---------------------------------------------------------------------

def test_a_run_planned_again_says_that_no_command_repeats_it(tmp_path, data_root, monkeypatch):
    """It said `train.max_iters=N ... repeats this run`, then planned again: N steps from the start give other
    weights. The first change says so, once; the later ones do not repeat it."""
    run_dir, _, printed = budget_run(tmp_path, data_root, monkeypatch, 3)
    (promise,) = [line for line in printed if " fits " in line]
    assert REPEATS.search(promise)
    changes = [line for line in printed if "plans the run again" in line or "ends the run at step" in line]
    first = int(re.search(r"at step (\d+)", changes[0])[1])
    assert changes[0].endswith(f"; the run goes on, but no command repeats it exactly now: its plan changed at step "
                               f"{first}, and train.max_iters plans a run from step 0 (its checkpoints record the "
                               f"change, and a resume follows it)")
    assert not [line for line in changes[1:] if "no command repeats" in line]
    steps = torch.load(run_dir / "last.pt", weights_only=True)["training"]["step"]
    train.main(config(tmp_path, data_root, *FIXED, f"train.max_iters={steps}"), tmp_path / "runs/steps")
    assert not same_weights(run_dir / "last.pt", tmp_path / "runs/steps/last.pt")


def keeps_its_first_plan(monkeypatch) -> None:
    """A busy machine (the suite's other worker) would have a 6 s budget run plan again, which no command repeats
    (test_a_run_planned_again_says_that_no_command_repeats_it): here the run keeps the plan its line names."""
    monkeypatch.setattr(training.budget.Budget, "replanned", lambda self, *args: (None, ""))
    monkeypatch.setattr(training.budget.Budget, "late", lambda self, *args: None)


def followed(printed: list[str]) -> list[str]:
    """The overrides that the budget's line says repeat the run."""
    (overrides,) = [m[1] for line in printed if (m := REPEATS.search(line))]
    return overrides.split()


def test_the_command_a_sized_budget_run_prints_repeats_it(tmp_path, data_root, timed, monkeypatch):  # noqa: F811
    """Sized to 1 layer at batch 4 with 1 thread: train.max_iters alone would train the configured shape."""
    timed.update({(1, 1): 0.04, (1, 2): 0.08, (2, 1): 0.4})  # slow: the shallow shape; 1 thread
    monkeypatch.setattr(training.budget, "MARGIN", AIM_AT_HALF)
    monkeypatch.setattr(training.threads, "SLOWER", math.inf)  # no thread count timed again mid-run
    keeps_its_first_plan(monkeypatch)
    printed = []
    monkeypatch.setattr(training.loop, "write_line", printed.append)
    run_dir = tmp_path / "runs/sized"
    train.main(config(tmp_path, data_root, "train.max_iters=null", "train.max_minutes=0.1", *HOLD), run_dir,
               named=set())
    overrides = followed(printed)
    assert overrides[1:] == ["model.n_layer=1", "train.batch_size=4", "train.threads=1"]
    train.main(config(tmp_path, data_root, *HOLD, *overrides), tmp_path / "runs/again",
               named={override.split("=")[0] for override in overrides})
    assert same_weights(run_dir / "last.pt", tmp_path / "runs/again/last.pt")


def test_the_command_a_budget_run_that_timed_its_threads_prints_repeats_it(tmp_path, data_root, timed,  # noqa: F811
                                                                           monkeypatch):
    """Its shape named, the run timed 1 thread faster; by the time it is repeated, 2 threads are faster, and a run
    that times them again would sum its gradients otherwise."""
    timed.update({(2, 1): 0.01, (2, 2): 0.02})
    monkeypatch.setattr(training.budget, "MARGIN", AIM_AT_HALF)
    monkeypatch.setattr(training.threads, "SLOWER", math.inf)
    keeps_its_first_plan(monkeypatch)
    printed = []
    monkeypatch.setattr(training.loop, "write_line", printed.append)
    run_dir = tmp_path / "runs/timed"
    named = {"model.n_layer", "train.batch_size", "train.max_iters", "train.max_minutes"}
    train.main(config(tmp_path, data_root, "train.max_iters=null", "train.max_minutes=0.1", *HOLD), run_dir,
               named=named)
    overrides = followed(printed)
    assert overrides[1:] == ["train.threads=1"]
    timed.update({(2, 1): 0.02, (2, 2): 0.01})
    train.main(config(tmp_path, data_root, *HOLD, *overrides), tmp_path / "runs/again",
               named=named - {"train.max_minutes"} | {"train.threads"})
    assert same_weights(run_dir / "last.pt", tmp_path / "runs/again/last.pt")


def test_a_finished_budget_run_given_another_budget_is_told_what_trains_it_on(tmp_path, data_root, monkeypatch):
    """It was told to resume without train.max_minutes, which then found nothing left to train."""
    run_dir, _, _ = budget_run(tmp_path, data_root, monkeypatch, 1)
    step = torch.load(run_dir / "last.pt", weights_only=True)["training"]["step"]
    with pytest.raises(ConfigError) as refused:
        train.main(config(tmp_path, data_root, *FIXED, "train.max_iters=null", "train.max_minutes=2",
                          f"train.resume={run_dir}"), run_dir)
    assert str(refused.value) == (f"train.resume: a resumed run keeps the {step} steps it was planned for, sized by "
                                  f"train.max_minutes=1; the run has ended at step {step}: give train.max_iters=N (N "
                                  f"above {step}) in place of train.max_minutes to train it on")
    train.main(config(tmp_path, data_root, *FIXED, f"train.max_iters={step + 3}", f"train.resume={run_dir}"), run_dir)
    assert torch.load(run_dir / "last.pt", weights_only=True)["training"]["step"] == step + 3


def test_a_budget_run_whose_steps_change_thread_count_after_its_plan_says_no_command_repeats_it(tmp_path, data_root,
                                                                                              monkeypatch):
    """On a stand-in step timer both counts take 0.1 s until step 45, after the plan; then 2 threads slow down, and
    the run times both counts again: its steps ran at 1 and 2 threads, which no train.threads names. (Each step
    runs with one thread, whatever count it is timed at: two threads' steps stall on a busy machine.)"""
    clock, now, step = StandInClock(monkeypatch, 1), [0.0], Trainer.train_step

    def timed_step(trainer):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        step(trainer)
        torch.set_num_threads(threads)
        now[0] += 0.1 if trainer.step <= 45 else {1: 0.2, 2: 0.5}[threads]

    monkeypatch.setattr(training.threads, "step_timer", lambda: now[0])
    monkeypatch.setattr(Trainer, "train_step", timed_step)
    printed = []
    monkeypatch.setattr(training.loop, "write_line", printed.append)
    settings = validate(config(tmp_path, data_root, *BUDGET))
    data = prepare_data(settings)
    model = build_model(settings.model.__class__(**{**settings.model.__dict__, "vocab_size": len(data.vocab)}))
    torch.set_num_threads(2)
    summaries = Summaries(tmp_path / "run", "{}")
    try:
        Trainer(settings, model, data, torch.device("cpu"), tmp_path / "run", summaries, started_at=clock.now,
                thread_counts=[1, 2]).fit()
    finally:
        torch.set_num_threads(1)
        summaries.close()
    (promise,) = [line for line in printed if " fits " in line]
    assert REPEATS.search(promise)[1].endswith(" train.threads=2")
    assert "threads: the run goes on, but no command repeats it exactly now: its steps ran at 1 and 2 threads, which " \
           "round sums slightly differently, and train.threads names one count" in printed
    assert printed.index(promise) < [line.startswith("threads: the run goes on") for line in printed].index(True)
    shutil.rmtree(tmp_path / "run")
