"""Many requests over one pool of KV blocks: continuous batching, a prefix cache, chunked prefill and preemption,
after vLLM and nano-vllm. The pool's tensors are in model/serving/paged.py, its books in model/serving/blocks.py.

    engine = Engine(model, n_blocks=64, block_tokens=8)
    engine.add("a", prompt_ids, max_new_tokens=100)  # at any time, also while others decode
    for request, token in engine.run():              # each token as it is drawn
        ...

Each step is one forward pass. A waiting request joins as soon as the pool has blocks for its text; full blocks
that another request has already computed for the same first tokens are read, not recomputed. While a joining
request is computing the first block it lacks, it waits, and then reads that block. Joining requests are
prefilled together, a chunk of at most `chunk` tokens each per step, as many chunks as pass_rows(max_batch, chunk)
tokens hold; then every running request decodes one token per step, together. When a decoding request needs a
block and none is left, the request that joined last is preempted: its blocks go back to the pool, and it waits
to be prefilled again, with the tokens it has drawn.
A request leaves when it has drawn its tokens, and its blocks go back. Each request's text is what it would get
decoded alone (sampled too, with a generator of its own): a context of at most block_size tokens.
Every pass is batch-invariant, to the last bit: a prompt's tokens are computed as decoding steps would compute
them, each a row of its own (model/serving/rowwise.py says why). A request's logits are the same whatever else
runs beside it, whether its prefix was read from the cache or computed, in one chunk or many, or again after a
preemption.
On the CPU a pass may run as compiled code instead (engine.passes, model/serving/compiled_rows.py): the same rows,
with no Python between its operations, given only where a check on the host finds its rows batch-invariant.

engine.census() is a frozen picture of it between steps (model/serving/census.py): each block's readers, each
request's state and counts, the stats. A reader such as serve.py's page needs nothing else of the engine.
engine.add(..., kept=Kept(...)) keeps what a caller asks of one request (model/serving/request.py): the raw logits
of each draw, those of every prompt position, and how many prompt tokens it read from the cache.
"""

import itertools
from collections import deque
from dataclasses import replace

import torch

from ..checks import is_integer
from .blocks import full_block_names
from .buckets import DecodeBuckets
from .census import BlockPictures, Census, EngineStats, RequestCensus
from .paged import BlockPool, PagedPass
from .request import Kept, Request, check_servable
from .rowwise import RowsRoute
from ..decoding.sampling import GREEDY, Sampling

CHUNK = 64  # prompt tokens a joining request feeds per step at most


def pass_rows(max_batch: int, chunk: int = CHUNK) -> int:
    """The most rows, one token each, of an engine pass: a decoding step's batch, or a prefill's tokens in all."""
    return max(max_batch, chunk)


