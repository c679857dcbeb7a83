"""Continuing a run: the checkpoint train.resume names, checked to fit the config it continues with."""

from .checkpoint import TRAINING_KEYS, CheckpointError, load_checkpoint
from .config import ConfigError, flatten

# Settings a resumed run must share with the run it continues: the model, the optimiser, the schedule and
# the data it trains and evaluates on (where the data is kept may differ).
MUST_MATCH = ("model.", "optim.", "train.max_iters", "train.batch_size", "train.grad_accum_steps", "train.seed",
              "data.sha256", "data.val_fraction")


def load_resume_checkpoint(path, config: dict, max_iters: int) -> dict:
    """The checkpoint at path (a run directory means its last.pt), checked to fit config (the resolved,
    composed config as a dict)."""
    try:
        contents = load_checkpoint(path, prefer="last.pt")
    except CheckpointError as e:
        raise ConfigError(f"train.resume: {e}") from None
    state = contents.get("training")
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict) \
            or any(key not in state for key in TRAINING_KEYS):
        raise ConfigError(f"train.resume: {path} holds weights only, no training state to continue")
    ours, theirs = flatten(config), flatten(state["config"])
    differ = [key for key in theirs if key.startswith(MUST_MATCH) and ours.get(key) != theirs[key]]
    if differ:
        raise ConfigError("train.resume continues a run with other settings; add them to the command: "
                          + " ".join(f"{key}={as_override(theirs[key])}" for key in differ))
    if not (isinstance(state["step"], int) and 0 <= state["step"] < max_iters):
        raise ConfigError(f"train.resume: the checkpoint is at step {state['step']}, the end of its schedule "
                          f"(train.max_iters={max_iters}); there is nothing left to train")
    return contents


def as_override(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
