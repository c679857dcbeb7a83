"""What a ring adds to the plain KV cache (model/kv_cache.py): decoding past block_size, left-padded rows, static
shapes for compiled steps and GPUs, and rolling back the last tokens.

The slots are a ring: token t (counted since reset(), left padding included) goes to slot t % max_len, so the
cache holds the last max_len tokens. A token attends the slots holding itself and the `reach` - 1 tokens before
it (reach: the model's block_size), never its row's left padding (a padding token sees only itself, so no query
is left with no key). With learned positions generate() refills the cache before it would wrap
(model/decoding/generate.py). With rotary positions a score depends only on the distance between two tokens, so the
ring rolls on: the oldest token drops out of view, and every step feeds one token, with no refill.

Which token each slot holds (attn_mask's `held`), for max_len 4 once tokens 0..5 are written (last = 5):

    slot                                   0    1    2    3
    held = last - (last - slot) % 4        4    5    2    3
    after tokens 0..1 only (last = 1)      0    1   -2   -1     (negative: empty so far)

A chunk of t tokens writes t slots at once, so its first queries would lose keys they still see, unless
max_len >= reach + t - 1. max_len = reach serves one token per step, and a chunk that fits before the first
wrap; speculative decoding, which verifies k + 1 tokens in one pass, asks for reach + k slots. rollback(n) then
forgets the last n tokens exactly: the slots they overwrote held tokens that no later query sees.

Eagerly on the CPU, while no row is padded and no token has left the window, the ring is the plain cache, and its
rule runs (KVCache.begin). Past that point one new token still sees every filled slot when the ring is as
long as the window (their order does not matter to attention), so it needs no mask either. Compiled steps and
GPUs read all max_len slots through the mask (static shapes); read_all_slots=True asks for that everywhere. A
step compiled ahead of time reads the filled slots only (read_filled): its code counts them itself.
"""

from typing import NamedTuple

import torch

from ..attention import causal_mask
from ..checks import is_integer
from ..kv_cache import CachePass, KVCache
from ..protocol import Abilities


class CacheShape(NamedTuple):
    """What a cache says of its shape, so that generate checks it against the model before decoding through it."""

    n_kv_layer: int  # cache layers, local ones included
    n_kv_head: int
    head_dim: int
    reach: int | None  # how far back a query sees; None: a budget that places its tokens itself
    local_window: int | None  # the local layers' reach; None: no local layers
    max_len: int  # the global layers' slots
    dtype: torch.dtype  # what attention computes in (an int8 or low-bit cache stores integers)


