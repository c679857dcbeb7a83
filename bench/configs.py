"""The configs the benchmarks measure, composed from conf/ exactly as train.py composes them."""

import dataclasses
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from data import SHAKESPEARE, PreparedData, prepare_shakespeare  # noqa: E402
from model import GPTConfig  # noqa: E402
from runtime.errors import fail, mistakes  # noqa: E402
from training.config import Settings, register, validate  # noqa: E402

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
    """tiny_shakespeare, prepared where train.py prepares it (downloaded on first use)."""
    return prepare_shakespeare(Path(settings("preset=cpu").data.root) / SHAKESPEARE)


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


def run_tool(main) -> None:
    """Run a benchmark's main as the entry points run theirs: a mistake (a missing checkpoint, a bad option) is one
    line on stderr with status 2, never a traceback."""
    try:
        main()
    except (*mistakes(), OSError, KeyboardInterrupt) as e:
        fail(Path(sys.argv[0]).name, e)
