"""The training settings as typed dataclasses: hydra checks their types, __post_init__ their ranges.

conf/ holds the named choices (model shapes, optimisers, presets); the defaults of everything else are here.
`register()` makes these the schema that conf/config.yaml composes onto, and `validate()` turns a composed
config into checked objects before any work is done.
"""

import dataclasses
import difflib
import re
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from data import DATASETS, VAL_FRACTION
from model import GPTConfig
from model.checks import FLOAT32_MAX, FLOAT32_RANGE, FLOAT32_TINY
from model.designs.layers import check_design
from runtime.devices import choose_device, environment_threads, threads_refused
from runtime.errors import ConfigError, one_line


OPTIMIZERS = ("adamw", "muon")
DECAYS = ("cosine", "linear")
MAX_BUDGET_MINUTES = 60 * 24 * 365  # a year: a longer budget is a mistake, and 1e307 minutes are infinite seconds
TRAINING_PRECISIONS = ("auto", "bf16", "fp32")  # how training computes: runtime/devices.py, training_dtype()
MAX_TRAINING_SEED = 2**32 - 1  # numpy's and CUDA's generators take 32-bit seeds


def _require(owner, ok, what: str, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not ok(value):
            raise ValueError(f"{name} must be {what}, got {value!r}")


@dataclass
class DataConfig:
    text: str | None = None  # a UTF-8 text file of your own to train on; None: tiny_shakespeare (downloaded)
    root: str = DATASETS  # prepared data goes in root/tiny_shakespeare/, or root/<text's name>-<its hash>/
    val_fraction: float = VAL_FRACTION  # the last 10% of the text; data/ checks it when it reads the text

    def __post_init__(self):  # an empty path is the working folder: never what was meant
        _require(self, lambda v: v is None or str(v).strip(), "a text file's path, or left out for tiny_shakespeare",
                 "text")
        _require(self, lambda v: str(v).strip(), "a folder's path", "root")


@dataclass
class OptimConfig:
    """A linear warm-up to lr, then a cosine or linear decay to min_lr at train.max_iters: over every step after
    the warm-up, or with decay_frac below 1 over the last decay_frac of the steps, the rate held at its peak
    until then (warm-up, stable, decay)."""

    name: str = "adamw"  # the optim group's choice: adamw, or muon for the blocks' matrices and adamw for the rest
    lr: float = 1e-3  # AdamW's peak

    min_lr: float = 1e-4
    warmup_iters: int = 100
    decay: str = "cosine"  # or linear
    decay_frac: float = 1.0  # the share of train.max_iters the decay takes (at most all steps after the warm-up)
    beta1: float = 0.9
    beta2: float = 0.99  # not the usual 0.999, as in nanoGPT's shakespeare-char recipe
    weight_decay: float = 0.1  # on matrices and embeddings only, never on biases and LayerNorm gains
    grad_clip: float = 1.0  # largest global gradient norm; inf turns clipping off (the norm is still logged)
    muon_lr: float = 0.02  # Muon's peak (optim=muon only), decayed like lr
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1  # decoupled, on the matrices Muon updates

    def __post_init__(self):
        _require(self, lambda v: v in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}", "name")
        # the optimisers step in float32, where a smaller rate rounds to 0 and a larger to inf
        _require(self, lambda v: FLOAT32_TINY <= v <= FLOAT32_MAX, f"a positive number from {FLOAT32_RANGE}", "lr",
                 "muon_lr")
        _require(self, lambda v: 0 <= v <= self.lr, f"in [0, lr={self.lr}]", "min_lr")
        _require(self, lambda v: v >= 0, "a non-negative integer", "warmup_iters")
        _require(self, lambda v: v in DECAYS, f"one of {', '.join(DECAYS)}", "decay")
        _require(self, lambda v: 0 < v <= 1, "in (0, 1]", "decay_frac")
        _require(self, lambda v: 0 <= v < 1, "in [0, 1)", "beta1", "beta2")
        # a step scales the weights by 1 - lr * weight_decay: below 0 it flips them, soon to float32's inf
        _require(self, lambda v: 0 <= v <= 1 / self.lr, f"in [0, 1/lr = {1 / self.lr:g}]", "weight_decay")
        _require(self, lambda v: v >= FLOAT32_TINY, f"a positive number of at least {FLOAT32_TINY:.3g} (inf: no "
                                                     f"clipping)", "grad_clip")
        _require(self, lambda v: 0 <= v < 1, "in [0, 1)", "muon_momentum")
        _require(self, lambda v: 0 <= v <= 1 / self.muon_lr, f"in [0, 1/muon_lr = {1 / self.muon_lr:g}]",
                 "muon_weight_decay")
        if self.name != "muon":
            for f in dataclasses.fields(self):
                if f.name.startswith("muon_") and getattr(self, f.name) != f.default:
                    raise ValueError(f"{f.name} applies to optim=muon only; drop it or add optim=muon")


@dataclass
class TrainConfig:
    # The run's length: max_iters optimiser steps, which size the learning-rate schedule, or (max_iters null) a
    # budget of max_minutes of wall-clock time, start-up included: the run measures its speed as it trains and
    # fixes max_iters, before its learning rate decays, so that it ends within the budget (training/budget.py).
    # Set by a preset, max_iters decides (max_minutes is then null); once a budget has sized a run, both are set:
    # max_minutes records the budget that chose max_iters.
    max_iters: int | None = 5000
    max_minutes: float | None = None
    batch_size: int = 64  # sequences per micro-step and process
    grad_accum_steps: int = 1  # micro-steps per optimiser step
    eval_interval: int = 250  # steps between evaluations; each logs a sample and saves last.pt (and best.pt)
    eval_iters: int = 200  # batches per split in an evaluation
    log_interval: int = 10  # steps between progress and TensorBoard updates, the only host-device syncs
    seed: int = 1337
    compile: bool = False  # torch.compile the model
    # bf16: forward and backward under bf16 autocast (the weights, gradients and optimisers stay in float32);
    # fp32: float32 throughout; auto: bf16 on a GPU and on a CPU that multiplies bf16 natively, else fp32
    precision: str = "auto"
    threads: int | None = None  # torch's CPU threads; null: the count whose step is fastest now (training/sizing.py)
    size_to_host: bool = False  # choose model.n_layer and train.batch_size for the budget here (training/sizing.py)
    # an exponential moving average of the weights, updated after every step with this decay, is what evaluations
    # see and best.pt and last.pt hold (0.99 averages about the last 100 steps); null: the weights as trained
    ema_decay: float | None = None
    resume: str | None = None  # a run directory (continues from its last.pt) or a checkpoint file
    # end the run once val loss has not improved for this many evaluations in a row; last.pt then holds best.pt's
    # weights; null: train to the end
    patience: int | None = None
    sample_prompt: str = "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n"  # also the attention maps' input
    sample_tokens: int = 200  # characters generated after sample_prompt at each evaluation

    def __post_init__(self):
        _require(self, lambda v: v >= 1, "a positive integer", "batch_size", "grad_accum_steps", "eval_interval",
                 "eval_iters", "log_interval")
        _require(self, lambda v: v is None or v >= 1, "a positive integer, or null for a budget", "max_iters")
        _require(self, lambda v: v is None or 0 < v <= MAX_BUDGET_MINUTES,
                 f"a positive number of minutes up to {MAX_BUDGET_MINUTES:,} (a year), or null", "max_minutes")
        if self.max_iters is None and self.max_minutes is None:
            raise ValueError("max_iters is null and so is max_minutes: set the steps (max_iters) or a budget in "
                             "minutes (max_minutes)")
        _require(self, lambda v: v >= 0, "a non-negative integer", "sample_tokens")
        _require(self, lambda v: 0 <= v <= MAX_TRAINING_SEED, f"an integer in [0, {MAX_TRAINING_SEED}]", "seed")
        _require(self, lambda v: v != "", "at least one character", "sample_prompt")
        _require(self, lambda v: v is None or 0 < v < 1, "in (0, 1), or null for no average", "ema_decay")
        _require(self, lambda v: v in TRAINING_PRECISIONS, " or ".join(TRAINING_PRECISIONS), "precision")
        _require(self, lambda v: v is None or v >= 1, "a positive integer, or null for the fastest now", "threads")
        if self.threads is not None and (why := threads_refused(self.threads)):
            raise ValueError(f"threads {why}")
        _require(self, lambda v: v is None or v >= 1, "a positive integer, or null to train to the end", "patience")


@dataclass
class Config:
    model: GPTConfig = MISSING  # a conf/model choice; vocab_size comes from the data
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    device: str = "auto"  # auto: cuda, then mps, then cpu; or name one of them
    runs_dir: str = "runs"  # every run gets a directory in here


@dataclass(frozen=True)
class Settings:
    """A composed config, checked: what train.py hands to the training code."""

    model: GPTConfig  # vocab_size is a stand-in until the data is read
    data: DataConfig
    optim: OptimConfig
    train: TrainConfig
    config: dict  # the whole composed config, resolved: what checkpoints record and TensorBoard shows

    def planned(self, max_iters: int, max_minutes: float | None) -> "Settings":
        """These settings with the run's length fixed at max_iters steps, sized by a budget of max_minutes (or
        by none), as a budget or a resume fixes it."""
        return self.replaced({"train.max_iters": max_iters, "train.max_minutes": max_minutes})

    def replaced(self, values: dict) -> "Settings":
        """These settings with values ({"model.n_layer": 3, ...}) in place of their own, checked again."""
        sections, config = {}, {**self.config}
        for key, value in values.items():
            section, name = key.split(".")
            sections.setdefault(section, {})[name] = value
            config[section] = {**config[section], name: value}
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **changes)
                                            for section, changes in sections.items()}, config=config)


