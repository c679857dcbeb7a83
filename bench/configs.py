"""The configs the benchmarks measure, composed from conf/ exactly as train.py composes them."""

import argparse
import dataclasses
import math
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
from runtime.devices import choose_device, threads_refused  # noqa: E402
from runtime.errors import USAGE, UsageError, fail, mistakes, one_line, positive_int  # noqa: E402
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
    """A train.py run that failed, as the error to raise: status 2 where train.py found a mistake, else 1."""
    lines = result.stderr.strip().splitlines()
    message = f"{what} failed: {lines[-1] if lines else f'exit status {result.returncode}'}"
    if result.returncode == USAGE:
        return UsageError(message)
    return SystemExit(f"{Path(sys.argv[0]).name}: error: {message}")


def run_tool(main) -> None:
    """Run a benchmark's main as the entry points run theirs: a mistake (a missing checkpoint, a bad option) is one
    line on stderr with status 2, never a traceback."""
    try:
        main()
    except (*mistakes(), OSError, KeyboardInterrupt) as e:
        fail(Path(sys.argv[0]).name, e)
