"""What the engine (model/serving/engine.py) shows of itself: its counts since it started, and a census of now.

Engine.census() takes one between passes: every block, every request, the counts. Each is frozen, so that a
reader in another thread (serve.py's page) holds a picture that the next pass does not change under it.
"""

from dataclasses import dataclass
from typing import NamedTuple


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


class BlockCensus(NamedTuple):  # a tuple: a pool's every block is one, and tuples are the cheapest to make
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
    shared: int  # blocks more than one request reads
    idle: int  # cached blocks nobody reads, kept until the pool needs them
    stats: EngineStats


class BlockPictures:
    """Every block's census, each drawn again only when its books changed (BlockBooks.touched): a pass changes few
    blocks, and drawing a large pool's every block at every pass would cost more than the pass."""

    def __init__(self, n_blocks: int):
        self.blocks = [BlockCensus(None, 0, False)] * n_blocks
        self.picture = tuple(self.blocks)

    def of(self, books, running) -> tuple[BlockCensus, ...]:
        """Each block's census; books: the pool's (blocks.py), running: the running requests in the order they
        joined, the first to read a block its owner. A block changes owner only as readers come and go, which
        touches it."""
        touched, books.touched = books.touched, set()
        if touched:
            owners = {}
            for request in running:
                for block in touched.intersection(request.blocks):
                    owners.setdefault(block, request.name)
            for block in touched:
                self.blocks[block] = BlockCensus(owners.get(block), books.refs[block], block in books.hash_of)
            self.picture = tuple(self.blocks)
        return self.picture