def register() -> None:
    """Make Config the schema of conf/config.yaml (which lists `schema` first in its defaults), each optimiser an
    option of the optim group, and `${device_preset:}` the preset for the device found (the preset's default)."""
    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    for name in OPTIMIZERS:
        store.store(group="optim", name=name, node={"name": name})
    OmegaConf.register_new_resolver(
        "device_preset", lambda: "cpu" if choose_device("auto").type == "cpu" else "gpu", replace=True)


def validate(cfg: DictConfig, named: set[str] | None = None) -> Settings:
    """Every section as its dataclass, its ranges checked, or a ConfigError naming the setting.

    named: the keys named on the command line (None: every setting in cfg is meant as it is). A run's length
    named there, as steps (train.max_iters) or as a budget (train.max_minutes), wins over the preset's."""
    cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])  # composed with or without Hydra's
    try:  # `+key=value` adds a key past the schema: Hydra lets it through, the schema refuses it here
        OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.to_container(cfg))
    except ConfigKeyError as e:
        raise unknown_setting(e.full_key) from None
    train = cfg.train
    if named is not None and "train.max_minutes" in named and train.max_minutes is not None:
        if "train.max_iters" in named and train.max_iters is not None:
            raise ConfigError(f"train.max_iters={train.max_iters} and train.max_minutes={train.max_minutes} both "
                              f"say how long to train; name one of them")
        train.max_iters = None
    if train.max_iters is not None:  # the steps decide: no budget
        train.max_minutes = None
    sections = {}
    for name in ("data", "optim", "train", "model"):
        node = cfg[name]
        if name == "model":  # the data fixes vocab_size later; a stand-in lets the shape's own checks run now
            node = OmegaConf.merge(node, {"vocab_size": 1})
        try:
            sections[name] = OmegaConf.to_object(node)
            if name == "model":
                check_design(sections[name])
        except OmegaConfBaseException as e:
            raise ConfigError(f"{name}.{e.full_key}: {one_line(e)}") from None
        except ValueError as e:
            raise ConfigError(f"{name}.{one_line(e)}" if name != "model" else f"model: {one_line(e)}") from None
    if sections["train"].threads is None:  # the run obeys OMP_NUM_THREADS then: refused before any thread starts
        environment_threads()
    config = OmegaConf.to_container(cfg, resolve=True)
    model = sections["model"]  # as GPTConfig resolved it: n_kv_head null is n_head
    config["model"] = {key: getattr(model, key) for key in config["model"]}
    settings = Settings(**sections, config=config)
    if settings.train.max_iters is not None and not settings.optim.warmup_iters < settings.train.max_iters:
        raise ConfigError(f"optim.warmup_iters must be below train.max_iters={settings.train.max_iters}, "
                          f"got {settings.optim.warmup_iters}")
    if settings.train.max_iters is None and settings.optim.warmup_iters == 0 and settings.optim.decay_frac == 1:
        raise ConfigError("train.max_minutes fixes the run's length from the steps taken before the learning rate "
                          "decays, and this schedule decays from the first: set optim.warmup_iters above 0 or "
                          "optim.decay_frac below 1")
    return settings


