"""OpenAI's completions API, as serve.py speaks it: a request's JSON checked field by field, and the JSON of
its answers and errors. Each mistake is an ApiError, which the server sends as OpenAI's error JSON.

A field that OpenAI defines but kvgpt cannot honour (best_of, penalties, logit_bias, suffix) is accepted only at
its default value, and refused otherwise: a client never gets text drawn other than it asked.
"""

import math
from dataclasses import dataclass

from data import CharVocab, UnknownCharacterError
from model import Sampling

DEFAULT_MAX_TOKENS = 16  # OpenAI's own default for completions
MAX_STOPS = 4  # as many stop strings as OpenAI takes
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # the likeliest tokens listed at each place at most, as vLLM's default
# Fields OpenAI defines that change nothing at these values; any other value is refused.
INERT = {"best_of": (None, 1), "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
         "logit_bias": (None, {}), "suffix": (None, "")}
FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
          "stream_options", "user", "logprobs", "echo", *INERT}


class ApiError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What this server serves: its model's name and context, and how many completions one request may ask."""
    model: str
    context: int  # block_size: a prompt and its completion together
    max_choices: int


@dataclass(frozen=True)
class Completion:
    """A checked request: each prompt's token ids, and how to continue each one n times."""
    prompts: list[str]
    prompt_ids: list[list[int]]
    n: int
    max_tokens: int
    sampling: Sampling
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None  # how many of the likeliest tokens to list at each place; None: no log-probabilities
    echo: bool  # the prompt comes before the completion, in its text and its log-probabilities


def parse_completion(body, vocab: CharVocab, limits: Limits) -> Completion:
    """The request body's JSON, checked against the API, the vocabulary and the model's context."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}: this server takes {', '.join(sorted(FIELDS))}",
                       unknown[0])
    for name, defaults in INERT.items():
        if name in body and not any(body[name] == d and type(body[name]) is type(d) for d in defaults):
            raise ApiError(400, f"{name} is not supported here; leave it out", name)
    model = body.get("model")
    if model is not None and model != limits.model:
        raise ApiError(404, f"the model {model!r} does not exist: this server serves {limits.model!r} "
                            f"(GET /v1/models)", "model", "model_not_found")
    prompts = parse_prompts(body.get("prompt"))
    prompt_ids = [encode(vocab, prompt) for prompt in prompts]
    n = integer(body, "n", 1, minimum=1)
    if len(prompts) * n > limits.max_choices:
        raise ApiError(400, f"{len(prompts)} prompts times n={n} ask for {len(prompts) * n} completions; this "
                            f"server runs and queues at most {limits.max_choices} at once", "n")
    echo = flag(body, "echo")
    max_tokens = parse_max_tokens(body, echo)
    longest, least = max(len(ids) for ids in prompt_ids), min(max_tokens, 1)  # least: the new tokens that must fit
    if longest + least > limits.context:
        raise ApiError(400, f"this model's context is {limits.context} tokens (max_model_len), and the prompt has "
                            f"{longest}: a prompt can have at most {limits.context - least}"
                            f"{', so that one new token fits' if least else ''}", "prompt", "context_length_exceeded")
    if longest + max_tokens > limits.context:
        raise ApiError(400, f"this model's context is {limits.context} tokens (max_model_len), and the prompt has "
                            f"{longest}: max_tokens can be at most {limits.context - longest}, got "
                            f"{max_tokens}", "max_tokens", "context_length_exceeded")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"user must be a string, got {user!r}", "user")
    return Completion(prompts, prompt_ids, n, max_tokens, parse_sampling(body), parse_seed(body),
                      parse_stop(body.get("stop"), vocab, limits.context), flag(body, "stream"),
                      parse_stream_options(body), parse_logprobs(body), echo)


def parse_prompts(prompt) -> list[str]:
    if prompt is None:
        raise ApiError(400, "the request has no prompt: give one, a string or a list of strings", "prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not (isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts)):
        raise ApiError(400, "prompt must be a string or a non-empty list of strings", "prompt")
    if not all(prompts):
        raise ApiError(400, "the prompt is empty: give at least one character to continue", "prompt")
    return prompts


def encode(vocab: CharVocab, prompt: str) -> list[int]:
    try:
        return vocab.encode(prompt)
    except UnknownCharacterError as e:
        unknown = ", ".join(repr(c) for c in e.chars)
        raise ApiError(400, f"the prompt has characters outside the model's vocabulary: {unknown}; it knows "
                            f"{len(vocab)} characters (GET /v1/models)", "prompt") from None


def integer(body: dict, name: str, default: int, minimum: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {value!r}", name)
    if value < minimum:
        raise ApiError(400, f"{name} must be at least {minimum}, got {value}", name)
    return value


def parse_max_tokens(body: dict, echo: bool) -> int:
    """At least 1; 0 as well with echo, which then returns the prompt alone (and scores it, with logprobs)."""
    if body.get("max_tokens") == 0 and type(body["max_tokens"]) is int and not echo:
        raise ApiError(400, "max_tokens must be at least 1, got 0: only with echo may it be 0, to return the prompt "
                            "alone", "max_tokens")
    return integer(body, "max_tokens", DEFAULT_MAX_TOKENS, minimum=0 if echo else 1)


def parse_logprobs(body: dict) -> int | None:
    value = body.get("logprobs")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 0 <= value <= MAX_LOGPROBS):
        raise ApiError(400, f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, how many of the likeliest tokens "
                            f"to list at each place; got {value!r}", "logprobs")
    return value


def number(body: dict, name: str):
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or not math.isfinite(value)):
        raise ApiError(400, f"{name} must be a number, got {value!r}", name)
    return value


def flag(body: dict, name: str, param: str | None = None) -> bool:
    """A true or false field, false when absent or null; param: the name errors give, name by default."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {value!r}", param or name)
    return bool(value)


