"""training/config.py: typed settings whose ranges are checked before any work, with and without hydra."""

import math

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from training.config import ConfigError, OptimConfig, TrainConfig, explained, register, validate

from test_train import REPO


def composed(*overrides):
    register()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=["preset=cpu", *overrides])


BUDGET_RULE = "a positive number of minutes up to 525,600 (a year), or null"


@pytest.mark.parametrize("override, message", [
    ("train.max_iters=0", "train.max_iters must be a positive integer, or null for a budget, got 0"),
    ("train.max_minutes=0", f"train.max_minutes must be {BUDGET_RULE}, got 0"),
    ("train.max_minutes=inf", f"train.max_minutes must be {BUDGET_RULE}, got inf"),
    ("train.max_minutes=1e307", f"train.max_minutes must be {BUDGET_RULE}, got 1e+307"),
    ("train.max_minutes=525601", f"train.max_minutes must be {BUDGET_RULE}, got 525601"),
    ("train.max_minutes=nan", f"train.max_minutes must be {BUDGET_RULE}, got nan"),
    ("preset=gpu train.max_iters=null", "train.max_iters is null and so is max_minutes: set the steps"),
    ("train.seed=-1", "train.seed must be an integer in [0, 4294967295], got -1"),
    ("train.seed=4294967296", "train.seed must be an integer in [0, 4294967295]"),
    ("train.sample_prompt=''", "train.sample_prompt must be at least one character"),
    ("train.ema_decay=0", "train.ema_decay must be in (0, 1), or null for no average, got 0.0"),
    ("optim.min_lr=1", "optim.min_lr must be in [0, lr="),
    ("optim.beta2=1.0", "optim.beta2 must be in [0, 1)"),
    ("optim.grad_clip=0", "optim.grad_clip must be a positive number"),
    # float32, where the optimisers step, rounds these to 0 or to inf
    ("optim.lr=1e300", "optim.lr must be a positive number from 1.18e-38 to 3.4e+38, got 1e+300"),
    ("optim.lr=1e-50", "optim.lr must be a positive number from 1.18e-38 to 3.4e+38, got 1e-50"),
    ("optim=muon optim.muon_lr=1e39", "optim.muon_lr must be a positive number from 1.18e-38 to 3.4e+38"),
    ("optim.grad_clip=1e-300", "optim.grad_clip must be a positive number of at least 1.18e-38 (inf: no clipping)"),
    ("optim.lr=0.01 optim.weight_decay=1e300", "optim.weight_decay must be in [0, 1/lr = 100], got 1e+300"),
    ("optim.name=sgd", "optim.name must be one of"),
    ("train.max_iters=1000 optim.warmup_iters=1000", "optim.warmup_iters must be below train.max_iters=1000"),
    ("optim.decay_frac=0", "optim.decay_frac must be in (0, 1], got 0"),
    ("optim.decay_frac=1.5", "optim.decay_frac must be in (0, 1], got 1.5"),
    ("optim.warmup_iters=0 optim.decay_frac=1", "train.max_minutes fixes the run's length from the steps taken "
                                                "before the learning rate decays, and this schedule decays from the "
                                                "first: set optim.warmup_iters above 0 or optim.decay_frac below 1"),
    ("model.n_head=5", "model: n_embd 128 is not divisible by n_head 5"),
])
def test_a_bad_value_is_one_line_naming_the_setting(override, message):
    with pytest.raises(ConfigError) as caught:
        validate(composed(*override.split()))
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


@pytest.mark.parametrize("override", ["train.max_iters=many", "data.val_fraction=abc", "runs_dir=null",
                                      "train.compile=maybe"])
def test_a_value_of_the_wrong_type_is_refused_when_composed(override):
    with pytest.raises((HydraException, OmegaConfBaseException)):  # train.py reports either in one line
        composed(override)


@pytest.mark.parametrize("override, key", [("+devise=cpu", "devise"), ("+train.new_key=1", "train.new_key"),
                                           ("+model.n_layr=3", "model.n_layr")])
def test_a_key_added_past_the_schema_is_refused(override, key):
    """Hydra's `+` adds a key that no setting has; the schema refuses it rather than train with it ignored."""
    with pytest.raises(ConfigError, match=f"^{key} is not a setting; "):
        validate(composed(override))


@pytest.mark.parametrize("override, message", [
    ("train.max_iter=5", "train.max_iter is not a setting; did you mean train.max_iters?"),
    ("optim.muon_lrr=0.1", "optim.muon_lrr is not a setting; did you mean optim.muon_lr?"),
    ("train.lr=0.1", "train.lr is not a setting; did you mean optim.lr?"),  # the same name in another section
    ("modle.n_layer=2", "modle is not a setting; did you mean model?"),
    ("~train.max_iter", "train.max_iter is not a setting; did you mean train.max_iters?"),
    ("train.epochs=3", "train.epochs is not a setting; python train.py --cfg job lists them"),  # nothing near
])
def test_a_mistyped_setting_is_one_line_naming_the_nearest(override, message):
    """train.py reports Hydra's error for an override as explained() turns it."""
    with pytest.raises(HydraException) as caught:
        composed(override)
    assert str(explained(caught.value)) == message


def test_infinite_grad_clip_turns_clipping_off():
    assert validate(composed("optim.grad_clip=inf")).optim.grad_clip == math.inf


def test_the_dataclasses_check_their_ranges_without_hydra():
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="lr must be a positive number"):
        OptimConfig(lr=-1.0)
    assert TrainConfig().max_iters == 5000 and OptimConfig().name == "adamw"


@pytest.mark.parametrize("overrides, named, length", [
    ([], set(), (None, 5.0)),  # the cpu preset's budget
    (["preset=gpu"], set(), (5000, None)),  # the gpu preset's steps
    (["train.max_iters=200"], {"train.max_iters"}, (200, None)),
    (["preset=gpu", "train.max_minutes=10"], {"train.max_minutes"}, (None, 10.0)),
    (["preset=gpu", "train.max_minutes=10", "train.max_iters=null"], {"train.max_minutes", "train.max_iters"},
     (None, 10.0)),
    (["train.max_iters=200", "train.max_minutes=null"], {"train.max_iters", "train.max_minutes"}, (200, None)),
    (["train.max_iters=200"], None, (200, None)),  # without a command line, the steps set decide
])
def test_the_length_named_on_the_command_line_wins_over_the_presets(overrides, named, length):
    train = validate(composed(*overrides), named).train
    assert (train.max_iters, train.max_minutes) == length


def test_naming_both_steps_and_a_budget_is_refused():
    with pytest.raises(ConfigError, match=r"^train.max_iters=200 and train.max_minutes=3.0 both say how long to "
                                          r"train; name one of them$"):
        validate(composed("train.max_iters=200", "train.max_minutes=3"), {"train.max_iters", "train.max_minutes"})
