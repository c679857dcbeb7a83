"""What fixed shapes add to the engine's decoding steps (model/serving/engine.py): one CUDA graph per batch size.

A graph replays one shape. The engine's running batch changes size at every join and exit, so each decoding step
is padded up to the smallest bucket that holds it, as nano-vllm does: 1, 2, 4, 8, ... up to max_batch. A
bucket's pass reads every row's whole block table (the blocks a block_size context can span), masked past each
row's length. Its inputs are three tensors filled before each step: the tokens, the block tables and the counts
already fed. Rows beyond the batch read and write only the pool's scratch block.

On CUDA each bucket's pass is captured once (model/decoding/cuda_graph.py); elsewhere it runs eagerly, the same
pass, which is how the CPU tests prove it.
"""

import time

import torch

from ..decoding.cuda_graph import record
from .paged import BlockPool, PagedPass
from .rowwise import RowsAlone


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch."""
    return [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch] + [max_batch]


class DecodeBuckets:
    """One-token passes for running batches of up to max_batch rows, padded to a bucket; capture: record each
    bucket's pass as a CUDA graph."""

    def __init__(self, model, pool: BlockPool, max_batch: int, capture: bool):
        self.model, self.pool = model, pool
        self.scratch_block = pool.n_blocks  # the block past those the pool hands out: its first slot is scratch
        width = pool.table_width  # the most blocks a request holds
        device = pool.k[0].device
        self.inputs = {n: (torch.zeros(n, 1, dtype=torch.long, device=device),  # tokens (n, 1)
                           torch.full((n, width), self.scratch_block, device=device),  # block tables (n, width)
                           torch.zeros(n, dtype=torch.long, device=device))  # tokens fed before (n,)
                       for n in bucket_sizes(max_batch)}
        self.graphs, start = {}, time.perf_counter()
        if capture:
            shared = torch.cuda.graph_pool_handle()  # one step at a time reads its logits
            for n, inputs in self.inputs.items():  # every table points at scratch: warm-ups write nothing else
                self.graphs[n] = record(self.run, list(inputs), [], shared)
        self.capture_seconds = time.perf_counter() - start  # not decoding time: callers leave it out of tokens/s

    def run(self, ids, table, fed):
        """ids (n, 1), table (n, width), fed (n,) -> the logits of each row's next token (n, vocab_size)."""
        batch = PagedPass(self.pool, table, fed, torch.ones_like(fed), 1)
        with RowsAlone():
            return self.model(ids, cache=batch)[0][:, -1]

    def decode(self, ids: list[int], tables: list[list[int]], fed: list[int]) -> torch.Tensor:
        """Each running row's last token, block table and tokens fed before it -> its logits (B, vocab_size)."""
        n = next(size for size in self.inputs if size >= len(ids))
        ids_in, table_in, fed_in = self.inputs[n]
        width, pad = table_in.size(1), n - len(ids)
        table_in.copy_(torch.tensor([row + [self.scratch_block] * (width - len(row)) for row in tables]
                                    + [[self.scratch_block] * width] * pad))
        ids_in.copy_(torch.tensor(ids + [0] * pad)[:, None])
        fed_in.copy_(torch.tensor(fed + [0] * pad))
        if n not in self.graphs:
            return self.run(ids_in, table_in, fed_in)[:len(ids)]
        graph, logits = self.graphs[n]
        graph.replay()
        return logits[:len(ids)]
