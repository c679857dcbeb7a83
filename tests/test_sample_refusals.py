"""sample.py's one-line refusals: weights, folders and values it cannot sample with, and samples beyond memory."""

import argparse
import math
import os
import subprocess

import pytest
import torch

from tiny_models import random_model
from runtime.checkpoint import save_checkpoint
from runtime.errors import UsageError
from model.caches.factory import new_kv_cache
from programs import ENV, assert_one_line_error, checkpoint, sample_command


def test_nan_weights_are_one_line(checkpoint, tmp_path):
    contents = torch.load(checkpoint, weights_only=True)
    contents["model"]["lm_head.weight"][3, 1] = math.nan
    path = save_checkpoint(contents, tmp_path / "nan.pt")
    result = subprocess.run(sample_command(path, "--temperature", 0), env=ENV, capture_output=True, text=True,
                            timeout=120)
    assert_one_line_error(result, "sample.py", f"{path} holds NaN or infinite weights (in wte.weight)")
    assert result.stdout == ""


def test_a_folder_of_runs_says_what_to_pass(checkpoint, tmp_path):
    for run in ("2030-01-01_00-00-00", "2030-01-02_00-00-00", "multirun/2030-01-03_00-00-00/0"):
        (tmp_path / "runs" / run).mkdir(parents=True)
        (tmp_path / "runs" / run / "best.pt").write_bytes(checkpoint.read_bytes())
    result = subprocess.run(sample_command(tmp_path / "runs"), env=ENV, capture_output=True, text=True, timeout=120)
    line = assert_one_line_error(result, "sample.py", f"{tmp_path / 'runs'} is no run directory but holds 3 below it",
                                 str(tmp_path / "runs/2030-01-01_00-00-00"), "pass one of them")
    assert "train" not in line


@pytest.mark.parametrize("args, fragments", [
    (["--seed", 10**23], ["--seed must be in [0, 18446744073709551615], got 100000000000000000000000"]),
    (["--seed", -1], ["--seed must be in [0, "]),
    (["--num-samples", 10**12], ["--num-samples 1000000000000 of", "GiB of KV cache", "use at most"]),
    (["--max-new-tokens", 10**12], ["--max-new-tokens 1000000000000 need", "ask for fewer new tokens"]),
    (["--max-new-tokens", 10**30], ["--max-new-tokens 1000000000000000000000000000000 need", "fewer new tokens"]),
    (["--max-new-tokens", 10**400], [f"--max-new-tokens {10**400} need", "GiB of KV cache", "fewer new tokens"]),
    (["--num-samples", 10**400], [f"--num-samples {10**400} of", "GiB of KV cache", "use at most"]),
    (["--temperature", 1e-38], ["temperature must be 0 (greedy) or a finite number >= 1.18e-38 (float32's "
                                "smallest normal number), got 1e-38"]),
    (["--temperature", "nan"], ["temperature must be 0 (greedy) or a finite number"]),
    (["--temperature", 0, "--top-k", 5], ["top_k and top_p apply to sampled text: temperature 0 takes the likeliest "
                                          "token whatever they keep"]),
    (["--temperature", 0, "--seed", 3], ["--seed applies to sampled text", "drop --seed, or give a temperature"]),
    (["--window", 4, "--kv-cache", "sinks", "--kv-budget", 8], ["keep applies to the float and low-bit caches, "
                                                               "whose context jumps forward; a sink cache keeps its own"]),
])
def test_sample_values_that_cannot_work_are_one_line(checkpoint, args, fragments):
    result = subprocess.run(sample_command(checkpoint, *args), env=ENV, capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, "sample.py", *fragments)
    assert result.stdout == ""


def test_the_largest_seed_is_taken(checkpoint):
    result = subprocess.run(sample_command(checkpoint, "--seed", 2**64 - 1, "--max-new-tokens", 5), env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("kv_cache, draft", [(None, None), ("int8", None), (None, "lookup")])
def test_the_memory_check_counts_the_cache_the_decoder_really_builds(monkeypatch, kv_cache, draft):
    """The cache as the decoder builds it: in its dtype, with speculative decoding's spare slots for k drafts."""
    from model.decoding.quantize import to_precision
    from sampling.options import check_samples_fit_memory

    model = to_precision(random_model(), "bf16")
    spare = 3 if draft else 0
    cache = new_kv_cache(model, 1, max_len=model.config.block_size + spare, dtype=torch.int8 if kv_cache else None)
    need = cache.nbytes + (1 + 10) * 8  # a one-token prompt, 10 more
    assert cache.dtype == (torch.int8 if kv_cache else torch.float32)  # float32 on the CPU, even at bf16
    args = argparse.Namespace(num_samples=1, max_new_tokens=10, kv_cache=kv_cache, draft=draft,
                              speculate_k=spare or None)
    for memory, fits in ((2 * need, True), (2 * need - 2, False)):  # sample.py may use half of it
        monkeypatch.setattr(os, "sysconf", lambda name: memory if name == "SC_PHYS_PAGES" else 1)
        if fits:
            check_samples_fit_memory(args, 1, model, torch.device("cpu"))
        else:
            with pytest.raises(UsageError, match="need 0.0 GiB of KV cache and tokens"):
                check_samples_fit_memory(args, 1, model, torch.device("cpu"))


def test_a_checkpoint_that_is_no_file_or_an_export_not_read_back_says_what_it_is(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # opening it would wait for a writer
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for fmt, name, kind in (("onnx", "model.onnx", "an ONNX export"), ("gguf", "model.gguf", "a GGUF export")):
        (tmp_path / fmt).mkdir()
        (tmp_path / fmt / name).write_bytes(b"\0")
        result = subprocess.run(sample_command(tmp_path / fmt), env=ENV, capture_output=True, text=True, timeout=120)
        assert_one_line_error(result, "sample.py", f"{tmp_path / fmt} is {kind}", "pass the checkpoint it was "
                              "exported from, or an export in the hf format")
    result = subprocess.run(sample_command(tmp_path / "fifo"), env=ENV, capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, "sample.py", f"{tmp_path / 'fifo'} is a pipe (FIFO), not a checkpoint file")
    result = subprocess.run(sample_command(tmp_path / "loop"), env=ENV, capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, "sample.py", f"{tmp_path / 'loop'}: cannot follow its links")
