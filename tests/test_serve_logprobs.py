"""serve.py's logprobs, echo and cached tokens, through OpenAI's own client: each log-probability is torch's
log_softmax of the logits the model gives over the text in one plain forward, the loss of a scored text is the
model's own cross-entropy, streams and whole answers agree to the bit, and cached_tokens counts the blocks read."""

import urllib.request

import pytest
import torch
import torch.nn.functional as F

from serving import BLOCK_SIZE, VOCAB, Served, checkpoint, greedy_alone, local_model, server  # noqa: F401  fixtures
from tolerance import forward_atol

openai = pytest.importorskip("openai", reason="the tests drive serve.py with OpenAI's client: pip install openai")
PROMPT = "ROMEO: Is the day so young?"
TEXT = ("But, soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
        "Arise, fair sun, and kill the envious moon,\nWho is already sick and pale with grief,")


def client(served):
    return openai.OpenAI(base_url=served.api, api_key="unused", max_retries=0, timeout=60)


def plain_logprobs(model, text: str) -> tuple[torch.Tensor, float]:
    """torch's log_softmax of the model's logits over text in one plain forward (position i predicts character
    i + 1), and how far a served log-probability may lie from it: a logit moved by d moves it by at most 2 d."""
    with torch.no_grad():
        logits = model(torch.tensor([VOCAB.encode(text)]))[0][0]
    return torch.log_softmax(logits, dim=-1), 2 * forward_atol(model.config, logits)


def assert_scored_like_the_model(model, logprobs, text: str, start: int, top: int) -> None:
    """A choice's logprobs, its tokens those of text from start, against plain_logprobs over text: the top N in
    order, then the token itself if not among them. The text's first token has no log-probability."""
    reference, atol = plain_logprobs(model, text)
    assert logprobs.tokens == list(text[start:]) and logprobs.text_offset == list(range(len(text) - start))
    for place, token, logprob, listed in zip(range(start, len(text)), logprobs.tokens, logprobs.token_logprobs,
                                             logprobs.top_logprobs):
        if place == 0:
            assert (logprob, listed) == (None, None)
            continue
        expected = reference[place - 1]  # the place before a token predicts it
        assert abs(logprob - expected[VOCAB.encode(token)[0]].item()) <= atol, (place, token)
        names, values = list(listed), torch.tensor(list(listed.values()))
        assert torch.allclose(values[:top], expected.topk(top).values, rtol=0, atol=atol), place
        assert all(abs(expected[VOCAB.encode(name)[0]].item() - value) <= atol for name, value in listed.items())
        assert names[top:] == ([] if token in names[:top] else [token]), place


def test_logprobs_are_the_raw_log_softmax_of_each_drawn_token_and_the_top_n_in_order(server, local_model):
    """Sampled at temperature 0.7 with top_k: the log-probabilities are those of the raw logits all the same."""
    answer = client(server).completions.create(model=None, prompt=PROMPT, max_tokens=40, temperature=0.7, n=2,
                                               seed=5, logprobs=5, extra_body={"top_k": 10})
    for choice in answer.choices:
        assert_scored_like_the_model(local_model, choice.logprobs, PROMPT + choice.text, len(PROMPT), 5)


def test_echo_with_no_new_tokens_scores_the_prompt_its_first_token_null(server, local_model):
    answer = client(server).completions.create(model=None, prompt=PROMPT, max_tokens=0, echo=True, logprobs=3)
    choice = answer.choices[0]
    assert (choice.text, choice.finish_reason) == (PROMPT, "length")
    assert_scored_like_the_model(local_model, choice.logprobs, PROMPT, 0, 3)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(PROMPT), 0)


def test_echo_without_logprobs_puts_each_prompt_before_each_of_its_choices(server, local_model):
    prompts = [PROMPT[:6], "JULIET:"]
    answer = client(server).completions.create(model=None, prompt=prompts, n=2, max_tokens=8, temperature=0,
                                               echo=True)
    expected = [prompt + greedy_alone(local_model, prompt, 8) for prompt in prompts for _ in range(2)]
    assert [(c.text, c.logprobs) for c in answer.choices] == [(text, None) for text in expected]
    assert answer.usage.completion_tokens == 4 * 8


def test_the_loss_of_a_scored_text_is_the_models_own_cross_entropy(server, local_model):
    """A text as long as the model's whole context: with no new token, the prompt may fill it."""
    text = (TEXT * 2)[:BLOCK_SIZE]
    answer = client(server).completions.create(model=None, prompt=text, max_tokens=0, echo=True, logprobs=0)
    logprobs = answer.choices[0].logprobs
    assert all(listed == {token: logprob} for token, logprob, listed in
               zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]))  # the token alone
    served = -sum(logprobs.token_logprobs[1:]) / (len(text) - 1)
    ids = torch.tensor([VOCAB.encode(text)])
    with torch.no_grad():
        logits = local_model(ids[:, :-1])[0][0]
    assert abs(served - F.cross_entropy(logits, ids[0, 1:]).item()) <= 1e-5


@pytest.mark.parametrize("echo", [False, True], ids=["drawn", "echo"])
def test_a_stream_and_a_whole_answer_give_the_same_tokens_and_logprobs_to_the_bit(server, local_model, echo):
    """Greedy, cut by a stop string that the stream holds back as it arrives."""
    prompt, full = PROMPT[:6], greedy_alone(local_model, PROMPT[:6], 40)
    stop = full[25:28]
    text = (prompt if echo else "") + full[:full.index(stop)]
    ask = dict(model=None, prompt=prompt, max_tokens=40, temperature=0, logprobs=4, echo=echo, stop=stop)
    whole = client(server).completions.create(**ask).choices[0]
    chunks = [c.choices[0] for c in client(server).completions.create(**ask, stream=True)]
    assert whole.finish_reason == chunks[-1].finish_reason == "stop"
    assert whole.text == "".join(c.text for c in chunks) == text
    streamed = {field: sum((getattr(c.logprobs, field) for c in chunks), []) for field in
                ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert streamed == {field: getattr(whole.logprobs, field) for field in streamed}
    assert_scored_like_the_model(local_model, whole.logprobs, prompt + full[:full.index(stop)],
                                 0 if echo else len(prompt), 4)


def test_cached_tokens_count_the_full_blocks_a_prompt_reads(checkpoint):
    """A fresh server of blocks of 8: cold, then the same prompt again, whole, streamed, and scored (computed)."""
    served = Served(checkpoint, "--block-tokens", 8)
    try:
        api = client(served)
        first = api.completions.create(model=None, prompt=TEXT[:45], max_tokens=5, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        shared = (45 - 1) // 8 * 8  # full blocks before the last prompt token, which is always computed
        before = hits(served)
        again = api.completions.create(model=None, prompt=TEXT[:45], max_tokens=5, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == shared == hits(served) - before
        chunks = list(api.completions.create(model=None, prompt=TEXT[:45], max_tokens=5, stream=True,
                                             stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == shared
        scored = api.completions.create(model=None, prompt=TEXT[:45], max_tokens=0, echo=True, logprobs=1)
        assert scored.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        served.stop()


def hits(served) -> float:
    """The engine's own count of prompt tokens read from cached blocks, from /metrics."""
    with urllib.request.urlopen(served.url + "/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return next(float(line.split()[-1]) for line in lines if line.startswith("kvgpt_prefix_cache_hit_tokens_total"))