def setting_names(schema=Config, prefix: str = "") -> list[str]:
    """Every setting's name, as an override writes it: "device", "model", "model.n_layer", ..."""
    names = []
    for f in dataclasses.fields(schema):
        names.append(prefix + f.name)
        if dataclasses.is_dataclass(f.type):
            names += setting_names(f.type, f"{prefix}{f.name}.")
    return names


def unknown_setting(key: str) -> ConfigError:
    """The error for `key`, which names no setting, with the likeliest setting meant: one of that name in
    another section (train.lr: optim.lr), else the nearest name in the same section (train.max_iter)."""
    section, _, name = key.rpartition(".")
    names = setting_names()
    elsewhere = [full for full in names if full.rpartition(".")[2] == name]
    in_section = {full.rpartition(".")[2]: full for full in names if full.rpartition(".")[0] == section}
    meant = elsewhere or [in_section[near] for near in difflib.get_close_matches(name, in_section, n=1)]
    return ConfigError(f"{key} is not a setting; " +
                       (f"did you mean {meant[0]}?" if meant else "python train.py --cfg job lists them"))


def explained(error: BaseException) -> BaseException:
    """Hydra's error for an override that names no setting (`train.max_iter=5`, `~train.max_iter`) as
    unknown_setting's; any other error as it is."""
    if not isinstance(error, HydraException):
        return error
    cause = error.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
        return unknown_setting(cause.full_key)
    if isinstance(cause, ValidationError) and cause.full_key and "converted to Integer" in str(cause.msg):
        value = cause.value  # 1e3 arrives as 1000.0: say the integer it means
        whole = f" (write {int(value)})" if isinstance(value, float) and value.is_integer() else ""
        return ConfigError(f"{cause.full_key} must be a whole number, got {value!r}{whole}")
    deleted = re.fullmatch(r"Could not delete from config\. '(.+)' does not exist\.", str(error))
    return unknown_setting(deleted[1]) if deleted else error


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
