"""What the engine (model/serving/engine.py) shows of itself: its counts since it started, and a census of now.

Engine.census() takes one between passes: every block, every request, the counts. Each is frozen, so that a
reader in another thread (serve.py's page) holds a picture that the next pass does not change under it.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    passes: int = 0
    prompt_tokens: int = 0  # prompt tokens of every request at its first pass (again, after a preemption)
    reused_tokens: int = 0  # of those, read from cached blocks instead of computed
    preemptions: int = 0
    peak_blocks: int = 0  # the most blocks read at once

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / max(self.prompt_tokens, 1)


@dataclass(frozen=True)
class BlockCensus:
    owner: object  # the name of the first running request that reads it, or None
    refs: int  # how many requests read it
    cached: bool  # it holds a named prefix, read or idle


@dataclass(frozen=True)
class RequestCensus:
    name: object
    state: str  # waiting, preempted (waiting again), prefilling or decoding
    prompt_tokens: int
    cached_tokens: int  # tokens read from cached blocks when it last joined, not computed
    generated_tokens: int
    blocks_held: int
    preemptions: int


@dataclass(frozen=True)
class Census:
    blocks: tuple[BlockCensus, ...]  # by block number
    requests: tuple[RequestCensus, ...]  # the running in the order they joined, then the waiting in theirs
    block_tokens: int
    n_blocks: int
    free: int  # blocks the pool can hand out now: never named, or idle
    used: int  # blocks some request reads
    idle: int  # cached blocks nobody reads, kept until the pool needs them
    stats: EngineStats
