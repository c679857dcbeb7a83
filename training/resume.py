"""Continuing a run: the checkpoint train.resume names, checked to fit the config it continues with."""


import torch

from model import GPT, GPTConfig

from .checkpoint import load_checkpoint
from .config import OptimConfig, flatten
from .errors import CheckpointError, ConfigError, one_line
from .optim import make_optimizers, make_scheduler

# Settings a resumed run must share with the run it continues: the model, the optimiser, the schedule, the weights'
# average and the split of its text (train.py checks that the text is the same, whatever its path).
MUST_MATCH = ("model.", "optim.", "train.max_iters", "train.batch_size", "train.grad_accum_steps", "train.seed",
              "train.ema_decay", "data.val_fraction")


def load_resume_checkpoint(path, config: dict, max_iters: int, optim: OptimConfig) -> dict:
    """The checkpoint at path (a run directory means its last.pt), checked to fit config (the resolved,
    composed config as a dict) and to be whole: a damaged one is a ConfigError, not a crash mid-restore."""
    try:
        contents = load_checkpoint(path, prefer="last.pt")
    except CheckpointError as e:
        raise ConfigError(f"train.resume: {e}") from None
    state = contents.get("training")
    if state is None:
        raise ConfigError(f"train.resume: {path} holds weights only, no training state to continue")
    ours = flatten(config)
    theirs = {"train.ema_decay": None, **flatten(state["config"])}  # one saved before the setting existed: no average
    differ = [key for key in theirs if key.startswith(MUST_MATCH) and ours.get(key) != theirs[key]]
    if differ:
        raise ConfigError("train.resume continues a run with other settings; add them to the command: "
                          + " ".join(f"{key}={as_override(theirs[key])}" for key in differ))
    if not (isinstance(state["step"], int) and 0 <= state["step"] < max_iters):
        raise ConfigError(f"train.resume: the checkpoint is at step {state['step']}, the end of its schedule "
                          f"(train.max_iters={max_iters}); there is nothing left to train")
    try:
        check_restorable(contents, optim, max_iters)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as e:
        raise ConfigError(f"train.resume: {path} is damaged ({one_line(e)[:200]}); resume from another checkpoint") from None
    return contents


def check_restorable(contents: dict, optim: OptimConfig, max_iters: int) -> None:
    """Restore the checkpoint's weights, optimiser and schedule into throwaway copies, as the Trainer will, and
    check the values that are restored as they are; whatever does not fit raises."""
    state = contents["training"]
    model = GPT(GPTConfig(**contents["model_config"]))
    model.load_state_dict(contents["model"])  # strict: every tensor present, of its shape
    if state["config"]["train"].get("ema_decay") is not None:  # model holds the average, raw_model what it averages
        model.load_state_dict(state["raw_model"])
    optimizers = make_optimizers(model, optim, fused=False)
    for optimizer, optimizer_state, scheduler_state in zip(optimizers, state["optimizers"], state["schedulers"],
                                                            strict=True):
        optimizer.load_state_dict(optimizer_state)
        for group in optimizer.param_groups:
            for param in group["params"]:
                for name, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                        raise ValueError(f"the optimizer's {name} does not fit a weight of shape "
                                         f"{tuple(param.shape)}")
        make_scheduler(optimizer, optim, max_iters).load_state_dict(scheduler_state)


def as_override(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
