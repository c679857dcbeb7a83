"""The engine (model/serving/engine.py) in a thread of its own, fed by a server's requests.

Every completion of every client is a Job in one engine: one pool, continuous batching, the prefix cache
across requests. The server's event loop submits and cancels jobs; the engine's thread adds them between
passes, steps, and hands each job its text on the loop (loop.call_soon_threadsafe). The thread cuts the text at
a stop string, so that a job ends, and says how, in one place. It also draws a picture of the engine now and
then, which the page and /metrics read: nothing but that thread touches the engine.
"""

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model import Sampling
from model.serving.engine import Engine
from model.serving.request import Kept
from .logprobs import ChoiceScores
from .metrics import Metrics
from .stops import StopScan
from .timeline import Timeline

RECENT_SECONDS = 20  # how long the page still shows a finished request
PICTURE_SECONDS = 0.05  # the engine's picture is drawn again after a pass at most this often


class QueueFull(Exception):
    """More jobs than the engine runs and queues at once."""


class Stopping(Exception):
    """The server is stopping, or its engine has failed: it takes no more jobs."""


@dataclass(eq=False)
class Job:
    """One completion: a prompt continued once. events gets (job, (text, finish_reason, scored)) for each pass's
    new text, finish_reason "stop" or "length" with the last, or (job, an Exception) when the server stops;
    scored: the text's tokens scored (server/logprobs.py), or None when no log-probabilities are asked."""
    id: str
    index: int  # its place in the answer's choices
    prompt: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    generator: torch.Generator
    stops: StopScan
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    echo: bool = False  # its first text begins with the prompt
    scores: ChoiceScores | None = None  # its log-probabilities, when asked
    kept: Kept = field(default_factory=Kept)  # what the engine keeps of it for the job: logits, cached tokens
    submitted: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    finished: float | None = None
    drawn: int = 0
    outcome: str = ""  # how it ended: length, stop, cancelled, stopped
    request: object = None  # the engine's Request, once added

    def tell(self, event) -> None:  # from the engine's thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self, event))


