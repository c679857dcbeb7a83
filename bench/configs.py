"""The configs the benchmarks measure, composed from conf/ exactly as train.py composes them."""

import argparse
import dataclasses
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from data import SHAKESPEARE, PreparedData, prepare_shakespeare  # noqa: E402
from model import GPTConfig, build_model, new_cache  # noqa: E402
from model.serving.engine import check_servable  # noqa: E402
from runtime.devices import choose_device, threads_refused  # noqa: E402
from runtime.command import run_command  # noqa: E402
from runtime.errors import USAGE, UsageError, mistakes, one_line, positive_int  # noqa: E402
from runtime.files import cannot_write_atomically, special_kind  # noqa: E402
from training.config import MAX_TRAINING_SEED, Settings, register, validate  # noqa: E402

TINY_SHAKESPEARE_VOCAB_SIZE = 65  # its distinct characters; the data itself is not needed to time a model
MODEL_SHAPES = sorted(path.stem for path in (REPO / "conf" / "model").glob("*.yaml"))  # model=<shape> choices


def compose_config(*overrides: str) -> DictConfig:
    register()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def settings(*overrides: str) -> Settings:
    return validate(compose_config(*overrides))


def model_config(shape: str, vocab_size: int = TINY_SHAKESPEARE_VOCAB_SIZE) -> GPTConfig:
    """conf/model/<shape>.yaml as a GPTConfig."""
    return dataclasses.replace(settings("preset=cpu", f"model={shape}").model, vocab_size=vocab_size)


def shakespeare() -> PreparedData:
    """tiny_shakespeare, prepared where the benchmarks' train.py runs (in the repository) prepare it, wherever the
    benchmark runs from (downloaded on first use)."""
    return prepare_shakespeare(REPO / settings("preset=cpu").data.root / SHAKESPEARE)


def host() -> str:
    """The processor, as lscpu names it, its family and its widest vector instructions (hosts of one name, such as
    "AMD EPYC", differ there, and in speed): every figure is printed beside it."""
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in lines)}
        flags = fields.get("Flags", "").split()
        vector = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags), None)
        family = f", family {fields['CPU family']}" if "CPU family" in fields else ""
        return fields["Model name"] + family + (f" ({vector})" if vector else "")
    except (OSError, KeyError):
        return "unknown host"


def median_spread(values, digits: int = 2) -> str:
    """The median of values, then their lowest and highest: `299.0 (293.0-306.0)`, as every table prints them."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def present_device(text: str) -> str:
    """An argparse type: a device present on this machine (cpu, cuda, mps or auto)."""
    try:
        return str(choose_device(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def integer_in(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high], or at least low where high is None."""
    what = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    return parse


training_seed = integer_in(0, MAX_TRAINING_SEED)  # a seed train.py takes
count = integer_in(0)


def thread_count(text: str) -> int:
    """An argparse type: a thread count that train.py and sample.py would start (runtime/devices.py)."""
    threads = positive_int(text)
    if why := threads_refused(threads):
        raise argparse.ArgumentTypeError(why)
    return threads


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text!r}")
    return value


def png_file(text: str) -> Path:
    """An argparse type: a .png file that can be written now, in a folder that exists."""
    path = Path(text)
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"{text} is not a .png file name; give one that ends in .png")
    if special_kind(path):
        raise argparse.ArgumentTypeError(f"{text} is {special_kind(path)}; give a file name")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {path.parent} to write {path.name} in; make it first")
    if error := cannot_write_atomically(path):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {one_line(error)}")
    return path


def check_program(option: str, path: str) -> None:
    """Refuse, before any run starts, a program to run (another environment's python) that is no file this user
    may execute: a UsageError naming option."""
    program = Path(path)
    why = ("does not exist" if not program.exists() else "is a folder" if program.is_dir() else
           "is not a file" if not program.is_file() else None if os.access(program, os.X_OK) else
           "is not executable")
    if why:
        raise UsageError(f"{option} {path} {why}; name the python of that environment (its bin/python)")


def check_servable_model(option: str, model) -> None:
    """Refuse, before a server starts, a model that serve.py's engine cannot serve (check_servable, the check
    serve.py makes): a UsageError naming option."""
    try:
        check_servable(model)
    except ValueError as e:
        raise UsageError(f"{option}: {e}; serve.py and its engine serve no such model, sample.py decodes it") \
            from None


def check_room(option: str, new: int, block_size: int, prompt: int = 1) -> None:
    """Refuse new tokens that leave a prompt of `prompt` tokens no room in the model's context, which serve.py and
    the engine refuse: a UsageError naming option."""
    room = block_size - prompt
    if new > room:
        what = "a prompt" if prompt == 1 else f"the prompt's {prompt} tokens"
        advice = f"give at most {room}" if room >= 1 else f"give a checkpoint whose block_size is above {prompt}"
        raise UsageError(f"{option} {new} leaves no room for {what} in block_size={block_size}; {advice}")


def check_training(option: str, *overrides: str) -> None:
    """Refuse, before any run starts, train.py overrides that train.py would refuse: a UsageError naming option."""
    try:
        settings("preset=cpu", *overrides)
    except mistakes() as e:
        raise UsageError(f"{option}: {one_line(e)}") from None


def check_cache(option: str, cache: str, *overrides: str) -> None:
    """Refuse, before any run starts, a KV cache by name (model/caches/factory.py) that the model train.py would
    train with these overrides cannot hold: a UsageError naming option."""
    config = dataclasses.replace(settings("preset=cpu", *overrides).model, vocab_size=TINY_SHAKESPEARE_VOCAB_SIZE)
    try:
        new_cache(build_model(config), cache, 1)
    except ValueError as e:
        raise UsageError(f"{option}: {one_line(e)}") from None


def training_failed(what: str, result: subprocess.CompletedProcess) -> BaseException:
    """A train.py (or serve.py) run that failed, as the error to raise: status 2 where it found a mistake, else 1;
    its last line of stderr, its own one-line error, says why."""
    lines = result.stderr.strip().splitlines()
    message = f"{what} failed: {lines[-1] if lines else f'exit status {result.returncode}'}"
    if result.returncode == USAGE:
        return UsageError(message)
    return SystemExit(f"{Path(sys.argv[0]).name}: error: {message}")


def run_tool(main) -> None:
    """Run a benchmark's main as the entry points run theirs (runtime/command.py): a mistake (a missing checkpoint,
    a bad option) is one line on stderr with status 2, never a traceback."""
    run_command(Path(sys.argv[0]).name, main)
