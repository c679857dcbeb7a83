"""bench/: each figure the benchmarks share has one home, a recipe overrides only what differs from the preset it
starts from, and the training throughput is that of train.py's own step."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from bench.configs import REPO, compose_config, settings
from bench.train_quality import ADAMW_RECIPE, run
from bench.train_throughput import measure
from test_train import TINY, data_overrides
from training.loop import Trainer
from model.caches.factory import new_kv_cache

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow


def test_each_constant_is_assigned_in_one_file():
    """A figure two benchmarks share (the tokens decoded, the repository's folder) is defined once, imported
    elsewhere."""
    homes = {}
    for path in sorted((REPO / "bench").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            for target in node.targets if isinstance(node, ast.Assign) else []:
                if isinstance(target, ast.Name) and target.id.isupper():
                    homes.setdefault(target.id, []).append(path.name)
    assert {name: files for name, files in homes.items() if len(files) > 1} == {}


@pytest.mark.parametrize("override", ADAMW_RECIPE)
def test_adamw_recipe_overrides_only_what_differs_from_the_cpu_preset(override):
    assert compose_config("preset=cpu", override) != compose_config("preset=cpu")


def test_train_throughput_times_train_pys_own_step(monkeypatch, tmp_path: Path):
    taken = []
    train_step = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self: taken.append(self.step) or train_step(self))
    shape = settings(*TINY, "train.precision=bf16", *data_overrides(tmp_path / "data"))
    tokens_per_s, _, precision = measure(shape, train.prepare_data(shape), torch.device("cpu"), warmup=1, steps=2)
    assert taken == [0, 1, 2] and tokens_per_s > 0 and precision == "bf16"


def test_a_candidate_may_be_named_with_commas_and_spaces(tmp_path: Path):
    """Its run directory is named after it, and Hydra reads `a,b` in an override as a list: the name is made plain."""
    named_here = ("preset=", "train.max_iters=", "train.eval_interval=", "optim.warmup_iters=")  # run() names preset
    overrides = [o for o in TINY if not o.startswith(named_here)] + \
        ["train.max_iters=4", "train.eval_interval=2", "optim.warmup_iters=1", *data_overrides(tmp_path / "data")]
    outcome = run("4 layers, batch 8", overrides, seed=1, eval_interval=None, workdir=tmp_path, threads=1)
    assert [row["step"] for row in outcome["curve"]] == [0, 2, 4]
    assert outcome["trained"] == "2L, batch 8, 1 thr"  # as the checkpoint records them


@pytest.mark.parametrize("script, args, fragments", [
    ("decode.py", ["--repeats", "0"], ["--repeats", "must be an integer >= 1, got 0"]),
    ("decode.py", ["--checkpoint", "MISSING"], ["--checkpoint", "no checkpoint at"]),
    ("speculative.py", ["--checkpoint", "MISSING"], ["--checkpoint", "no checkpoint at"]),
    ("gpu_decode.py", [], ["--device cuda: no CUDA device here"]),  # the suite hides the GPU
    ("speculative.py", ["--ceiling-only", "--new-tokens", "-5"], ["--new-tokens", "got -5"]),
    ("rolling.py", ["--repeats", "many"], ["--repeats", "got 'many'"]),
    ("kv_designs.py", ["speed", "--repeats", "0"], ["--repeats", "got 0"]),
    ("kv_budget.py", ["--checkpoint", "MISSING"], ["--checkpoint", "no checkpoint at"]),
    ("kv_budget.py", ["--caches", "int3"], ["--caches", "'int3'"]),
    ("kv_budget.py", ["--budgets", "0.5", "2"], ["--budgets", "must be a fraction of block_size in (0, 1], got 2"]),
    ("kv_budget.py", ["--budgets", "0"], ["--budgets", "must be a fraction of block_size in (0, 1], got 0"]),
    ("sample_speed.py", ["--repeats", "0"], ["--repeats", "got 0"]),
    ("start_up.py", ["--checkpoint", "MISSING"], ["--checkpoint", "no checkpoint at"]),
    ("step_paths.py", ["--shape", "huge"], ["--shape", "'huge'"]),
    ("train_throughput.py", ["--steps", "0"], ["--steps", "got 0"]),
])
def test_a_benchmark_given_a_mistake_says_so_in_one_line_with_status_2(tmp_path, script, args, fragments):
    """The benchmarks are tools people run: a mistake is one line, found before any timing, never a traceback."""
    args = [str(tmp_path / "none.pt") if a == "MISSING" else a for a in args]
    result = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(script) and ": error: " in lines[0], result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("args, fragment", [(["0"], "minutes must be a whole number above 0, got '0'"),
                                             ([], "finds no CUDA device")])  # the suite hides the GPU
def test_the_gpu_proof_refuses_in_one_line_with_status_2_before_any_work(tmp_path, args, fragment):
    result = subprocess.run(["bash", str(REPO / "bench" / "gpu_proof.sh"), *args], capture_output=True, text=True,
                            env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith("gpu_proof.sh: error: ") and fragment in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1


def test_the_kv_budget_harness_measures_a_cache_against_the_float_one():
    """KL written as torch's kl_div computes it, top-1 agreement, loss by distance: zero KL for the float cache
    against itself, some for a 2-bit one, and the loss through the decoder that decoder_loss gives."""
    from bench.kv_budget import compare, stream_log_probs
    from model.measuring.decoder_loss import decoder_loss
    from model.caches.lowbit import new_lowbit_cache
    from tiny_models import random_model, random_tokens
    from tolerance import gamma, mean_rtol
    model = random_model(pos_emb="rope")
    block = model.config.block_size
    tokens, prompt_len = random_tokens(3, 9 * block + 4), 5
    targets = tokens[:, prompt_len:]
    reference = stream_log_probs(model, tokens, new_kv_cache(model, 3), prompt_len)
    same = compare(reference, reference, targets, prompt_len, block)
    assert same["kl_mean"] == 0 and same["top1"] == 1
    # the same cross-entropies, averaged in other orders (tests/tolerance.py: mean_rtol)
    assert same["loss"] == pytest.approx(decoder_loss(model, tokens, prompt_len=prompt_len),
                                         rel=mean_rtol(targets.numel()))
    assert same["loss@8x"] == pytest.approx(-reference[:, 8 * block - prompt_len:9 * block - prompt_len].gather(
        -1, targets[:, 8 * block - prompt_len:9 * block - prompt_len, None]).mean().item(), rel=mean_rtol(3 * block))
    lossy = stream_log_probs(model, tokens, new_lowbit_cache(model, 3, 2, group=8, residual=8), prompt_len)
    figures = compare(reference, lossy, targets, prompt_len, block)
    kl = torch.nn.functional.kl_div(lossy, reference, log_target=True, reduction="none").sum(-1)
    # each step's KL, a sum of terms of either sign (an exp, a difference, a product, vocab terms), then their mean
    terms = (reference.double().exp() * (reference.double() - lossy.double())).abs().sum(-1)
    tol = 2 * gamma(reference.size(-1) + 4) * terms.mean().item() + mean_rtol(kl.numel()) * kl.abs().mean().item()
    assert figures["kl_mean"] == pytest.approx(kl.mean().item(), rel=0, abs=tol) and figures["kl_mean"] > 1e-3
    assert figures["kl_p99"] >= figures["kl_mean"] and 0 < figures["top1"] < 1


def test_the_recall_task_repeats_its_string_at_the_end_and_scores_only_the_repeat():
    from bench.kv_budget import RECALL_AT, RECALL_CUE, RECALL_LEN, recall, recall_text
    block, letters = 64, [3, 4, 5, 6]
    tokens = recall_text(torch.arange(1000) % 50 + 10, letters, rows=3, block_size=block)
    assert tokens.shape == (3, block)
    assert torch.equal(tokens[:, RECALL_AT:RECALL_AT + RECALL_LEN], tokens[:, -RECALL_LEN:])
    assert set(tokens[:, -RECALL_LEN:].flatten().tolist()) <= set(letters)
    assert torch.equal(tokens[:, :RECALL_AT], (torch.arange(3 * block) % 50 + 10).view(3, block)[:, :RECALL_AT])
    # log-probabilities sure of the text's own next token everywhere but the scored letters
    log_probs = torch.full((3, block - RECALL_AT, 60), -20.0)
    log_probs.scatter_(-1, tokens[:, RECALL_AT:, None], 0.0)
    assert recall(log_probs, tokens, RECALL_AT) == (0.0, 1.0)
    scored = slice(block - RECALL_LEN + RECALL_CUE - RECALL_AT, None)
    log_probs[:, scored] = torch.full((60,), -60.0).log_softmax(-1)  # uniform over the scored letters only
    loss, top1 = recall(log_probs, tokens, RECALL_AT)
    assert loss == pytest.approx(torch.tensor(60.0).log().item()) and top1 < 0.2