class EngineRunner:
    """Runs an Engine in a daemon thread; at most engine.max_batch + max_waiting jobs live at once. decode turns
    token ids into text."""

    def __init__(self, engine: Engine, decode: Callable[[list[int]], str], max_waiting: int, threads: int):
        self.engine, self.decode, self.threads = engine, decode, threads
        self.capacity = engine.max_batch + max_waiting
        self.lock = threading.Condition()  # over an RLock: stop() may be called with it held
        self.live: dict[str, Job] = {}  # submitted, not yet ended
        self.adding: list[Job] = []
        self.cancelling: list[Job] = []
        self.recent: list[Job] = []  # ended in the last RECENT_SECONDS
        self.stopping = False
        self.failed = ""  # why the engine stopped, if it failed
        self.metrics = Metrics()
        self.drawn_at = 0.0
        self.timeline = Timeline()  # a census after each pass, for the page's timeline
        self.draw()  # snapshot and gauges: what the page and /metrics read, redrawn as the engine runs
        self.thread = threading.Thread(target=self.serve, name="engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, jobs: list[Job]) -> None:
        with self.lock:
            if self.stopping:
                raise Stopping(self.failed or "the server is stopping")
            if len(self.live) + len(jobs) > self.capacity:
                raise QueueFull(f"{len(self.live)} completions are running or waiting, as many as this server "
                                f"takes at once; try again shortly")
            for job in jobs:
                self.live[job.id] = job
            self.adding += jobs
            self.lock.notify()

    def cancel(self, jobs: list[Job]) -> None:
        """Drop jobs whose client has gone: their blocks go back at the next pass."""
        with self.lock:
            self.cancelling += [job for job in jobs if job.id in self.live]
            self.lock.notify()

    def stop(self, why: str) -> None:
        """End every live job with an error, and the thread."""
        with self.lock:
            self.stopping = True
            for job in self.live.values():
                job.tell(RuntimeError(why))
                self.end(job, "stopped")
            self.live.clear()
            self.lock.notify()

    def serve(self) -> None:
        """Between passes, take the new and cancelled jobs; the pass itself runs without the lock, so that the
        server's event loop never waits for one."""
        engine = self.engine
        torch.set_num_threads(self.threads)  # OpenMP keeps a count per thread: this one would not inherit it
        while True:
            with self.lock:
                while not (self.adding or self.cancelling or engine.waiting or engine.running or self.stopping):
                    self.draw()  # idle: the picture shows it
                    self.lock.wait()
                if self.stopping:
                    return
                for job in self.adding:
                    job.request = engine.add(job.id, job.prompt_ids, job.max_tokens, job.generator, job.sampling,
                                             job.kept)
                for job in self.cancelling:
                    if job.id in self.live:
                        engine.cancel(job.request)
                        self.end(self.live.pop(job.id), "cancelled")
                self.adding, self.cancelling = [], []
            try:
                drawn = engine.step() if engine.waiting or engine.running else []
                with self.lock:
                    self.deliver(drawn)
                    self.timeline.record(engine.census())
                    if time.monotonic() - self.drawn_at >= PICTURE_SECONDS:
                        self.draw()
            except Exception as e:  # noqa: BLE001  a fault of the engine's or its text's: no client waits for ever
                self.failed = f"the engine failed: {type(e).__name__}: {e}"
                self.stop(self.failed)
                return

    def deliver(self, drawn: list[tuple[str, int | None]]) -> None:
        """Hand each job its new text, and its scores; a job ends at a stop string or with all its tokens (a job
        of no new tokens, once its prompt is computed: token None)."""
        now, tokens, told = time.monotonic(), {}, []
        for name, token in drawn:
            tokens.setdefault(name, []).extend([] if token is None else [token])
        for name, new in tokens.items():
            job = self.live.get(name)
            if job is None:
                continue
            first = job.first_token is None
            if first:
                job.first_token = now
                self.metrics.first_token(now - job.submitted)
            job.drawn += len(new)
            self.metrics.tokens_drawn += len(new)
            text, stopped = job.stops.feed(self.decode(new))
            ended = "stop" if stopped else "length" if job.drawn == job.max_tokens else None
            if ended == "length":
                text += job.stops.flush()
            prompt_rows, logits = job.kept.take()
            scored = job.scores.sent(new, logits, text) if job.scores else None
            if first and job.echo:  # the prompt comes first, and no stop string is looked for in it
                text = job.prompt + text
                scored = job.scores.prompt(job.prompt_ids, prompt_rows) + scored if job.scores else None
            if text or ended:
                told.append((job, (text, ended, scored)))
            if ended:
                self.engine.cancel(job.request)  # a stopped job's blocks go back now (a finished one holds none)
                self.end(self.live.pop(name), ended)
        if any(ended for _, (_, ended, _) in told):
            self.draw()  # /metrics counts a job that ended before its client can read that it did
        for job, message in told:
            job.tell(message)

    def end(self, job: Job, outcome: str) -> None:
        job.finished, job.outcome = time.monotonic(), outcome
        self.metrics.ended(job.outcome)
        self.recent = [j for j in self.recent if job.finished - j.finished < RECENT_SECONDS] + [job]

    def draw(self) -> None:
        """The picture of the engine that the page and /metrics read, from its census: every block and who holds
        it, every job's state, and the gauges. Drawn by the engine's thread, which alone touches the engine."""
        census, now = self.engine.census(), time.monotonic()
        states = {request.name: request.state for request in census.requests}
        jobs = [job_view(job, states.get(job.id, "waiting"), now) for job in self.live.values()]
        jobs += [job_view(job, "done", now) for job in self.recent if now - job.finished < RECENT_SECONDS]
        stats, running = census.stats, sum(r.state in ("prefilling", "decoding") for r in census.requests)
        self.snapshot = {"blocks": [[block.owner, block.refs, block.cached] for block in census.blocks],
                         "block_tokens": census.block_tokens, "jobs": jobs, "hit_rate": stats.hit_rate,
                         "preemptions": stats.preemptions}
        self.gauges = {"running": running, "waiting": len(self.live) - running, "blocks_used": census.used,
                       "blocks_free": census.free, "blocks_cached": census.idle, "prompt_tokens": stats.prompt_tokens,
                       "reused_tokens": stats.reused_tokens, "hit_rate": stats.hit_rate,
                       "preemptions": stats.preemptions}
        self.drawn_at = now


def job_view(job: Job, state: str, now: float) -> dict:
    """A job as the page shows it: its prompt as text, its state and its speed."""
    decoding = (job.finished or now) - job.first_token if job.first_token else 0
    return {"id": job.id, "prompt": job.prompt[-60:], "state": state, "outcome": job.outcome, "tokens": job.drawn,
            "max_tokens": job.max_tokens, "tokens_per_second": job.drawn / decoding if decoding > 0 else None}