def parse_sampling(body: dict) -> Sampling:
    """OpenAI's temperature and top_p (1 keeps every token), and vLLM's top_k (-1 or 0 keeps every token)."""
    temperature, top_p = number(body, "temperature"), number(body, "top_p")
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise ApiError(400, f"top_k must be an integer >= 1, or -1 or 0 for every token; got {top_k!r}", "top_k")
    if temperature is not None and temperature < 0:
        raise ApiError(400, f"temperature must be at least 0, got {temperature}", "temperature")
    if top_p is not None and not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k, top_p = top_k if top_k and top_k > 0 else None, top_p if top_p not in (None, 1) else None
    try:
        return Sampling(temperature=1.0 if temperature is None else temperature, top_k=top_k, top_p=top_p)
    except ValueError as e:  # a temperature too small to divide by, or top_k or top_p with greedy text
        raise ApiError(400, str(e), ("top_k" if top_k else "top_p") if temperature == 0 else "temperature") from None


def parse_seed(body: dict) -> int | None:
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise ApiError(400, f"seed must be an integer from 0 to {MAX_SEED}, got {seed!r}", "seed")
    return seed


def parse_stop(stop, vocab: CharVocab, context: int) -> list[str]:
    """The stop strings, each one the model could write: no longer than its context, in its vocabulary."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= MAX_STOPS and all(isinstance(s, str) and s for s in stops)):
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    for s in stops:
        if len(s) >= context:  # a completion follows a prompt of at least one token
            raise ApiError(400, f"a stop string of {len(s)} characters can never end a text: this model's context "
                                f"is {context} tokens (max_model_len), a prompt's included", "stop")
        try:
            vocab.encode(s)
        except UnknownCharacterError as e:
            raise ApiError(400, f"a stop string has characters outside the model's vocabulary, so it can never end "
                                f"a text: {', '.join(map(repr, e.chars))} (GET /v1/models)", "stop") from None
    return stops


def parse_stream_options(body: dict) -> bool:
    """Whether a stream ends with a chunk that counts the tokens (stream_options.include_usage)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not (isinstance(options, dict) and set(options) <= {"include_usage"}):
        raise ApiError(400, "stream_options takes only include_usage", "stream_options")
    if not flag(body, "stream"):
        raise ApiError(400, "stream_options applies to a stream: set stream, or leave it out", "stream_options")
    return flag(options, "include_usage", "stream_options")