class RingKVCache(KVCache):
    """A KVCache whose slots are a ring, rows may start with left padding, and each query sees `reach` tokens."""

    abilities = Abilities(slides=True)

    @property
    def k(self) -> list[torch.Tensor]:
        """Each layer's keys; v: its values."""
        return self.layer_buffers("k")

    @property
    def v(self) -> list[torch.Tensor]:
        return self.layer_buffers("v")

    def __init__(self, n_kv_layer: int, batch_size: int, n_kv_head: int, max_len: int, head_dim: int,
                 dtype=torch.float32, device=None, reach: int | None = None, read_all_slots: bool = False):
        super().__init__(n_kv_layer, batch_size, n_kv_head, max_len, head_dim, dtype, device)
        self.register_buffer("n_pad", torch.zeros(batch_size, dtype=torch.long, device=device), persistent=False)
        self.reach = reach or max_len  # the most tokens a query sees: itself and reach - 1 before it
        if self.reach > max_len:
            raise ValueError(f"max_len {max_len} is below the reach of {self.reach} tokens that a query sees: give "
                             f"at least {self.reach} slots")
        self.read_all_slots = read_all_slots
        self.padded = False  # whether reset() was given left padding
        self.reads_filled = False  # whether a traced pass reads only the filled slots (see read_filled)
        self.compute_dtype = dtype  # what attention computes in: the keys' own dtype (an int8 ring's is not)

    @property
    def shape(self) -> CacheShape:
        return CacheShape(self.n_kv_layer, self.k0.size(1), self.head_dim, self.reach, None, self.max_len,
                          self.compute_dtype)

    def reset(self, n_pad=None) -> None:
        """Empty the cache; n_pad (B,) gives how many left-padding tokens each row will start with."""
        super().reset()
        self.n_pad.zero_() if n_pad is None else self.n_pad.copy_(n_pad)
        self.padded = n_pad is not None

    @property
    def static_shapes(self) -> bool:
        """Whether attention reads all max_len slots, masked: when asked to (read_all_slots), when compiled (static
        shapes compile once), and off the CPU (reading `pos` back would wait for the device)."""
        return self.read_all_slots or torch.compiler.is_compiling() or self.pos.device.type != "cpu"

    def begin(self, t: int) -> CachePass:
        if t > 1 and not recording() and t > self.longest_chunk():
            raise ValueError(f"a chunk of {t} tokens must fit in the cache before it first wraps ({self.max_len} "
                             f"slots, {len(self)} fed), or the cache needs reach + {t - 1} = {self.reach + t - 1} "
                             f"slots; feed one token at a time past that")
        if self.static_shapes:
            n_read = self.filled_after(t) if self.reads_filled else None
            new = self.pos + self.slot_ids[:t]  # (t,) the new tokens' numbers since reset
            self.pos += t
            return CachePass(self.positions(new), self.attn_mask(new, n_read), self.views(new % self.max_len, n_read))
        fed = len(self) + t
        if not self.padded and fed <= self.reach:
            return super().begin(t)  # nothing has left the window: the plain cache's rule
        new = self.pos + self.slot_ids[:t]
        self.pos += t
        views = self.views(new % self.max_len, min(fed, self.max_len))
        if not self.padded and t == 1 and self.max_len == self.reach:
            return CachePass(new, None, views)  # one token sees every filled slot
        return CachePass(self.positions(new), self.attn_mask(new, min(fed, self.max_len)), views)

    def read_filled(self, on: bool) -> None:
        """Whether a traced pass reads only the slots filled after it, as the eager one does: an ahead-of-time step,
        whose code may read the count back. A CUDA graph may not, nor torch.compile without a graph break."""
        self.reads_filled = on

    def filled_after(self, t: int):
        """The slots that hold a token once t more are fed, read back inside the traced pass."""
        n = (self.pos + t).clamp(max=self.max_len).item()
        torch._check(1 <= n)
        torch._check(n <= self.max_len)
        return n

    def views(self, slots: torch.Tensor, n_read: int | None):
        """Each layer's view for a pass that writes `slots` and reads slots [:n_read] (None: all)."""
        return lambda i: self.layer(i, slots, n_read)

    def longest_chunk(self) -> int:
        """The most tokens the next forward pass may feed: those that fit before the ring first wraps, or
        max_len - reach + 1 (see the module). Reads `pos` back (a sync on GPU)."""
        return max(self.max_len - len(self), self.max_len - self.reach + 1)

    def positions(self, new):
        """(B, t) position of each new token in its row, counted from the row's first real token."""
        return (new[None, :] - self.n_pad[:, None]).clamp(min=0)

    def attn_mask(self, new, n_read: int | None = None):
        """(B, 1, t, n_read) bool, True where new token i may attend slot j < n_read (None: max_len), once the t
        tokens are written."""
        last = new[-1]
        held = last - (last - self.slot_ids[:n_read]) % self.max_len  # (n_read,) each slot's token; < 0: none yet
        age = new[:, None] - held[None, :]  # (t, n_read) how far back each slot's token is
        seen = (held >= 0) & (age >= 0) & (age < self.reach)  # (t, n_read): itself and reach - 1 before it
        not_pad = held[None, :] >= self.n_pad[:, None]  # (B, n_read)
        own = held[None, :] == new[:, None]  # (t, n_read)
        return seen[None, None] & (not_pad[:, None, None, :] | own[None, None])

    def rollback(self, n: int) -> None:
        """Forget the last n tokens fed (speculative decoding's rejected drafts): the next ones overwrite them."""
        if not (is_integer(n) and 0 <= n <= len(self)):
            raise ValueError(f"n must be an integer in [0, {len(self)}], the tokens the cache holds: cannot roll back "
                             f"{n!r}")
        if n > self.max_len - self.reach + 1 and len(self) > self.max_len:
            # the last of them overwrote a token that the next one fed would still see
            raise ValueError(f"cannot roll back {n} tokens of a ring of {self.max_len} slots that has wrapped: it "
                             f"rolls back max_len - reach + 1 = {self.max_len - self.reach + 1} at most; make "
                             f"the cache with max_len = reach + {n - 1}")
        self.pos -= n

    def one_row(self) -> "RingKVCache":
        """An empty cache like this one, of one row: generate prefills a prompt shared by every row into it."""
        return type(self)(self.n_kv_layer, 1, self.k0.size(1), self.max_len, self.head_dim, self.dtype, self.device,
                          reach=self.reach, read_all_slots=self.read_all_slots)

    def fill_from(self, other: "RingKVCache") -> None:
        super().fill_from(other)
        self.padded = other.padded


def recording() -> bool:
    """Whether this pass is traced by torch.compile or captured as a CUDA graph: no value may be read back then."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class Uncached:
    """Positions and a mask for a forward pass without a cache, by the ring's rule: each token sees itself and
    reach - 1 before it (past block_size, rotary models see block_size back), and a row's left padding (n_pad (B,)
    or None) is seen by no other token. model(idx, cache=Uncached(reach, n_pad, device)) gives a padded row the
    logits it would get alone."""

    abilities = Abilities(rolls_back=False, compiles=False, slides=True)

    def __init__(self, reach: int, n_pad: torch.Tensor | None = None, device=None):
        self.reach, self.n_pad = reach, n_pad
        self.device = n_pad.device if n_pad is not None else device

    def begin(self, t: int) -> CachePass:
        device = self.device
        pos = torch.arange(t, device=device)  # (t,)
        mask = causal_mask(t, t, device, reach=self.reach)  # (t, t)
        if self.n_pad is None:
            return CachePass(pos, mask, lambda i: None)
        pos = (pos[None, :] - self.n_pad[:, None]).clamp(min=0)  # (B, t), counted from each row's first token
        not_pad = torch.arange(t, device=device)[None, :] >= self.n_pad[:, None]  # (B, t)
        own = torch.eye(t, dtype=torch.bool, device=device)
        return CachePass(pos, mask & (not_pad[:, None, None, :] | own), lambda i: None)  # (B, 1, t, t)


def cache_shape(model, batch_size: int) -> dict:
    """The plain KVCache's arguments for batch_size rows of block_size tokens of model: KVCache(**shape)."""
    c = model.config
    n_kv_head, head_dim = c.kv_cache_heads
    return dict(n_kv_layer=c.n_kv_layer, batch_size=batch_size, n_kv_head=n_kv_head, max_len=c.block_size,
                head_dim=head_dim, dtype=model.attention_dtype, device=model.wte.weight.device)
