"""Hydra behind one gate: train.py's flags, read here before Hydra starts, and every Hydra flag or setting kvgpt
cannot apply, refused by a row of REFUSALS in one line with status 2. Hydra alone would ignore some of them, and
refuse others with status 1 or a traceback, as if the machine had failed."""

import argparse
import contextlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from runtime.command import fail
from runtime.errors import ConfigError, UsageError
from runtime.streams import unwritable_output

from .applies import named_keys
from .distributed import is_rank_zero
from .runs import RECORD

CONFIG_DIR, CONFIG_NAME = Path(__file__).resolve().parents[1] / "conf", "config"  # what train.py's hydra.main composes
VERSION_BASE = "1.3"
HYDRA_FLAGS = (  # Hydra's own, read as hydra.main reads them; `python train.py --hydra-help` lists them, a test too
    (("--help", "-h"), dict(action="store_true")),
    (("--hydra-help",), dict(action="store_true")),
    (("--version",), dict(action="version", version=f"Hydra {hydra.__version__}")),
    (("--cfg", "-c"), dict(choices=["job", "hydra", "all"])),
    (("--resolve",), dict(action="store_true")),
    (("--package", "-p"), {}),
    (("--run", "-r"), dict(action="store_true")),
    (("--multirun", "-m"), dict(action="store_true")),
    (("--shell-completion", "-sc"), dict(action="store_true")),
    (("--config-path", "-cp"), {}),
    (("--config-name", "-cn"), {}),
    (("--config-dir", "-cd"), {}),
    (("--experimental-rerun",), {}),
    (("--info", "-i"), dict(nargs="?", const="all",
                             choices=["all", "config", "defaults", "defaults-tree", "plugins", "searchpath"])),
)
COMMANDS = ("run", "multirun", "cfg", "info", "shell_completion")  # each says what train.py does
COMPLETIONS = ("install", "uninstall", "query")  # --shell-completion's subcommands, given as overrides
ARGV, CONFIG = "argv", "config"  # what a refusal reads: the command line before Hydra starts, or Hydra's config


@dataclass(frozen=True)
class Composed:
    """A run's config as Hydra composed it (its hydra node too), and whether the run is a sweep (-m)."""
    config: DictConfig
    multirun: bool

    def named(self, key: str) -> bool:
        """Whether the command line names key, a Hydra setting (hydra.run.dir) or kvgpt's (runs_dir)."""
        overrides = self.config.hydra.overrides
        return key in named_keys(overrides.hydra if key.startswith("hydra.") else overrides.task)

    def runs_dir_overruled(self, key: str) -> bool:
        """Whether runs_dir is named beside key (hydra.run.dir or hydra.sweep.dir), which names the folder runs_dir
        would hold, without ${runs_dir} in it."""
        section, name = key.rsplit(".", 1)
        unresolved = OmegaConf.to_container(OmegaConf.select(self.config, section), resolve=False)[name]
        return self.named("runs_dir") and self.named(key) and "${runs_dir}" not in str(unresolved)


@dataclass(frozen=True)
class Refusal:
    """One flag or setting that cannot apply: what it is, what it reads (ARGV: the flags, an argparse.Namespace;
    CONFIG: a Composed), when it cannot apply, what it says (a template of facts()'s names) and a command it
    refuses (the tests run each)."""
    what: str
    reads: str
    cannot_apply: Callable[[argparse.Namespace | Composed], bool]
    says: str
    example: tuple[str, ...]


def commands(flags: argparse.Namespace) -> list[str]:
    """The flags given that each say what train.py does: --run, --multirun, --cfg, --info, --shell-completion."""
    return [f"--{name.replace('_', '-')}" for name in COMMANDS if getattr(flags, name) not in (None, False)]


def completions(flags: argparse.Namespace) -> list[str]:
    """--shell-completion's subcommands among the overrides: install, uninstall, query."""
    return [key for key in (override.split("=")[0] for override in flags.overrides) if key in COMPLETIONS]