class Engine:
    """Requests decoded over a pool of n_blocks blocks of block_tokens tokens; at most max_batch run at once.
    buckets: pad each decoding step to a fixed batch size (model/serving/buckets.py), each captured as a CUDA
    graph on CUDA; None: on CUDA only."""

    def __init__(self, model, *, n_blocks: int, block_tokens: int = 16, max_batch: int = 16, chunk: int = CHUNK,
                 sampling: Sampling = GREEDY, generator: torch.Generator | None = None, keep_logits: bool = False,
                 int8: bool = False, buckets: bool | None = None):
        for name, value in (("n_blocks", n_blocks), ("block_tokens", block_tokens), ("max_batch", max_batch),
                            ("chunk", chunk)):
            if not (is_integer(value) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        check_servable(model)
        self.model, self.sampling, self.generator, self.keep_logits = model, sampling, generator, keep_logits
        # int8: keys and values in int8 (model/caches/int8.py)
        self.max_batch, self.chunk, self.rows = max_batch, chunk, pass_rows(max_batch, chunk)
        self.pool = BlockPool(model, n_blocks, block_tokens, int8, max_rows=self.rows)
        on_cuda = self.device.type == "cuda"
        padded = buckets if buckets is not None else on_cuda
        self.buckets = DecodeBuckets(model, self.pool, max_batch, capture=on_cuda) if padded else None
        self.route = RowsRoute(model)  # how an eager pass computes each row alone (model/serving/rowwise.py)
        self.passes = None  # compiled passes over self.pool (compiled_rows.py), which a caller may give; None: eager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in the order they joined
        self.stats = EngineStats()
        self.pictures = BlockPictures(n_blocks)  # census()'s blocks, each drawn again when it changes

    @property
    def device(self) -> torch.device:
        """Where the pool's keys and values, and so every pass, live."""
        return self.pool.k[0].device

    def census(self) -> Census:
        """A frozen picture of the engine now: each block, each request, the pool's counts and the stats."""
        pool = self.pool
        states = [(r, "prefilling" if r.prefilling else "decoding") for r in self.running]
        states += [(r, "preempted" if r.preemptions else "waiting") for r in self.waiting]
        requests = tuple(RequestCensus(r.name, state, r.prompt_len, r.cached, r.drawn, len(r.blocks), r.preemptions)
                         for r, state in states)
        unread = pool.refs.count(0)
        return Census(blocks=self.pictures.of(pool, self.running), requests=requests, block_tokens=pool.block_tokens,
                      n_blocks=pool.n_blocks, free=pool.available(), used=pool.n_blocks - unread,
                      shared=pool.n_blocks - unread - pool.refs.count(1), idle=len(pool.idle), stats=self.stats)

    def add(self, name, prompt: list[int], max_new_tokens: int, generator: torch.Generator | None = None,
            sampling: Sampling | None = None, kept: Kept | None = None) -> Request:
        """Queue a request; generator: its own, for sampled text that does not depend on the others; kept: what to
        keep of its passes for the caller. With max_new_tokens 0 its prompt is computed, and nothing drawn."""
        block_size, bt = self.model.config.block_size, self.pool.block_tokens
        if not prompt or not (is_integer(max_new_tokens) and max_new_tokens >= 0):
            raise ValueError(f"request {name!r}: give at least one prompt token and max_new_tokens >= 0")
        if len(prompt) + max_new_tokens > block_size:
            raise ValueError(f"request {name!r}: {len(prompt)} prompt tokens and {max_new_tokens} new ones pass "
                             f"block_size={block_size}")
        if -(-(len(prompt) + max_new_tokens) // bt) > self.pool.n_blocks:
            raise ValueError(f"request {name!r} needs more than the pool's {self.pool.n_blocks} blocks")
        request = Request(name, list(prompt), max_new_tokens, len(prompt), generator=generator, sampling=sampling,
                          kept=kept)
        self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """Drop a request that is waiting or running: its blocks go back to the pool at once."""
        if request in self.running:
            self.running.remove(request)
            self._free(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def run(self):
        """Yield (request's name, token) until every request added has drawn its tokens; token None once for a
        request of max_new_tokens 0, when its prompt is computed."""
        while self.waiting or self.running:
            yield from self.step()

    @torch.no_grad()
    def step(self) -> list[tuple[object, int | None]]:
        """One forward pass: a chunk of each joining request's prefill, or one token of every running request."""
        while self.waiting and len(self.running) < self.max_batch and self._admit(self.waiting[0]):
            self.running.append(self.waiting.popleft())
        joining = [r for r in self.running if r.prefilling]
        if joining:  # prefilled together, a whole chunk each while the pass has rows for it
            chunks, left = [], self.rows
            for request in joining:
                n = min(self.chunk, len(request.tokens) - request.fed)
                if n <= left:
                    chunks.append((request, n))
                    left -= n
            return self._forward(*zip(*chunks))
        for request in list(self.running):  # each one's next token needs a slot
            while request in self.running and not self._grow(request):
                self._preempt([r for r in self.running if r is not request][-1])
        return self._forward(self.running, [1] * len(self.running))

    def _admit(self, request: Request) -> bool:
        """Give a waiting request the cached blocks of its first tokens and new ones for the rest, if there are
        enough; the last token is always computed, for its logits. It waits while a joining request computes the
        first block it lacks: then it reads that block instead."""
        bt, pool = self.pool.block_tokens, self.pool
        chain = [] if request.scores_prompt else full_block_names(request.tokens[:-1], bt)
        cached = next((i for i, name in enumerate(chain) if name not in pool.by_hash), len(chain))
        if cached < len(chain) and any(chain[cached] in full_block_names(r.tokens[:-1], bt, r.names)[len(r.names):]
                                       for r in self.running):  # only the blocks each has yet to name are hashed
            return False
        for name in chain[:cached]:
            request.blocks.append(pool.lookup(name))
            request.names.append(name)
        need = -(-len(request.tokens) // bt) - len(request.blocks)
        if need > pool.available():
            self._free(request)
            return False
        request.blocks += [pool.allocate() for _ in range(need)]
        request.fed = request.cached = len(request.names) * bt  # counted at its first pass (_forward)
        return True

    def _grow(self, request: Request) -> bool:
        """Make room for one more token; False when the pool has no block left."""
        if len(request.tokens) <= len(request.blocks) * self.pool.block_tokens:
            return True
        block = self.pool.allocate()
        if block is not None:
            request.blocks.append(block)
        return block is not None

    def _free(self, request: Request) -> None:
        """Give the request's blocks back to the pool and empty its table."""
        for block in request.blocks:
            self.pool.release(block)
        request.blocks, request.names, request.fed = [], [], 0

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free(request)
        self.waiting.appendleft(request)
        self.stats = replace(self.stats, preemptions=self.stats.preemptions + 1)
        request.preemptions += 1

    def _forward(self, requests: list[Request], counts: list[int]) -> list[tuple[object, int | None]]:
        """One pass: counts[b] tokens of requests[b], each token a row of its own as a decoding step computes it
        (model/serving/rowwise.py); draw for each request fed to its end."""
        requests = list(requests)  # those that finish leave self.running below
        # a join's first pass: count the cache it read, now that a decode pass cannot undo it
        for request in (r for r in requests if r.unfed):
            if request.kept is not None and request.kept.cached_tokens is None:  # its first: its prompt's count
                request.kept.cached_tokens = request.cached
            self.stats = replace(self.stats, prompt_tokens=self.stats.prompt_tokens + len(request.tokens),
                                 reused_tokens=self.stats.reused_tokens + request.cached)
        rows = [(r, r.fed + j) for r, n in zip(requests, counts) for j in range(n)]  # (request, position)
        ids, tables, fed = [r.tokens[p] for r, p in rows], [r.blocks for r, _ in rows], [p for _, p in rows]
        if self.buckets is not None and len(rows) <= self.max_batch:  # a fixed-shape pass
            hidden = self.buckets.decode(ids, tables, fed)
        elif self.passes is not None:
            hidden = self.passes(ids, tables, fed)
        else:
            batch = PagedPass.of(self.pool, tables, fed)
            with self.route.alone():
                hidden = self.model(torch.tensor(ids, device=self.device)[:, None], cache=batch)[0][:, 0]
        ends = list(itertools.accumulate(counts))  # each request's rows end here: (rows, vocab_size)
        logits = hidden[[end - 1 for end in ends]]  # each request's last token's
        self.stats = replace(self.stats, passes=self.stats.passes + 1,
                             peak_blocks=max(self.stats.peak_blocks, self.pool.n_blocks - self.pool.available()))
        for request, n, end in zip(requests, counts, ends):
            scoring = min(n, request.prompt_len - 1 - request.fed)  # positions that predict a prompt token
            first = max(request.scored - request.fed, 0)  # a preempted one's are kept already
            if request.scores_prompt and scoring > first:
                request.kept.prompt_logits.append(hidden[end - n + first:end - n + scoring].clone())
                request.scored = request.fed + scoring
            request.fed += n
            self._name_full_blocks(request)
        scored = [r for r in requests if r.fed == len(r.tokens) and not r.max_new_tokens]  # nothing to draw
        for request in scored:
            self.running.remove(request)
            self._free(request)
        ready = [b for b, r in enumerate(requests) if r.fed == len(r.tokens) and r.max_new_tokens]  # others prefill
        greedy = [b for b in ready if (requests[b].sampling or self.sampling).greedy]  # one argmax for them all
        next_ids = dict(zip(greedy, logits[greedy].argmax(-1).tolist())) if greedy else {}
        sampled = [b for b in ready if b not in next_ids]
        if any(requests[b].generator or requests[b].sampling for b in sampled):  # each draws its own way
            next_ids.update((b, int((requests[b].sampling or self.sampling).next_token(
                logits[b, None], requests[b].generator or self.generator))) for b in sampled)
        elif sampled:
            next_ids.update(zip(sampled, self.sampling.next_token(logits[sampled], self.generator).tolist()))
        drawn = [(request.name, None) for request in scored]
        for b in ready:
            request, token = requests[b], next_ids[b]
            request.tokens.append(token)
            if self.keep_logits:
                request.logits.append(logits[b])
            if request.kept is not None and request.kept.draws:
                request.kept.logits.append(logits[b])
            drawn.append((request.name, token))
            if request.drawn == request.max_new_tokens:
                self.running.remove(request)
                self._free(request)
        return drawn

    def _name_full_blocks(self, request: Request) -> None:
        """Name in the pool the blocks the request has filled since it last named one."""
        named = len(request.names)
        request.names = full_block_names(request.tokens[:request.fed], self.pool.block_tokens, request.names)
        for i in range(named, len(request.names)):
            self.pool.name(request.blocks[i], request.names[i])

