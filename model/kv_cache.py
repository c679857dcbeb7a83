"""The KV cache: each layer's keys and values, kept so that a decoding step feeds only the new
token.

Token t (counted from 0 since reset) goes to slot t of every layer. A pass of t new tokens writes
their keys and values into their slots, then attends over the filled slots, causally. greedy_decode,
at the end, is the whole idea. The model asks a cache only for begin(t) and each layer's view
(CachePass); what the decoding loop asks of every cache is model/protocol.py's Cache.

Lengths: block_size, the longest context the model sees; reach, how far back a query sees
(block_size, or a local layer's local_window); max_len, a cache layer's slots; budget, the slots of
a cache that chooses what it keeps; spare, slots past block_size that let a chunk cross the ring's
end; keep, what a learned-position context keeps when it jumps forward; span, the longest context
that can still change the next token.
"""

from typing import Callable, NamedTuple, Protocol

import torch
import torch.nn as nn


class CachePass(NamedTuple):
    """What a forward pass of t new tokens needs from a cache; positions and mask stay on the cache's device."""

    positions: torch.Tensor  # (t,) or (B, t): each new token's position
    mask: torch.Tensor | None  # bool (B, nh, t, T_k): True where a query sees a key; None: causal
    layer: Callable[[int], "LayerView | None"]  # cache layer i's view for this pass


class LayerView(Protocol):
    """One cache layer during one pass. A view may also define attend(q, k, v, mask, sink) -> y: the one hook
    for a cache that computes attention itself."""

    def update(self, k_new, v_new): ...  # writes them; returns the keys and values to attend over
    def read(self): ...  # the same keys and values, written by another layer of a shared group


class LayerKV(NamedTuple):
    """One layer's view of the cache during one forward pass."""

    k: torch.Tensor  # (B, n_kv_head, max_len, head_dim)
    v: torch.Tensor  # (B, n_kv_head, max_len, head_dim)
    slots: torch.Tensor  # (t,) where the t new keys and values go
    n_read: int | None  # attention reads slots [:n_read]; None: all of them

    def update(self, k_new, v_new):
        """Write the new keys/values (B, n_kv_head, t, head_dim) in place; return what attention reads."""
        self.k.index_copy_(2, self.slots, k_new.to(self.k.dtype))
        self.v.index_copy_(2, self.slots, v_new.to(self.v.dtype))
        return self.read()

    def read(self):
        """The keys and values attention reads: (B, n_kv_head, n_read, head_dim) each."""
        return self.k[:, :, :self.n_read], self.v[:, :, :self.n_read]


class KVCache(nn.Module):
    """Keys and values for n_kv_layer layers, each (B, n_kv_head, max_len, head_dim), written in place."""

    def __init__(self, n_kv_layer: int, batch_size: int, n_kv_head: int, max_len: int, head_dim: int,
                 dtype=torch.float32, device=None):
        super().__init__()
        self.n_kv_layer, self.batch_size, self.max_len, self.head_dim = n_kv_layer, batch_size, max_len, head_dim
        # a buffer per layer, not views of one big one: a compiled step writes a view by copying the whole buffer.
        # persistent=False: a cache is scratch space, never part of a checkpoint
        self.add_layer_buffers(("k", "v"), (batch_size, n_kv_head, max_len, head_dim), dtype, device)
        # tokens fed since reset: a 0-d tensor, so that a compiled step keeps static shapes (caches/ring.py)
        self.register_buffer("pos", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        self.register_buffer("slot_ids", torch.arange(max_len, device=device), persistent=False)

    def add_layer_buffers(self, names, shape, dtype, device) -> None:
        """A buffer of `shape` for each name and layer: name0, name1, ..., read by layer_buffers(name)."""
        for name in names:
            for i in range(self.n_kv_layer):
                self.register_buffer(f"{name}{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def layer_buffers(self, name: str) -> list[torch.Tensor]:
        return [getattr(self, f"{name}{i}") for i in range(self.n_kv_layer)]

    @property
    def dtype(self) -> torch.dtype:
        return self.k0.dtype

    @property
    def device(self) -> torch.device:
        return self.k0.device

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values."""
        return sum(t.nbytes for t in self.layer_buffers("k") + self.layer_buffers("v"))

    def __len__(self) -> int:
        """Tokens fed since reset(). Reads the counter back (a sync on a GPU)."""
        return int(self.pos)

    def reset(self, n_pad=None) -> None:
        self.pos.zero_()

    def begin(self, t: int) -> CachePass:
        """Take the next t tokens: their positions, the mask (None: causal), each layer's view."""
        fed = len(self)
        if fed + t > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} tokens and has {fed}: {t} more do not fit; "
                             f"new_kv_cache(model, ...) makes a cache that rolls on past block_size")
        new = self.pos + self.slot_ids[:t]  # (t,) the new tokens' positions, and slots
        self.pos += t
        return CachePass(new, None, lambda i: self.layer(i, new, fed + t))

    def layer(self, i: int, slots: torch.Tensor, n_read: int | None) -> LayerKV:
        return LayerKV(getattr(self, f"k{i}"), getattr(self, f"v{i}"), slots, n_read)

    def fill_from(self, other: "KVCache") -> None:
        """Copy a cache of the same shape into this one; a one-row cache fills every row, so that one prefill of a
        prompt serves many samples."""
        for mine, theirs in zip(self.buffers(), other.buffers()):
            mine.copy_(theirs.expand_as(mine))


@torch.no_grad()
def greedy_decode(model, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The KV cache's whole idea: read the prompt once (prefill), then feed one token per step, each step's
    attention reading every earlier key and value from the cache. idx (B, T) -> (B, T + max_new_tokens)."""
    if idx.size(1) + max_new_tokens > model.config.block_size:
        raise ValueError("greedy_decode keeps everything in one context of block_size tokens; use generate")
    c = model.config
    heads, width = c.kv_cache_heads
    cache = KVCache(c.n_kv_layer, idx.size(0), heads, c.block_size, width, model.attention_dtype, idx.device)
    logits = model.decode_step(idx, cache)  # (B, vocab_size); the prompt is now cached
    for _ in range(max_new_tokens):
        next_id = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        idx = torch.cat([idx, next_id], dim=1)
        logits = model.decode_step(next_id, cache)  # one new token; the past from the cache
    return idx
