"""The GPU's code paths run on the CPU: bf16 autocast and KV cache, fused AdamW, precision choice, the gpu preset."""

import dataclasses
import math

import pytest
import torch
from hydra import compose, initialize_config_dir

import train
from model import GREEDY, build_model, generate
from test_train import config, data_overrides
from tiny_models import random_model, random_tokens
from training.config import ConfigError, OptimConfig, validate
from runtime.devices import training_dtype
from training.loop import Trainer
from training.optim import make_optimizers
from model.caches.factory import new_kv_cache
from programs import REPO, SHORT, data_root, model


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32 activations", "bf16 autocast"])
def test_a_bf16_kv_cache_beside_fp32_weights_decodes_the_same_tokens(model, autocast):
    prompt = random_tokens(2, 5)
    uncached = generate(model, prompt, 40, sampling=GREEDY, use_cache=False)  # fp32 throughout
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        cache = new_kv_cache(model, 2, dtype=torch.bfloat16)
        cached = generate(model, prompt, 40, sampling=GREEDY, cache=cache)
    assert cache.dtype == torch.bfloat16 and model.wte.weight.dtype == torch.float32
    assert torch.equal(cached, uncached)  # bf16's rounding does not change this model's argmax


def test_fused_adamw_steps_like_the_unfused_one():
    models = [random_model(seed=1) for _ in range(2)]
    optimizers = [make_optimizers(m, OptimConfig(lr=1e-2), fused=fused)[0] for m, fused in zip(models, (False, True))]
    assert optimizers[1].defaults["fused"] is True
    losses = [[], []]
    for _ in range(3):
        for m, optimizer, trajectory in zip(models, optimizers, losses):
            m.train()
            _, loss = m(random_tokens(4, 8), random_tokens(4, 8, seed=1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            trajectory.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    # The matrices only: the keys' bias has a zero gradient in exact arithmetic (softmax ignores a shift shared
    # by every key), so Adam scales rounding noise there, differently in each implementation.
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        if a.dim() >= 2:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_training_step_and_an_evaluation_in_each_precision(tmp_path, data_root, precision):
    settings = validate(config(tmp_path, data_root, *SHORT, f"train.precision={precision}"))
    data = train.prepare_data(settings)
    model = build_model(dataclasses.replace(settings.model, vocab_size=len(data.vocab)))

    class NoSummaries:
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    trainer = Trainer(settings, model, data, torch.device("cpu"), tmp_path, NoSummaries())
    logits_dtypes = []
    model.register_forward_hook(lambda module, args, out: logits_dtypes.append(out[0].dtype))
    trainer.train_step()
    trainer.train_step()
    trainer.evaluate_and_save()
    expected = torch.bfloat16 if precision == "bf16" else torch.float32
    assert trainer.dtype == expected and set(logits_dtypes) == {expected}  # the steps and evaluation alike
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the weights stay fp32
    assert math.isfinite(trainer.last_val_loss) and trainer.last_val_loss < math.log(65) + 0.5
    assert torch.load(tmp_path / "last.pt", weights_only=True)["training"]["step"] == 2


@pytest.mark.parametrize("device, native_bf16, expected", [
    ("cuda", False, torch.bfloat16), ("cpu", True, torch.bfloat16), ("cpu", False, torch.float32),
    ("mps", True, torch.float32)])
def test_auto_precision_is_bf16_on_a_gpu_and_on_a_cpu_that_multiplies_bf16_natively(monkeypatch, device, native_bf16,
                                                                                     expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert training_dtype("auto", torch.device(device)) == expected
    assert training_dtype("fp32", torch.device(device)) == torch.float32


def test_bf16_training_on_mps_is_refused_in_one_line(tmp_path, data_root):
    settings = validate(config(tmp_path, data_root, *SHORT, "train.precision=bf16"))
    data = train.prepare_data(settings)
    model = build_model(dataclasses.replace(settings.model, vocab_size=len(data.vocab)))
    with pytest.raises(ConfigError, match="^train.precision=bf16 trains on cuda and cpu only; on mps use fp32"):
        Trainer(settings, model, data, torch.device("mps"), tmp_path, None)


@pytest.mark.slow
def test_the_gpu_preset_compiled_trains_a_few_steps_at_a_tiny_size(tmp_path, data_root):
    tiny_gpu = ["preset=gpu", "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=16",
                "train.batch_size=4", "train.sample_tokens=4", *SHORT]
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*tiny_gpu, *data_overrides(data_root), f"runs_dir={tmp_path / 'runs'}"])
    assert cfg.train.compile is True
    val_loss = train.main(cfg, tmp_path / "runs/gpu")
    assert math.isfinite(val_loss)
    assert torch.load(tmp_path / "runs/gpu/last.pt", weights_only=True)["training"]["step"] == 4
