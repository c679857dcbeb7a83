"""Decoding at bf16 and int8 (model/decoding/quantize.py): the cache agrees with recomputation within each precision's
stated tolerance, int8 barely moves the loss at any width, and a converted model refuses to be trained or saved."""

import functools
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from data import CharVocab
from model import GPT, GREEDY, build_model, generate
from model.decoding.quantize import Int8Linear, QuantizedModelError, to_precision
from corpus import CITIZENS
from tiny_models import random_model, random_tokens, tiny_config, train_briefly
from tolerance import forward_atol
from runtime.checkpoint import build_checkpoint, load_model, save_checkpoint
from model.caches.factory import new_kv_cache

REPO = Path(__file__).resolve().parents[1]
TEXT = CITIZENS + """
All:
We know't, we know't.

First Citizen:
Let us kill him, and we'll have corn at our own price.
Is't a verdict?
"""
VOCAB = CharVocab.from_text(TEXT)
TOKENS = torch.tensor(VOCAB.encode(TEXT))
SPLIT = int(0.85 * len(TOKENS))
TRAIN, HELD_OUT = TOKENS[:SPLIT], TOKENS[SPLIT:]
BLOCK_SIZE = 16
PRECISIONS = ("fp32", "bf16", "int8")  # written out: the decoding precisions model/decoding/quantize.py offers

# How far cached logits may be from a full forward over the same context, per precision. fp32: the
# proofs of tests/test_kv_cache.py. bf16 and int8: both paths run the same bf16 operations, and attention in
# the same dtype (float32 on the CPU), but attention's kernels for one query and for many sum in different
# orders, so now and then an output lands on the other side of a bf16 rounding boundary: one activation then
# differs by one bf16 step (2^-8 relative), which moves logits by a few hundredths (measured: 0 on the trained
# model here, up to 0.023 on the random int8 models below; 0.0625 when one path attended in bf16).
# fp32: no fixed number, but two float32 forwards' own bound, forward_atol (tests/tolerance.py).
LOGIT_ATOL = {"fp32": None, "bf16": 0.04, "int8": 0.04}
# bf16 rounds every weight and activation by up to 2^-9 relative, int8 each weight by up to 1/254 of its
# row's largest: the held-out loss (~3.2 nats/char here) may move by this much (measured: under 0.01).
LOSS_TOLERANCE = 0.02


# Long enough training makes greedy text that is more than one character repeated, so that the cache is
# really tested; it also learns this small text by heart, so the loss is compared after a shorter one.
GENERATION_STEPS, LOSS_STEPS = 150, 40


@functools.cache
def trained_fp32(steps: int = GENERATION_STEPS) -> GPT:
    torch.manual_seed(0)
    model = build_model(tiny_config(vocab_size=len(VOCAB), block_size=BLOCK_SIZE, n_embd=48, n_head=3, bias=True))
    train_briefly(model, TRAIN, steps=steps, batch_size=16)
    return model.eval()


def converted(precision: str, steps: int = GENERATION_STEPS) -> GPT:
    model = build_model(trained_fp32(steps).config)
    model.load_state_dict(trained_fp32(steps).state_dict())
    return to_precision(model, precision)


def held_out_loss(model: GPT) -> float:
    windows = HELD_OUT.unfold(0, BLOCK_SIZE + 1, 1)  # (n, block_size + 1): every window of the held-out text
    with torch.no_grad():
        logits = model(windows[:, :-1])[0].float()  # a bf16 loss would be rounded to 2^-7 near 3 nats
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()


class RecordingGreedy:
    """Greedy decoding, as a `sampling` for generate, that keeps each step's logits (B, vocab_size) in float32."""

    def __init__(self):
        self.logits = []

    def next_token(self, logits, generator=None):
        self.logits.append(logits.float())
        return logits.argmax(dim=-1)


def assert_cached_greedy_decoding_matches_recomputation(model, prompt, n_new, tol) -> int:
    """Greedy decoding with the cache against recomputing the context at every step: at each step each row's
    logits are within tol. So the tokens are the same wherever recomputation's top two logits are more than
    2 * tol apart; closer, a difference of tol in each may swap them. Returns the row-steps compared: a row is
    compared up to its first different token, after which the two contexts differ. tol None: forward_atol."""
    cached, recomputed = RecordingGreedy(), RecordingGreedy()
    tokens = generate(model, prompt, n_new, sampling=cached)[:, prompt.size(1):]
    expected = generate(model, prompt, n_new, sampling=recomputed, use_cache=False)[:, prompt.size(1):]
    compared = 0
    for row in range(prompt.size(0)):
        for step in range(n_new):
            want = recomputed.logits[step][row]
            atol = forward_atol(model.config, want) if tol is None else tol
            torch.testing.assert_close(cached.logits[step][row], want, atol=atol, rtol=0)
            compared += 1
            if tokens[row, step] != expected[row, step]:
                break
    return compared


@pytest.mark.parametrize("precision", PRECISIONS)
def test_cached_greedy_decoding_matches_recomputation_within_the_precisions_tolerance(precision):
    model = converted(precision)
    prompt = torch.tensor([VOCAB.encode("First Citizen:\n"), VOCAB.encode("All:\nSpeak, sp\n")])
    n_new = int(2.5 * BLOCK_SIZE)  # the window moves more than once
    compared = assert_cached_greedy_decoding_matches_recomputation(model, prompt, n_new, LOGIT_ATOL[precision])
    assert compared >= 0.75 * prompt.size(0) * n_new  # most steps had no near-tie to stop at
    text = generate(model, prompt, n_new, sampling=GREEDY)[0, prompt.size(1):]
    assert len(set(text.tolist())) > 3  # real text, not one character repeated


