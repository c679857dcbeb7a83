"""What compiling ahead of time adds to the engine (engine.py): its passes built into C++ by AOTInductor, as the
decoding step is (model/decoding/aot_step.py), so that a pass runs with no Python between its operations.

Every engine pass is rows of one token each: the token, its sequence's block table, and how many tokens that
sequence has fed. Here that pass is exported once, with the count of rows a dimension of its own (1 to the
engine's pass_rows) and the pool's tensors as inputs it updates in place. One compiled code then serves every
pass, prefill and decoding, whatever it holds.

Batch invariance: the eager engine has it by construction (rowwise.py). Compiled code runs the same loops for a
row whatever the count, but whether its products sum a row in one order at every count is up to its kernels. So
check_invariance() tries it on this host before an engine takes the code (runtime/compiled.py).

    program = export_rows(model, engine.pool, engine.rows)
    package = torch._inductor.aoti_compile_and_package(program)  # runtime/compiled.py keeps it on disk
    engine.passes = CompiledRows(load_package(package), engine.pool)
"""

from types import SimpleNamespace

import torch
import torch.nn as nn

from ..decoding.aot_step import attention_in_loops, quiet_tracing
from .paged import BlockPool, PagedPass, block_tables


def pool_tensors(pool: BlockPool) -> list[torch.Tensor]:
    """The pool's stored tensors, each name's layers in turn: what a compiled pass takes after its rows."""
    return [t for stores in pool.buffers.values() for t in stores]


class PoolAsInputs(nn.Module):
    """An engine pass, ids (R, 1), table (R, table_width), fed (R,) -> each row's logits (R, vocab_size), with the
    pool's tensors passed in, so that export traces them as inputs the pass updates in place."""

    def __init__(self, model, pool: BlockPool):
        super().__init__()
        self.model = model
        self.pool = [pool]  # in a list: not a submodule, so that its tensors are no constants of the pass

    def forward(self, ids, table, fed, *tensors):
        pool, layers = self.pool[0], len(self.pool[0].k)
        stores = {name: list(tensors[i * layers:(i + 1) * layers]) for i, name in enumerate(pool.buffers)}
        # the pool as PagedPass reads it, its tensors the inputs; gathered None: compiled code makes its own
        view = SimpleNamespace(buffers=stores, block_tokens=pool.block_tokens, int8=False, scratch=pool.scratch,
                               gathered=None)
        return self.model(ids, cache=PagedPass(view, table, fed, torch.ones_like(fed), 1))[0][:, -1]


@torch.no_grad()
def export_rows(model, pool: BlockPool, rows: int) -> torch.export.ExportedProgram:
    """The engine's pass of 1 to `rows` rows over pools shaped like `pool`, traced by torch.export."""
    if model.training:
        raise ValueError("model is in training mode: call model.eval() before exporting the engine's pass")
    if pool.int8:
        raise ValueError("an int8 pool's passes run eagerly: only a float pool's are compiled")
    tensors = pool_tensors(pool)
    example = (torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, pool.table_width, dtype=torch.long),
               torch.zeros(2, dtype=torch.long))
    count = {0: torch.export.Dim("rows", min=1, max=max(rows, 2))}  # an input, not a constant
    with quiet_tracing():
        program = torch.export.export(PoolAsInputs(model, pool), (*example, *tensors),
                                      dynamic_shapes=(count, count, count, (None,) * len(tensors)))
        return program.run_decompositions({torch.ops.aten.scaled_dot_product_attention.default: attention_in_loops})


class CompiledRows:
    """A loaded compiled engine pass over one pool: passes(ids, tables, fed) is the eager engine's pass, each row
    one token with its block table and the count its sequence has fed -> logits (R, vocab_size)."""

    def __init__(self, runner, pool: BlockPool):
        self.runner, self.pool, self.tensors = runner, pool, pool_tensors(pool)

    def __call__(self, ids: list[int], tables: list[list[int]], fed: list[int]) -> torch.Tensor:
        return self.run(torch.tensor(ids)[:, None], block_tables(self.pool, tables), torch.tensor(fed))

    def run(self, ids, table, fed) -> torch.Tensor:
        """ids (R, 1), table (R, table_width), fed (R,) -> logits (R, vocab_size)."""
        return self.runner.boxed_run([ids, table, fed, *self.tensors])[0]


def check_invariance(passes: CompiledRows, rows: int, vocab_size: int) -> str | None:
    """Whether, here, n rows give each row the bits it gets in a pass of 1, 2 or 3 rows, of half of them, of all
    but one, and in the reverse order; None if so, else what differed. Run before the pool holds any request: row
    r writes slot 0 of block r (the scratch block among them) and reads only that slot."""
    n = min(rows, passes.pool.n_blocks + 1)
    ids = torch.arange(n)[:, None] % vocab_size
    table = torch.arange(n)[:, None].expand(n, passes.pool.table_width).contiguous()
    fed = torch.zeros(n, dtype=torch.long)
    whole = passes.run(ids, table, fed).clone()
    for count in sorted({1, 2, 3, n // 2, n - 1} - {0}):
        if not torch.equal(passes.run(ids[:count], table[:count], fed[:count]), whole[:count]):
            return f"the first {count} rows' logits differ when {n} rows run together"
    if not torch.equal(passes.run(ids.flip(0), table.flip(0), fed), whole.flip(0)):
        return f"{n} rows' logits differ in another order"
    return None
