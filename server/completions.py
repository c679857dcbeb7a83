"""One completions request carried out: its jobs submitted to the engine's runner, and their text written as
OpenAI writes an answer, whole or as server-sent events."""

import asyncio
import json
import time
import uuid

import torch

from model.serving.request import Kept
from .logprobs import ChoiceScores, logprobs_json
from .protocol import ApiError, Completion
from .runner import EngineRunner, Job, QueueFull, Stopping
from .stops import StopScan

GONE = object()  # put in a request's events when its client has disconnected


class Carried:
    """A request's jobs in the engine, and the pieces of text they yield: (choice index, text, finish_reason,
    the text's tokens scored or None)."""

    def __init__(self, completion: Completion, runner: EngineRunner, model: str):
        self.completion, self.runner, self.model = completion, runner, model
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.events: asyncio.Queue = asyncio.Queue()
        loop, device = asyncio.get_running_loop(), runner.engine.device
        pairs = [(prompt, ids) for prompt, ids in zip(completion.prompts, completion.prompt_ids)
                 for _ in range(completion.n)]
        top, echo = completion.logprobs, completion.echo
        self.jobs = [Job(f"{self.id}-{i}", i, prompt, ids, completion.max_tokens, completion.sampling,
                         seeded(device, completion.seed, i), StopScan(completion.stop), self.events, loop, echo,
                         None if top is None else ChoiceScores(top, runner.decode),
                         Kept(draws=top is not None, prompt=echo and top is not None))
                     for i, (prompt, ids) in enumerate(pairs)]
        try:
            runner.submit(self.jobs)
        except QueueFull as e:
            raise ApiError(429, str(e), code="queue_full", kind="rate_limit_error", headers={"Retry-After": "1"}) \
                from None
        except Stopping as e:
            raise ApiError(503, str(e), kind="server_error") from None

    async def pieces(self):
        """Each choice's text as it is drawn; ends when every choice has finished. Raises ApiError(503) when the
        server stops under it."""
        running = len(self.jobs)
        while running:
            job, event = await self.events.get()
            if job is GONE:
                return
            if isinstance(event, Exception):
                raise ApiError(503, f"the server stopped before the completion ended: {event}", kind="server_error")
            text, finish_reason, scored = event
            running -= finish_reason is not None
            yield job.index, text, finish_reason, scored

    def gone(self) -> None:
        """The client disconnected: its jobs leave the engine, and pieces() ends."""
        self.runner.cancel(self.jobs)
        self.events.put_nowait((GONE, None))

    def usage(self) -> dict:
        """Each prompt counted once, as OpenAI counts it, its cached tokens those its first choice read."""
        prompt, drawn = sum(len(ids) for ids in self.completion.prompt_ids), sum(job.drawn for job in self.jobs)
        cached = sum(job.kept.cached_tokens or 0 for job in self.jobs[::self.completion.n])
        return {"prompt_tokens": prompt, "completion_tokens": drawn, "total_tokens": prompt + drawn,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def logprobs(self, scored: list | None, offset: int) -> dict | None:
        """A choice's logprobs field, when they are asked: its tokens from offset in its text."""
        return None if self.completion.logprobs is None else logprobs_json(scored or [], offset)

    def answer(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}
        return body if usage is None else {**body, "usage": usage}

    async def whole(self) -> dict:
        """The answer in one JSON object, after every choice has ended."""
        texts, reasons, scores = [""] * len(self.jobs), [None] * len(self.jobs), [[] for _ in self.jobs]
        try:
            async for index, text, reason, scored in self.pieces():
                texts[index] += text
                reasons[index] = reason or reasons[index]
                scores[index] += scored or []
        finally:  # a client gone, or the server stopping: the jobs leave the engine
            self.runner.cancel(self.jobs)
        return self.answer([choice(i, texts[i], reasons[i], self.logprobs(scores[i], 0))
                            for i in range(len(self.jobs))], self.usage())

    async def stream(self):
        """The answer as server-sent events: a chunk per piece, the usage if asked, then [DONE]. A server that
        stops ends the stream with an error event."""
        sent = [0] * len(self.jobs)  # each choice's characters sent: where its next token starts
        try:
            async for index, text, reason, scored in self.pieces():
                yield event(self.answer([choice(index, text, reason, self.logprobs(scored, sent[index]))]))
                sent[index] += len(text)
            if self.completion.include_usage:
                yield event(self.answer([], self.usage()))
            yield "data: [DONE]\n\n"
        except ApiError as e:
            yield event(e.body())
        finally:
            self.runner.cancel(self.jobs)


def seeded(device: torch.device, seed: int | None, index: int) -> torch.Generator:
    """Choice index's generator: seed + index, so that a seeded request draws the same text whatever else runs."""
    generator = torch.Generator(device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed + index)
    return generator


def choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