@pytest.mark.parametrize("precision", PRECISIONS)
def test_cached_logits_stay_within_the_precisions_tolerance_of_a_full_forward(precision):
    model = converted(precision)
    seq = torch.tensor([VOCAB.encode("First Citizen:\nYou are all")[:BLOCK_SIZE]])
    cache = new_kv_cache(model, 1)
    model(seq[:, :4], cache=cache)
    for t in range(4, seq.size(1)):
        step = model.decode_step(seq[:, t:t + 1], cache).float()
        full = model(seq[:, :t + 1])[0][:, -1].float()
        atol = LOGIT_ATOL[precision] or forward_atol(model.config, full)
        torch.testing.assert_close(step, full, atol=atol, rtol=0)


# Widths whose Linears the CPU's fused int8 kernel cannot take (in_features not a multiple of 16: 18 and 20
# are not even multiples of 8, which AVX2 needs), and 48, which it takes; the head's out_features is the
# vocabulary (13).
WIDTHS = [(18, 3), (20, 4), (24, 3), (40, 5), (56, 7), (48, 3)]
# int8 rounds each weight by up to 1/254 of its row's largest, bf16 each activation by up to 2^-9: through these
# random models' 2 blocks (0.2-std weights, pronounced attention) the logits move by up to 3.1% of the largest
# one (measured). Rows of the wrong length in the fused kernel move them by 30% or more, or crash.
INT8_LOGIT_RTOL = 0.06


@pytest.mark.parametrize("n_embd, n_head", WIDTHS)
def test_int8_logits_stay_close_to_fp32_at_every_width(n_embd, n_head):
    fp32 = random_model(n_embd=n_embd, n_head=n_head)
    int8 = to_precision(random_model(n_embd=n_embd, n_head=n_head), "int8")
    assert int8.blocks[0].attn.qkv.cpu_kernel == (n_embd % 16 == 0)  # both of Int8Linear's paths are tested
    idx = random_tokens(3, BLOCK_SIZE)
    with torch.no_grad():
        expected = fp32(idx)[0]
        logits = int8(idx)[0].float()
    torch.testing.assert_close(logits, expected, atol=INT8_LOGIT_RTOL * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("n_embd, n_head", WIDTHS)
def test_int8_cached_greedy_decoding_matches_recomputation_at_every_width(n_embd, n_head):
    model = to_precision(random_model(n_embd=n_embd, n_head=n_head), "int8")
    n_new = int(2.5 * BLOCK_SIZE)
    prompt = random_tokens(2, 5)
    compared = assert_cached_greedy_decoding_matches_recomputation(model, prompt, n_new, LOGIT_ATOL["int8"])
    assert compared >= 0.75 * prompt.size(0) * n_new


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_the_held_out_loss_stays_close_to_fp32(precision):
    fp32 = held_out_loss(trained_fp32(LOSS_STEPS))
    assert fp32 < math.log(len(VOCAB)) - 0.3  # the model did learn something beyond uniform guessing
    assert abs(held_out_loss(converted(precision, LOSS_STEPS)) - fp32) < LOSS_TOLERANCE


def test_int8_holds_int8_weights_with_a_scale_per_output_channel_in_every_block_linear_and_the_head():
    model = converted("int8")
    reference = trained_fp32().blocks[0].mlp.fc
    for block in model.blocks:
        for linear in (block.attn.qkv, block.attn.out_proj, block.mlp.fc, block.mlp.proj):
            assert isinstance(linear, Int8Linear)
            assert linear.weight.dtype == torch.int8 and linear.scales.shape == (linear.out_features,)
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.weight.shape == (len(VOCAB), 48)
    assert not any(p.dtype == torch.int8 for p in model.parameters())  # buffers, nothing to train
    fc = model.blocks[0].mlp.fc
    dequantized = fc.weight.float() * fc.scales.float()[:, None]
    torch.testing.assert_close(dequantized, reference.weight, atol=(fc.scales.float().max() * 0.51).item(), rtol=0)
    assert model.wte.weight.dtype == torch.bfloat16


def test_an_int8_model_refuses_to_be_trained_or_saved():
    model = converted("int8")
    with pytest.raises(QuantizedModelError, match="cannot be trained"):
        model.train()
    with pytest.raises(QuantizedModelError, match="save the fp32 model"):
        model.state_dict()
    with pytest.raises(QuantizedModelError):
        build_checkpoint(model, VOCAB)


def test_an_unknown_precision_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="fp32, bf16, int8"):
        to_precision(converted("fp32"), "int4")


def test_load_model_converts_an_fp32_checkpoint_and_sample_py_decodes_it(tmp_path):
    path = save_checkpoint(build_checkpoint(trained_fp32(), VOCAB), tmp_path / "best.pt")
    model, _, _ = load_model(path, precision="int8")
    prompt = torch.tensor([VOCAB.encode("All:\n")])
    expected = VOCAB.decode(generate(model, prompt, 20, sampling=GREEDY)[0].tolist())
    result = subprocess.run([sys.executable, str(REPO / "sample.py"), "--checkpoint", str(path), "--prompt", "All:\n",
                             "--temperature", "0", "--max-new-tokens", "20", "--precision", "int8"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
    # the precision decoded at, and the cache's dtype, which attention computes in on the CPU
    assert re.fullmatch(r"20 tokens in [\d.]+ s, [\d.]+ tokens/s at int8, KV cache [\d.]+ MiB in float32 "
                        r"\(cpu, 1 thread\)", result.stderr.splitlines()[-1])
