"""The Python API of the labs refuses arguments that cannot work with one ValueError naming the argument, as
generate() does: never an AttributeError, TypeError, RuntimeError or IndexError from deep inside."""

import re

import pytest
import torch

from model import GREEDY
from model.serving.conversation import Conversation
from model.measuring.decoder_loss import decoder_loss, teacher_forced_loss
from model.serving.ngram_draft import NGramTable
from model.serving.speculative import PromptLookup, speculative_generate
from tiny_models import BLOCK_SIZE, random_model, random_tokens
from model.caches.factory import new_kv_cache


@pytest.fixture(scope="module")
def model():
    return random_model()


def first(iterator):
    return next(iter(iterator))


CACHE_CASES = {
    "batch_size a bool": (lambda m: new_kv_cache(m, True), "batch_size"),
    "batch_size a float": (lambda m: new_kv_cache(m, 2.0), "batch_size"),
    "batch_size negative": (lambda m: new_kv_cache(m, -1), "batch_size"),
    "max_len zero": (lambda m: new_kv_cache(m, 2, max_len=0), "max_len"),
    "dtype a string": (lambda m: new_kv_cache(m, 2, dtype="int8"), "dtype"),
    "rollback a bool": (lambda m: new_kv_cache(m, 1).rollback(True), "n must be"),
    "rollback a float": (lambda m: new_kv_cache(m, 1).rollback(0.0), "n must be"),
    "rollback negative": (lambda m: new_kv_cache(m, 1).rollback(-1), "n must be"),
}


@pytest.mark.parametrize("case", CACHE_CASES)
def test_new_kv_cache_and_rollback_refuse_what_cannot_work(model, case):
    call, name = CACHE_CASES[case]
    with pytest.raises(ValueError, match=re.escape(name)):
        call(model)


def loss_cases(loss):
    tokens = random_tokens(2, 2 * BLOCK_SIZE)
    return {
        "prompt_len 0": (lambda m: loss(m, tokens, prompt_len=0), "prompt_len"),
        "prompt_len negative": (lambda m: loss(m, tokens, prompt_len=-3), "prompt_len"),
        "prompt_len a float": (lambda m: loss(m, tokens, prompt_len=2.0), "prompt_len"),
        "prompt_len the whole text": (lambda m: loss(m, tokens, prompt_len=tokens.size(1)), "prompt_len"),
        "a 1-D text": (lambda m: loss(m, tokens[0], prompt_len=2), "idx"),
        "ids outside the vocabulary": (lambda m: loss(m, tokens + 1000, prompt_len=2), "vocabulary"),
        "keep 0": (lambda m: loss(m, tokens, prompt_len=2, keep=0), "keep"),
        "training mode": (lambda m: loss(m.train(), tokens, prompt_len=2), "model.eval()"),
    }


@pytest.mark.parametrize("loss", [decoder_loss, teacher_forced_loss], ids=["decoder_loss", "teacher_forced_loss"])
@pytest.mark.parametrize("case", list(loss_cases(None)))
def test_the_losses_through_the_decoder_refuse_what_cannot_work(loss, case):
    model = random_model()
    call, name = loss_cases(loss)[case]
    with pytest.raises(ValueError, match=re.escape(name)):
        call(model)


def test_teacher_forced_loss_refuses_a_chunk_that_cannot_work(model):
    with pytest.raises(ValueError, match="chunk"):
        teacher_forced_loss(model, random_tokens(1, 40), prompt_len=2, chunk=0)


SAMPLING_CASES = {
    "ngram table tokens outside the vocabulary": (lambda m: NGramTable([0, 5], 5), "tokens must hold"),
    "ngram table of no tokens": (lambda m: NGramTable([], 5), "tokens must hold"),
    "ngram table order negative": (lambda m: NGramTable([0], 5, order=-1), "order"),
    "ngram table order past int64": (lambda m: NGramTable([0], 65, order=10), "order 10 is too long for 65 tokens"),
    "ngram table min_count zero": (lambda m: NGramTable([0], 5, min_count=0), "min_count"),
    "speculative sampling a string": (
        lambda m: first(speculative_generate(m, random_tokens(1, 4), 3, draft=PromptLookup(), k=2, sampling="greedy")),
        "sampling"),
    "speculative sampling a temperature": (
        lambda m: first(speculative_generate(m, random_tokens(1, 4), 3, draft=PromptLookup(), k=2, sampling=0.8)),
        "sampling"),
    "conversation sampling None": (lambda m: Conversation(m, sampling=None), "sampling"),
    "conversation new_tokens a tensor": (
        lambda m: first(Conversation(m, sampling=GREEDY).reply(torch.tensor([1, 2]), 3)), "new_tokens"),
    "conversation new_tokens a string": (lambda m: first(Conversation(m).reply("hello", 3)), "new_tokens"),
    "conversation new_tokens of floats": (lambda m: first(Conversation(m).reply([1.0, 2.0], 3)), "new_tokens"),
    "conversation stop a tensor": (lambda m: first(Conversation(m).reply([1], 3, stop=torch.tensor([1]))), "stop"),
}


@pytest.mark.parametrize("case", SAMPLING_CASES)
def test_speculative_decoding_and_conversations_refuse_what_cannot_work(model, case):
    call, name = SAMPLING_CASES[case]
    with pytest.raises(ValueError, match=re.escape(name)):
        call(model)