def shows_help(flags: argparse.Namespace) -> bool:
    return flags.help or flags.hydra_help  # Hydra shows the help, whatever else is asked


def shown_config(flags: argparse.Namespace) -> DictConfig:
    """The config --cfg shows, composed and cut as Hydra's own --cfg does: without the hydra node (job), with it
    alone (hydra, less the help texts) or whole (all)."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=VERSION_BASE):
        config = compose(CONFIG_NAME, overrides=flags.overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(config)  # ${hydra:...} in the config resolves as it does for Hydra
    if flags.cfg == "job":
        return OmegaConf.masked_copy(config, [key for key in config if key != "hydra"])
    if flags.cfg == "hydra":
        return OmegaConf.create({"hydra": OmegaConf.masked_copy(
            config.hydra, [key for key in config.hydra if key not in ("help", "hydra_help")])})
    return config


def names_nothing(flags: argparse.Namespace) -> bool:
    """Whether --package names no part of the config --cfg shows (`_global_` names the whole of it)."""
    if flags.config_path or flags.config_name or flags.config_dir:
        return False  # another config than kvgpt's: Hydra composes it, and tells of a package it lacks
    return flags.package != "_global_" and OmegaConf.select(shown_config(flags), flags.package) is None


REFUSALS = (
    Refusal("--experimental-rerun", ARGV, lambda f: f.experimental_rerun is not None,
            "--experimental-rerun reruns a job from a pickle that train.py never saves; continue a run with "
            "train.resume=RUN", ("--experimental-rerun", "x.pickle")),
    Refusal("--package", ARGV, lambda f: f.package is not None and f.cfg is None,
            "--package applies to --cfg, which shows that part of the config; add --cfg job, or drop --package",
            ("-p", "train")),
    Refusal("--resolve", ARGV, lambda f: f.resolve and f.cfg is None and not f.help,
            "--resolve applies to --cfg and --help, which show the config; add --cfg job, or drop --resolve",
            ("--resolve",)),
    Refusal("--run, --multirun, --cfg, --info, --shell-completion", ARGV,
            lambda f: not shows_help(f) and len(commands(f)) > 1,
            "{commands} cannot go together: each says what train.py does; give one", ("--run", "-m")),
    Refusal("--shell-completion", ARGV, lambda f: not shows_help(f) and f.shell_completion and len(completions(f)) != 1,
            "--shell-completion takes one of install=SHELL, uninstall=SHELL or query=LINE, got {completions}; "
            "python train.py --hydra-help shows how", ("--shell-completion",)),
    Refusal("--package", ARGV, lambda f: not shows_help(f) and f.package is not None and names_nothing(f),
            "--package {package} names nothing the --cfg {cfg} config shows (no such section or setting, or it is "
            "null); python train.py --cfg {cfg} lists them", ("--cfg", "job", "-p", "nonexist")),
    Refusal("hydra.output_subdir", CONFIG, lambda c: c.config.hydra.output_subdir is not None,
            f"hydra.output_subdir cannot be set: a run's record is written to {RECORD}/ once its directory is "
            f"claimed", ("hydra.output_subdir=record",)),
    Refusal("hydra.job.chdir", CONFIG, lambda c: c.config.hydra.job.chdir,  # paths would be read inside the run
            "hydra.job.chdir cannot be set: paths are read from the folder you run train.py in, and the run writes "
            "only into its run directory", ("hydra.job.chdir=true",)),
    Refusal("hydra.run.dir", CONFIG, lambda c: c.multirun and c.named("hydra.run.dir"),
            "hydra.run.dir names a single run's directory, and -m runs a sweep, whose jobs go in hydra.sweep.dir; "
            "drop hydra.run.dir, or -m", ("-m", "hydra.run.dir=run")),
    Refusal("hydra.sweep.dir", CONFIG, lambda c: not c.multirun and c.named("hydra.sweep.dir"),
            "hydra.sweep.dir applies to a sweep (-m) only; name this run's directory with hydra.run.dir, or add -m",
            ("hydra.sweep.dir=sweep",)),
    Refusal("hydra.sweep.subdir", CONFIG, lambda c: not c.multirun and c.named("hydra.sweep.subdir"),
            "hydra.sweep.subdir applies to a sweep (-m) only; name this run's directory with hydra.run.dir, or add "
            "-m", ("hydra.sweep.subdir=job",)),
    Refusal("runs_dir", CONFIG, lambda c: not c.multirun and c.runs_dir_overruled("hydra.run.dir"),
            "runs_dir cannot apply: hydra.run.dir names the run's folder; drop one of them",
            ("runs_dir=runs", "hydra.run.dir=run")),
    Refusal("runs_dir", CONFIG, lambda c: c.multirun and c.runs_dir_overruled("hydra.sweep.dir"),
            "runs_dir cannot apply: hydra.sweep.dir names the sweep's folder; drop one of them",
            ("-m", "runs_dir=runs", "hydra.sweep.dir=sweep")),
)


def facts(asked: argparse.Namespace | Composed) -> dict:
    """The names a refusal's words use: each flag's value, and the commands and completions given."""
    if not isinstance(asked, argparse.Namespace):
        return {}
    return {**vars(asked), "commands": " and ".join(commands(asked)),
            "completions": " and ".join(completions(asked)) or "none"}


def refuse(reads: str, asked: argparse.Namespace | Composed) -> None:
    """Raise the first refusal, of those that read what `reads` names, that cannot apply to what is asked."""
    for refusal in REFUSALS:
        if refusal.reads == reads and refusal.cannot_apply(asked):
            error = UsageError if reads == ARGV else ConfigError  # a flag, or a setting
            raise error(refusal.says.format_map(facts(asked)))


class FlagParser(argparse.ArgumentParser):
    """A mistake in the flags is one line, not argparse's usage block."""

    def error(self, message):
        raise UsageError(f"{message}; python train.py --help lists the flags, which go before the overrides")


