"""The engine's recent history, which the page draws as a timeline and replays: a census after each pass.

The engine's thread records; the event loop reads. Only the last MOMENTS passes are kept, the oldest dropped.
Each moment also says which requests joined reading cached blocks (prefix hits) and which left since the last.
"""

import threading
import time
from collections import deque
from dataclasses import dataclass

from model.serving.census import Census

MOMENTS = 600  # passes kept: enough to replay the last few requests, small enough to send often
RUNNING = ("prefilling", "decoding")


@dataclass(frozen=True)
class Moment:
    seq: int  # the pass's number since the server started
    seconds: float  # since the first moment
    hits: tuple[tuple[object, int], ...]  # (name, cached tokens) of each request that joined on cached blocks
    left: tuple[object, ...]  # names no longer in the engine: done, stopped or cancelled
    census: Census  # the engine after the pass: its blocks (one tuple while unchanged), requests and counts


class Timeline:
    def __init__(self, moments: int = MOMENTS):
        self.moments: deque[Moment] = deque(maxlen=moments)
        self.lock = threading.Lock()  # the event loop copies while the engine's thread appends
        self.seq, self.start = 0, None
        self.states: dict = {}  # each request's state at the last moment

    def record(self, census: Census) -> None:
        """Keep the census of the pass just run; called by the engine's thread alone."""
        now = time.monotonic()
        self.start = now if self.start is None else self.start
        states = {r.name: r.state for r in census.requests}
        hits = tuple((r.name, r.cached_tokens) for r in census.requests
                     if r.state in RUNNING and r.cached_tokens and self.states.get(r.name) not in RUNNING)
        left = tuple(name for name in self.states if name not in states)
        self.seq, self.states = self.seq + 1, states
        moment = Moment(self.seq, now - self.start, hits, left, census)
        with self.lock:
            self.moments.append(moment)

    def since(self, seq: int) -> dict:
        """The moments after pass seq, as the page reads them."""
        with self.lock:
            moments = [m for m in self.moments if m.seq > seq]
        return {"moments_kept": self.moments.maxlen, "moments": [moment_view(m) for m in moments]}


def moment_view(moment: Moment) -> dict:
    """A moment as JSON: the counts the timeline plots, every block, and every request."""
    census = moment.census
    return {"seq": moment.seq, "seconds": round(moment.seconds, 4), "used": census.used, "shared": census.shared,
            "cached": census.idle, "free": census.free, "blocks": [list(b) for b in census.blocks],
            "requests": [{"id": r.name, "state": r.state, "prompt_tokens": r.prompt_tokens,
                          "cached_tokens": r.cached_tokens, "tokens": r.generated_tokens, "blocks": r.blocks_held,
                          "preemptions": r.preemptions} for r in census.requests],
            "hits": [{"id": name, "cached_tokens": tokens} for name, tokens in moment.hits],
            "left": list(moment.left), "hit_rate": census.stats.hit_rate, "preemptions": census.stats.preemptions,
            "passes": census.stats.passes}
