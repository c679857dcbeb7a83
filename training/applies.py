"""kvgpt's settings named on the command line that cannot apply to this run: each is refused, never silently
ignored. Hydra's own flags and settings are refused in training/hydra_gate.py."""

from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig

from runtime.errors import ConfigError


def named_keys(overrides) -> set[str]:
    """The keys (or groups) a list of overrides names: "hydra.run.dir", "runs_dir", "preset", ..."""
    return {override.key_or_group for override in OverridesParser.create().parse_overrides(list(overrides))}


def check_runs_dir_applies(config: DictConfig, resumed: Path) -> None:
    """Refuse a runs_dir named for a resumed run that goes on in its own directory elsewhere: the same command
    plus train.resume, which names the runs_dir that holds the run (a sweep's job too, deeper in it), still goes."""
    if "runs_dir" in named_keys(config.hydra.overrides.task) and \
            not resumed.resolve().is_relative_to(Path(config.runs_dir).resolve()):
        raise ConfigError(f"runs_dir={config.runs_dir} cannot apply: the resumed run continues in its own directory "
                          f"{resumed.parent}; drop runs_dir, or continue in a new directory with hydra.run.dir=NEW")


def check_patience_applies(tc, named: set[str] | None, resumed: bool) -> None:
    """Refuse a train.patience named that can never end the run: a new run of train.max_iters steps whose first
    evaluation after a step always improves, and so ends early only after patience more before its last. tc: the
    run's TrainConfig; named: the keys the command line names (None: none counts as named)."""
    if named is None or "train.patience" not in named or tc.patience is None or resumed or tc.max_iters is None:
        return  # a budget run's length, and what a resumed run has left, are not known yet
    before_last = (tc.max_iters - 1) // tc.eval_interval
    if before_last <= tc.patience:
        raise ConfigError(f"train.patience={tc.patience} can never end this run: it evaluates {before_last} "
                          f"time(s) before its last step (every train.eval_interval={tc.eval_interval} steps to "
                          f"train.max_iters={tc.max_iters}), and ending early takes {tc.patience + 1}; lower "
                          f"train.patience or train.eval_interval, or drop train.patience")
