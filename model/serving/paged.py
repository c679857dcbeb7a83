"""What paging adds to the KV cache (model/kv_cache.py): many sequences over one pool of blocks.

Keys and values live in blocks of `block_tokens` slots, drawn from one pool shared by every sequence. A sequence
holds a block table: token n sits in slot n % block_tokens of block table[n // block_tokens]. Here are the blocks'
tensors; model/serving/blocks.py keeps their books (who reads each block, the prefix cache's names, which block
goes next), and BlockPool is both: the books, and the tensors they count.

A forward pass reads each sequence through its table (PagedPass): the model sees it as a cache, with one row per
token the engine feeds, each row's keys gathered from its sequence's blocks and masked past its own position.
model/serving/engine.py schedules requests over the pool.
"""

import itertools
import math

import torch

from ..caches.int8 import KV_SCALE_DTYPE, Int8LayerKV, Quantized, quantize_int8
from ..kv_cache import CachePass
from ..caches.ring import cache_shape
from .blocks import BlockBooks, full_block_names

POOLED = ("float", "int8")  # the caches of model/caches/factory.py whose keys and values a pool stores


class BlockPool(BlockBooks):
    """n_blocks blocks of block_tokens slots: every layer's keys and values, and the books (BlockBooks) of them."""

    def __init__(self, model, n_blocks: int, block_tokens: int, int8: bool = False, max_rows: int = 1):
        super().__init__(n_blocks, block_tokens)
        device = next(model.parameters()).device
        self.dtype = model.attention_dtype  # what attention computes in
        layers, stored, gathered = self.layout(model, n_blocks, block_tokens, int8, max_rows)
        self.buffers = {name: [torch.zeros(dims, dtype=dtype, device=device) for _ in range(layers)]
                        for name, (dims, dtype) in stored.items()}
        self.k, self.v = self.buffers["k"], self.buffers["v"]
        self.int8 = int8
        self.scratch = n_blocks * block_tokens
        self.table_width = -(-model.config.block_size // block_tokens)  # the most blocks a request holds
        self.gathered = {name: torch.empty(dims, dtype=dtype, device=device) for name, (dims, dtype) in
                         gathered.items()}

    @staticmethod
    def layout(model, n_blocks: int, block_tokens: int, int8: bool = False, max_rows: int = 1):
        """What a pool allocates, without allocating it: its layers, and per name the shape and dtype of each
        layer's stored tensor and of the one gathered tensor."""
        shape = cache_shape(model, 1)
        # one block more than the pool hands out: its first slot takes the keys of rows' padding (PagedPass)
        slots, heads, width = (n_blocks + 1) * block_tokens, shape["n_kv_head"], shape["head_dim"]
        # name: per layer (slots, n_kv_head, width), one slot per row, for index_copy_ and gathers. int8 keys and
        # values keep a scale per slot and head beside them (model/caches/int8.py)
        stored = {name: ((slots, heads, 1 if name.endswith("scale") else width),
                         KV_SCALE_DTYPE if name.endswith("scale") else torch.int8 if int8 else model.attention_dtype)
                  for name in ("k", "v", *(("k_scale", "v_scale") if int8 else ()))}
        # What a pass reads, gathered into buffers made once: a fresh one each layer costs more than the gather.
        # One serves every layer in turn, as a layer's attention is done with its keys before the next reads.
        rows = max_rows * -(-model.config.block_size // block_tokens)
        gathered = {name: ((rows, block_tokens, *dims[1:]), dtype) for name, (dims, dtype) in stored.items()}
        return shape["n_kv_layer"], stored, gathered

    @staticmethod
    def bytes_needed(model, n_blocks: int, block_tokens: int, int8: bool = False, max_rows: int = 1) -> int:
        """The bytes BlockPool(model, n_blocks, block_tokens, int8, max_rows) allocates for keys and values."""
        layers, stored, gathered = BlockPool.layout(model, n_blocks, block_tokens, int8, max_rows)
        specs = [*stored.values()] * layers + [*gathered.values()]
        return sum(math.prod(dims) * dtype.itemsize for dims, dtype in specs)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for tensors in self.buffers.values() for t in tensors)

    def export_prefix(self, tokens: list[int]) -> dict:
        """The cached blocks of tokens' first full blocks, as far as the pool holds them: tensors, for torch.save."""
        bt = self.block_tokens
        names = list(itertools.takewhile(self.by_hash.__contains__, full_block_names(tokens, bt)))
        blocks = torch.tensor([self.by_hash[name] for name in names], dtype=torch.long)
        return {"tokens": torch.tensor(tokens[:len(names) * bt], dtype=torch.long),
                **{name: torch.stack([store.view(-1, bt, *store.shape[1:])[blocks].cpu() for store in stores])
                   for name, stores in self.buffers.items()}}

    def import_prefix(self, prefix: dict) -> int:
        """Take an export_prefix() of the same model into this pool, as cached blocks; how many it added."""
        bt = self.block_tokens
        tokens, n = prefix["tokens"].tolist(), len(prefix["tokens"]) // bt
        fits = {name: (len(stores), n, bt, *stores[0].shape[1:]) for name, stores in self.buffers.items()}
        if len(tokens) % bt or any(name not in prefix or prefix[name].shape != shape
                                   or prefix[name].dtype != self.buffers[name][0].dtype
                                   for name, shape in fits.items()):
            raise ValueError(f"the prefix's blocks do not fit this pool's {fits['k']} in {self.k[0].dtype}: another "
                             f"design, block size or precision")
        added = 0
        for i, name in enumerate(full_block_names(tokens, bt)):
            if name in self.by_hash:
                continue
            block = self.allocate()
            if block is None:
                raise ValueError(f"the pool has no room for the prefix's {len(tokens) // bt} blocks")
            for kind, stores in self.buffers.items():
                for layer, store in enumerate(stores):
                    store.view(-1, bt, *store.shape[1:])[block] = prefix[kind][layer, i]
            self.name(block, name)
            self.release(block)  # cached, read by no one yet
            added += 1
        return added


def block_tables(pool: BlockPool, tables: list[list[int]]) -> torch.Tensor:
    """The engine's block tables as a pass reads them, (B, table_width): every row as wide, padded with block 0,
    which its mask hides past the row's length."""
    n = pool.table_width
    return torch.tensor([row[:n] + [0] * (n - len(row[:n])) for row in tables], device=pool.k[0].device)


class PagedLayer:
    """One layer's view of a PagedPass: LayerKV's update, through the block tables."""

    def __init__(self, i: int, batch: "PagedPass"):
        self.stores = {name: tensors[i] for name, tensors in batch.pool.buffers.items()}
        self.batch = batch

    def update(self, k_new, v_new):
        """Write the new keys/values (B, n_kv, t, hs) into their slots; return each row's (B, n_kv, L, hs)."""
        b = self.batch
        new = {"k": k_new, "v": v_new}
        if b.pool.int8:
            (new["k"], new["k_scale"]), (new["v"], new["v_scale"]) = (quantize_int8(x, KV_SCALE_DTYPE)
                                                                      for x in (k_new, v_new))
        for name, store in self.stores.items():
            store.index_copy_(0, b.write, new[name].transpose(1, 2).reshape(-1, *store.shape[1:]).to(store.dtype))
        return self.read()

    def read(self):
        """Each row's keys and values, (B, n_kv, L, hs): for layers that share another's (model/designs/shared_kv.py). int8 ones
        come with their scales, as Quantized (model/caches/int8.py)."""
        b = self.batch
        B, n = b.table.shape
        bt = b.pool.block_tokens  # whole blocks at once: each a contiguous run of slots
        blocks = b.table.flatten()
        gathered = b.pool.gathered  # None: fresh tensors, as compiled code makes its own (compiled_rows.py)
        rows = {name: torch.index_select(store.view(-1, bt, *store.shape[1:]), 0, blocks,
                                         out=None if gathered is None else gathered[name][:B * n])
                .view(B, n * bt, *store.shape[1:]).transpose(1, 2) for name, store in self.stores.items()}
        if not b.pool.int8:
            return rows["k"], rows["v"]
        # int8 rows copied in order, cheaper than the float ones attention would otherwise copy (rowwise.py)
        return tuple(Quantized(rows[x].contiguous(), rows[f"{x}_scale"].to(b.pool.dtype)) for x in ("k", "v"))


class Int8PagedLayer(PagedLayer):
    """A view of a pool of int8 keys and values, which attends them as the int8 cache does."""

    attend = Int8LayerKV.attend


class PagedPass:
    """The cache a forward pass sees: rows are sequences, row b feeding counts[b] new tokens after the fed[b]
    already in the pool, right-padded to t; each row's keys its own, read through its block table (B, n), up to
    its own length. A padding token repeats its row's last position and writes its keys and values to the pool's
    scratch slot. Built from tensors alone, with no read back to the host: model/serving/buckets.py captures it."""

    def __init__(self, pool: BlockPool, table: torch.Tensor, fed: torch.Tensor, counts: torch.Tensor, t: int):
        self.pool, self.table = pool, table  # (B, n): the blocks attention reads
        bt, device = pool.block_tokens, table.device
        new = torch.arange(t, device=device)  # (t,)
        self.positions = fed[:, None] + new.minimum(counts[:, None] - 1)  # (B, t): padding repeats the last one
        self.write = torch.where(new < counts[:, None], table.gather(1, self.positions // bt) * bt
                                 + self.positions % bt, pool.scratch).flatten()  # (B * t,)
        keys = torch.arange(table.size(1) * bt, device=device)  # (L,): past a row's length, masked
        self.mask = (keys <= self.positions[..., None])[:, None]  # (B, 1, t, L): causal, within its own length

    @classmethod
    def of(cls, pool: BlockPool, tables: list[list[int]], fed: list[int]) -> "PagedPass":
        """A pass of one token per row over the engine's block tables, after fed[b] tokens of its row's sequence.
        Every row reads the pool's table_width blocks, so that its attention sums over as many keys whatever the
        others need (masked past its length)."""
        fed = torch.tensor(fed, device=pool.k[0].device)
        return cls(pool, block_tables(pool, tables), fed, torch.ones_like(fed), 1)

    def begin(self, t: int) -> CachePass:
        """The pass itself: the engine counts what each sequence has fed."""
        view = Int8PagedLayer if self.pool.int8 else PagedLayer
        return CachePass(self.positions, self.mask, lambda i: view(i, self))
