"""Continuing a run: the checkpoint train.resume names, checked to fit the config it continues with."""

import dataclasses
import uuid
from pathlib import Path

import torch

from model import GPTConfig, build_model
from runtime.checkpoint import load_checkpoint, resolve_checkpoint
from runtime.errors import CheckpointError, ConfigError, one_line
from runtime.files import remove_stale_temporaries

from .config import OptimConfig, flatten
from .distributed import is_rank_zero
from .optim import Schedule, make_optimizers
from .runs import continues_in_place, weights_only
from .sizing import kept_on_resume

# Settings a resumed run must share with the run it continues: the model, the optimiser, the schedule, the weights'
# average and the split of its text (training/text.py checks that the text is the same, whatever its path). Its length
# may change: the plan is then extended (or shortened) as if it had been made so from the start.
MUST_MATCH = ("model.", "optim.", "train.batch_size", "train.grad_accum_steps", "train.seed", "train.ema_decay",
              "data.val_fraction")


def resumed_settings(settings, named: set[str] | None, run_dir: Path) -> tuple:
    """With train.resume: the settings the resumed run takes (its length, what sizing chose), the checkpoint it
    continues, and the run's identity, which its checkpoints record (a new directory's own, or the run's that
    continues there). Without: the settings as they are, None and a new identity."""
    if settings.train.resume is None:
        return settings, None, uuid.uuid4().hex
    length_named = named is None or not named.isdisjoint({"train.max_iters", "train.max_minutes"})
    resumed, length, kept_values = load_resume_checkpoint(settings.train.resume, settings.config, settings.optim,
                                                          length_named, kept_on_resume(settings, named))
    settings = settings.replaced(kept_values).planned(*length)
    in_place = continues_in_place(resolve_checkpoint(settings.train.resume, prefer="last.pt"), run_dir)
    if in_place and is_rank_zero():  # what a run killed mid-save left beside its checkpoints
        remove_stale_temporaries(run_dir)
    return settings, resumed, resumed["training"].get("run_id") if in_place else uuid.uuid4().hex


def load_resume_checkpoint(path, config: dict, optim: OptimConfig, length_named: bool = True,
                           kept: tuple[str, ...] = ()) -> tuple[dict, tuple[int | None, float | None], dict]:
    """The checkpoint at path (a run directory means its last.pt), checked to fit config (the resolved,
    composed config as a dict) and to be whole: a damaged one is a ConfigError, not a crash mid-restore. With
    it, the length of the resumed run, (train.max_iters, train.max_minutes): config's steps where the command
    names the run's length (length_named), else the checkpoint's. A budget fixes a run's length once: a resume
    keeps it, or lets the budget fix it if the run stopped before then. kept: settings the resumed run takes
    from the checkpoint, whatever config says (what sizing chose for the machine: training/sizing.py),
    returned last as {key: value}."""
    try:
        contents = load_checkpoint(path, prefer="last.pt")
    except CheckpointError as e:
        raise ConfigError(f"train.resume: {e}") from None
    state = contents.get("training")
    if state is None:
        raise weights_only(path)
    ours = flatten(config)
    theirs = {"train.ema_decay": None, **flatten(state["config"])}  # one saved before the setting existed: no average
    if theirs.get("model.n_kv_head") is None:  # saved before the smaller caches: every head its keys and values
        theirs["model.n_kv_head"] = theirs.get("model.n_head")
    for field in dataclasses.fields(GPTConfig):  # a model field saved before it existed: its default, then as now
        if field.default is not dataclasses.MISSING:
            theirs.setdefault(f"model.{field.name}", field.default)
    differ = [key for key in theirs
              if key.startswith(MUST_MATCH) and key not in kept and ours.get(key) != theirs[key]]
    if differ:
        raise ConfigError("train.resume continues a run with other settings; add them to the command: "
                          + " ".join(f"{key}={as_override(theirs[key])}" for key in differ))
    planned, budget, step = theirs.get("train.max_iters"), theirs.get("train.max_minutes"), state["step"]
    open_budget = planned is None and budget is not None  # stopped before its budget fixed its length
    if not (isinstance(step, int) and 0 <= step and (open_budget or isinstance(planned, int) and step <= planned)):
        raise ConfigError(f"train.resume: {path} is damaged (step {step!r} of a plan of {planned!r} steps); resume "
                          f"from another checkpoint")
    max_iters, max_minutes = (ours["train.max_iters"], None) if length_named else (planned, budget)
    if length_named and max_iters is None:  # the command names a budget
        if ours["train.max_minutes"] != budget:
            sized = f", sized by train.max_minutes={budget:g}" if budget is not None else ""
            kept = f"the {planned} steps it was planned for" if planned is not None else "its budget"
            # a run at its plan's end has nothing left to resume as it is: only more steps train it on
            left = "resume without train.max_minutes, or give" if planned != step else \
                f"the run has ended at step {step}: give"
            raise ConfigError(f"train.resume: a resumed run keeps {kept}{sized}; {left} train.max_iters=N (N above "
                              f"{step}) in place of train.max_minutes to train it on")
        max_iters, max_minutes = planned, budget
    if max_iters is not None and max_iters < step:  # (None: its budget goes on to fix the length)
        raise ConfigError(f"train.max_iters={max_iters} is below step {step}, which the run in {path} has reached; "
                          f"give a larger train.max_iters to extend it")
    if max_iters == step:
        raise ConfigError(f"train.resume: the checkpoint is at step {step}, the end of its schedule "
                          f"(train.max_iters={max_iters}); there is nothing left to train; give a larger "
                          f"train.max_iters to extend it")
    try:
        check_restorable(contents, optim, planned)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as e:
        raise ConfigError(f"train.resume: {path} is damaged ({one_line(e)[:200]}); resume from another checkpoint") from None
    return contents, (max_iters, max_minutes), {key: theirs[key] for key in kept if key in theirs}


def check_restorable(contents: dict, optim: OptimConfig, max_iters: int | None) -> None:
    """Restore the checkpoint's weights, optimiser and schedule into throwaway copies, as the Trainer will, and
    check the values that are restored as they are; whatever does not fit raises."""
    state = contents["training"]
    model = build_model(GPTConfig(**contents["model_config"]))
    model.load_state_dict(contents["model"])  # strict: every tensor present, of its shape
    if state["config"]["train"].get("ema_decay") is not None:  # model holds the average, raw_model what it averages
        model.load_state_dict(state["raw_model"])
    optimizers = make_optimizers(model, optim, fused=False)
    for optimizer, optimizer_state in zip(optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(optimizer_state)
        for group in optimizer.param_groups:
            for param in group["params"]:
                for name, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                        raise ValueError(f"the optimizer's {name} does not fit a weight of shape "
                                         f"{tuple(param.shape)}")
    if len(state["schedulers"]) != len(optimizers) or not all(isinstance(s, dict) for s in state["schedulers"]):
        raise ValueError(f"its schedulers {state['schedulers']!r:.60} are not one state for each optimiser")
    plan = Schedule(optim, state.get("plan") or max_iters)  # the plan the run recorded (none before plans were)
    if plan.end != max_iters or plan.plan and plan.plan[-1][0] > state["step"]:
        raise ValueError(f"its plan {state.get('plan')!r:.60} is not one of {max_iters} steps made by step "
                         f"{state['step']}")


def as_override(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