def read_flags(argv: list[str]) -> argparse.Namespace:
    """The flags of argv (--cfg, -m, --info, ...) and its overrides, each flag refused here that cannot apply."""
    parser = FlagParser(add_help=False, prog="train.py")  # Hydra shows the help
    parser.add_argument("overrides", nargs="*")
    for names, options in HYDRA_FLAGS:
        parser.add_argument(*names, **options)
    flags = parser.parse_args(argv)
    refuse(ARGV, flags)
    return flags


class RefuseSettings(Callback):
    """conf/config.yaml's first hydra callback: refuses the Hydra settings that cannot apply to the run, or to the
    sweep, before any folder is made for it."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self.refuse(Composed(config, multirun=False))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.refuse(Composed(config, multirun=True))

    @staticmethod
    def refuse(composed: Composed) -> None:
        try:
            refuse(CONFIG, composed)
        except Exception as e:  # Hydra would turn an exception raised here into a warning, and run on
            fail("train.py", e, speak=is_rank_zero())


class RaisingHandler(logging.StreamHandler):
    """A handler whose failed write is raised, where logging's own print a traceback for each record and go on: a
    closed pipe then ends --info quietly, and a full disk is one line."""

    def handleError(self, record):
        error = sys.exc_info()[1]  # emit() calls this while handling the error
        if isinstance(error, OSError) and not isinstance(error, BrokenPipeError):
            raise unwritable_output(error) from None
        raise error


@contextlib.contextmanager
def info_written(flags: argparse.Namespace):
    """For the length of --info, whose text Hydra writes through its loggers: their records go to standard output
    through a RaisingHandler, and no further (Hydra adds its own handler, which would go on, to the root)."""
    if flags.info is None:
        yield
        return
    hydra_logger = logging.getLogger("hydra")
    handler = RaisingHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))  # as Hydra's own handler writes --info
    propagated = hydra_logger.propagate
    hydra_logger.addHandler(handler)
    hydra_logger.propagate = False
    try:
        yield
    finally:
        hydra_logger.propagate = propagated
        hydra_logger.removeHandler(handler)
