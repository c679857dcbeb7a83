"""What a 4- or 2-bit KV cache adds to the ring (model/caches/ring.py), after KIVI (Liu et al., 2024).

A few key channels carry large values for every token, while values vary from token to token. So keys are
quantized per channel, over a group of `group` tokens, and values per token, over a group of `group` channels.
Each group keeps a scale and a zero, and x ≈ zero + scale * q with q in [0, 2^bits - 1]. A byte holds 8 / bits
of the q's.

A group of keys can be quantized only once all its tokens are fed. Until then, and for the last `residual` tokens
in all, keys and values are also kept in full precision, in a ring of their own. Attention reads those recent
tokens as they are, and the older ones dequantized to float. With residual at least the tokens a query sees,
nothing is ever read quantized, and the cache is exact.

    cache = new_lowbit_cache(model, batch_size=8, bits=4)
    ids = generate(model, prompt, 200, cache=cache)

Eager only: which groups complete depends on how many tokens were fed. It cannot roll back (speculative
decoding): a rolled-back token has overwritten the full-precision copy of an older one.
"""

import torch

from ..checks import is_integer
from .ring import RingKVCache, cache_shape
from ..protocol import Abilities

LOW_BITS = (2, 4)  # 8 bits is the int8 cache (model/caches/int8.py)
LOWBIT_SCALE_DTYPE = torch.float16  # each group's scale and zero
GROUP = 16  # tokens per group of keys, channels per group of values (at most residual)
RESIDUAL = 16  # the most recent tokens, kept in full precision too (at most the cache's slots)


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization over `dim`: (q uint8 in [0, 2^bits - 1], scale, zero), the last two with dim kept
    as 1 and in LOWBIT_SCALE_DTYPE, x ≈ zero + scale * q. q is computed from the scale and zero as kept."""
    x = x.float()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp(min=1e-6).to(LOWBIT_SCALE_DTYPE)
    zero = lo.to(LOWBIT_SCALE_DTYPE)
    q = ((x - zero.float()) / scale.float()).round().clamp(0, 2**bits - 1)
    return q.to(torch.uint8), scale, zero


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n) uint8 values below 2^bits -> (..., n * bits / 8) bytes; value j of each byte in bits j*bits up."""
    per_byte = 8 // bits
    q = q.view(*q.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=q.device)
    return (q << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """pack's inverse: (..., m) bytes -> (..., m * 8 / bits) uint8 values."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & (2**bits - 1)).flatten(-2)


class LowBitLayerKV:
    """One layer's view of a low-bit cache during one forward pass (LayerKV's update and read)."""

    def __init__(self, cache: "LowBitKVCache", i: int, slots: torch.Tensor, n_read: int | None):
        self.cache, self.slots, self.n_read = cache, slots, n_read
        self.first = int(cache.pos) - slots.size(0)  # the first new token's number: the pass has counted them
        self.k, self.v, self.k_scale, self.k_zero, self.v_scale, self.v_zero, self.k_recent, self.v_recent = (
            getattr(cache, f"{name}{i}") for name in LowBitKVCache.LAYER_BUFFERS)

    def update(self, k_new, v_new):
        """Quantize the t new keys/values (B, n_kv, t, hs) where they can be, keep them in full precision among
        the recent ones; return what attention reads."""
        c, t = self.cache, k_new.size(2)
        bits, g, R = c.bits, c.group, c.residual
        first = self.first
        B, n_kv, _, hs = k_new.shape
        q, scale, zero = quantize(v_new.reshape(B, n_kv, t, hs // c.value_group, c.value_group), bits, dim=-1)
        self.v.index_copy_(2, self.slots, pack(q.view(B, n_kv, t, hs), bits))
        self.v_scale.index_copy_(2, self.slots, scale.squeeze(-1))
        self.v_zero.index_copy_(2, self.slots, zero.squeeze(-1))
        # keys: the recent ones in token order, then the new ones; each group that the new ones complete
        before = min(first, R)  # recent tokens first - before .. first - 1
        staged = torch.cat([self.k_recent[:, :, c.token_slots(first - before, before, R)].float(), k_new.float()],
                           dim=2)
        for end in range((first + g) // g * g - 1, first + t, g):  # each group's last token, among the new ones
            start = end - g + 1
            q, scale, zero = quantize(staged[:, :, start - first + before:start - first + before + g], bits, dim=2)
            self.k.index_copy_(2, c.token_slots(start, g, c.max_len), pack(q, bits))
            self.k_scale[:, :, start % c.max_len // g] = scale.squeeze(2)
            self.k_zero[:, :, start % c.max_len // g] = zero.squeeze(2)
        kept = min(t, R)  # the new tokens that stay recent
        recent = c.token_slots(first + t - kept, kept, R)
        self.k_recent.index_copy_(2, recent, k_new[:, :, -kept:].to(self.k_recent.dtype))
        self.v_recent.index_copy_(2, recent, v_new[:, :, -kept:].to(self.v_recent.dtype))
        return self.read()

    def read(self):
        """Keys and values (B, n_kv, n_read or max_len, hs) as attention reads them: the last `residual` tokens
        as they were fed, the older ones dequantized (a shared layer reads what its group's first wrote)."""
        c = self.cache
        fed = self.first + self.slots.size(0)  # the tokens fed, this pass's included
        n = self.n_read or c.max_len
        B, n_kv = self.k.shape[:2]
        k = unpack(self.k[:, :, :n], c.bits).float()  # (B, n_kv, n, hs)
        k = self.k_zero.repeat_interleave(c.group, dim=2)[:, :, :n] + self.k_scale.repeat_interleave(
            c.group, dim=2)[:, :, :n] * k
        v = unpack(self.v[:, :, :n], c.bits).float().view(B, n_kv, n, -1, c.value_group)
        v = (self.v_zero[:, :, :n, :, None] + self.v_scale[:, :, :n, :, None] * v).flatten(-2)
        kept = min(fed, c.residual)
        slots, recent = c.token_slots(fed - kept, kept, c.max_len), c.token_slots(fed - kept, kept, c.residual)
        k[:, :, slots], v[:, :, slots] = self.k_recent[:, :, recent], self.v_recent[:, :, recent]
        return k.to(c.compute_dtype), v.to(c.compute_dtype)


class LowBitKVCache(RingKVCache):
    """A RingKVCache that stores keys and values in `bits` bits (2 or 4), packed, with a scale and a zero per
    group, and the last `residual` tokens in full precision too. `dtype` is what attention computes in. The ring,
    masks and left padding are RingKVCache's."""

    LAYER_BUFFERS = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero", "k_recent", "v_recent")

    def __init__(self, n_kv_layer: int, batch_size: int, n_kv_head: int, max_len: int, head_dim: int,
                 dtype=torch.float32, device=None, *, bits: int, group: int | None = None,
                 residual: int | None = None, **kwargs):
        group, residual = lowbit_defaults(max_len, group, residual)
        check_lowbit(bits, group, residual, max_len, head_dim)
        super().__init__(n_kv_layer, batch_size, n_kv_head, max_len, head_dim * bits // 8, torch.uint8, device,
                         **kwargs)
        self.bits, self.group, self.residual, self.compute_dtype = bits, group, residual, dtype
        self.head_dim = head_dim  # the buffers hold it packed, bits / 8 bytes a value
        self.value_group = min(group, head_dim)
        self.add_layer_buffers(("k_scale", "k_zero"), (batch_size, n_kv_head, max_len // group, head_dim),
                               LOWBIT_SCALE_DTYPE, device)
        self.add_layer_buffers(("v_scale", "v_zero"), (batch_size, n_kv_head, max_len, head_dim // self.value_group),
                               LOWBIT_SCALE_DTYPE, device)
        self.add_layer_buffers(("k_recent", "v_recent"), (batch_size, n_kv_head, residual, head_dim), dtype, device)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for name in self.LAYER_BUFFERS for t in self.layer_buffers(name))

    def token_slots(self, first: int, n: int, ring: int) -> torch.Tensor:
        """(n,) the slots of tokens first .. first + n - 1 (n <= max_len) in a ring of `ring` slots."""
        return (first + self.slot_ids[:n]) % ring

    abilities = Abilities(rolls_back=False, compiles=False, slides=True)  # its quantized groups depend on what is fed

    def layer(self, i: int, slots: torch.Tensor, n_read: int | None) -> LowBitLayerKV:
        if torch.compiler.is_compiling():
            raise ValueError("a low-bit KV cache decodes eagerly: which groups it quantizes depends on the tokens "
                             "fed; drop compile")
        return LowBitLayerKV(self, i, slots, n_read)

    def rollback(self, n: int) -> None:
        if n:
            raise ValueError(f"a {self.bits}-bit KV cache cannot roll back: the tokens to forget have overwritten "
                             f"the full-precision copies of older ones; decode without speculation")

    def one_row(self) -> "LowBitKVCache":
        return LowBitKVCache(self.n_kv_layer, 1, self.k0.size(1), self.max_len, self.head_dim, self.compute_dtype,
                             self.device, bits=self.bits, group=self.group, residual=self.residual,
                             reach=self.reach, read_all_slots=self.read_all_slots)


def lowbit_defaults(max_len: int, group: int | None, residual: int | None) -> tuple[int, int]:
    """group and residual as given, or RESIDUAL and GROUP, cut to what a cache of max_len slots holds."""
    residual = min(RESIDUAL, max_len) if residual is None else residual
    return min(GROUP, residual) if group is None else group, residual


def check_lowbit(bits, group, residual, max_len, head_dim) -> None:
    """A ValueError naming what is wrong with a low-bit cache's settings."""
    if bits not in LOW_BITS:
        raise ValueError(f"a low-bit KV cache holds 2 or 4 bits per value (8: the int8 cache), got bits={bits!r}")
    if not (is_integer(group) and group >= 1 and max_len % group == 0):
        raise ValueError(f"group must be an integer >= 1 that divides the cache's {max_len} slots, got {group!r}")
    if head_dim % min(group, head_dim) or head_dim * bits % 8:
        raise ValueError(f"the head width {head_dim} must be a multiple of group={group} (or below it) and of "
                         f"{8 // bits} values per byte; the int8 cache takes any width")
    if not (is_integer(residual) and group <= residual <= max_len and residual % group == 0):
        raise ValueError(f"residual must be a multiple of group={group}, from one group to the cache's {max_len} "
                         f"slots, got {residual!r}")


def new_lowbit_cache(model, batch_size: int, bits: int, max_len: int | None = None, *, group: int | None = None,
                     residual: int | None = None, read_all_slots: bool = False) -> LowBitKVCache:
    """An empty low-bit cache for batch_size rows of model, like new_kv_cache's (factory.py; max_len: its slots)."""
    if model.config.local_window is not None:
        raise ValueError("a low-bit KV cache serves layers that attend everything: drop window_pattern, or use "
                         "the float or int8 cache")
    shape = cache_shape(model, batch_size)
    shape.update(max_len=max_len or shape["max_len"], reach=model.config.block_size, read_all_slots=read_all_slots)
    return LowBitKVCache(**shape, bits=bits, group=group, residual=residual)


def lowbit_cache_bytes(config, bits: int, max_len: int | None = None, group: int | None = None,
                       residual: int | None = None) -> int:
    """Bytes a one-row cache from new_lowbit_cache holds: packed keys and values, a scale and a zero per group,
    and the full-precision recent tokens (float32)."""
    max_len = max_len or config.block_size
    group, residual = lowbit_defaults(max_len, group, residual)
    heads, width = config.kv_cache_heads
    packed = 2 * max_len * width * bits // 8
    scales = 2 * LOWBIT_SCALE_DTYPE.itemsize * (max_len // group * width + max_len * (width // min(group, width)))
    recent = 2 * residual * width * 4
    return config.n_kv_layer * heads * (packed + scales + recent)
