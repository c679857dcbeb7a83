"""A decoder-only transformer (GPT) built from MultiHeadAttention, and the KV cache its decoding step reads.

The cache's size is a design choice (GPTConfig): n_kv_head key/value heads (grouped- and multi-query attention),
kv_share adjacent layers reading one set of keys and values, and int8 storage (model/quantize.py)."""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import MultiHeadAttention, attention_dtype, causal_mask, rotary

POSITIONS = ("learned", "rope")


@dataclass
class GPTConfig:
    vocab_size: int  # a fact about the data: the number of distinct tokens
    block_size: int  # longest context the model sees (and, for learned positions, the number of positions)
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True  # in the Linear and LayerNorm layers
    pos_emb: str = "learned"  # learned: a trained vector per position (GPT-2); rope: rotary positions
    n_kv_head: int | None = None  # key/value heads (None: n_head); 1 is multi-query attention
    kv_share: int = 1  # adjacent layers that share one set of keys and values

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_kv_layer(self) -> int:
        """Layers that project keys and values, and so the KV cache's layers: one per kv_share group."""
        return self.n_layer // self.kv_share

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head", "kv_share"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head {self.n_kv_head} must divide n_head {self.n_head}: each key/value head "
                             f"serves an equal group of query heads")
        if self.n_layer % self.kv_share:
            raise ValueError(f"kv_share {self.kv_share} must divide n_layer {self.n_layer}: layers share keys and "
                             f"values in equal groups")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.pos_emb not in POSITIONS:
            raise ValueError(f"pos_emb must be one of {', '.join(POSITIONS)}, got {self.pos_emb!r}")
        if self.pos_emb == "rope" and self.head_dim % 2:
            raise ValueError(f"rope turns channel pairs: the head width n_embd / n_head = "
                             f"{self.head_dim} must be even")


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attention(ln(x)), then x + mlp(ln(x)).
    project_kv=False: the block's attention reads an earlier layer's keys and values."""

    def __init__(self, config: GPTConfig, project_kv: bool = True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = MultiHeadAttention(config.n_embd, config.n_head, bias=config.bias, dropout=config.dropout,
                                       n_kv_head=config.n_kv_head, project_kv=project_kv)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, attn_mask=None, rope=None, cache=None, need_weights=False):
        """attn_mask None means plain causal attention; returns (x, attention weights or None)."""
        a, weights = self.attn(self.ln_1(x), attn_mask=attn_mask, is_causal=attn_mask is None, rope=rope,
                               cache=cache, need_weights=need_weights)
        x = x + a
        return x + self.mlp(self.ln_2(x)), weights


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.pos_emb == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        # the first layer of each group of kv_share projects the keys and values that the group reads
        self.blocks = nn.ModuleList(Block(config, project_kv=i % config.kv_share == 0) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix embeds tokens and scores them

        self.apply(self._init_weights)
        for block in self.blocks:  # GPT-2: scale residual projections by the depth of the residual sum
            for proj in (block.attn.out_proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None, *, cache=None, n_pad=None):
        """idx (B, T) token ids -> (logits (B, T, vocab_size), mean cross-entropy or None).

        cache: a KVCache; idx are the next tokens after those already in it.
        n_pad: (B,) long, how many tokens at the start of each row are left padding (without a cache;
        a cache holds its own counts). A padded row gets exactly the logits it would get alone.
        """
        x, _ = self._trunk(idx, cache, n_pad)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def attention_weights(self, idx) -> list:
        """Each layer's attention weights for idx (B, T): a list of n_layer tensors (B, n_head, T, T)."""
        return self._trunk(idx, need_weights=True)[1]

    def decode_step(self, idx, cache):
        """Feed idx (B, T) after the cached tokens: a prefill when T > 1, one decoding step when T = 1.
        Returns the logits of the last position (B, vocab_size)."""
        x, _ = self._trunk(idx, cache)
        return self.lm_head(x[:, -1])

    def _trunk(self, idx, cache=None, n_pad=None, need_weights=False):
        """Embeddings and blocks: (final normalised hidden states (B, T, C), per-layer weights)."""
        B, T = idx.shape
        c = self.config
        if self.wpe is not None and cache is None and T > c.block_size:
            raise ValueError(f"{T} tokens, but learned positions stop at block_size={c.block_size}: "
                             f"feed the last {c.block_size} at most")
        if cache is not None:
            pos, attn_mask, slots, n_read = cache.for_tokens(T)  # (B, T) or (T,); (B, 1, T, T_k) or None
        else:
            pos = torch.arange(T, device=idx.device)  # (T,)
            attn_mask = None  # plain causal attention: the fastest SDPA kernels
            if n_pad is not None or T > c.block_size:
                # past block_size a rotary model sees block_size tokens back, as its rolling cache does
                attn_mask = causal_mask(T, T, idx.device, window=c.block_size)  # (T, T)
            if n_pad is not None:
                pos = (pos[None, :] - n_pad[:, None]).clamp(min=0)  # (B, T), counted from each row's first token
                not_pad = torch.arange(T, device=idx.device)[None, :] >= n_pad[:, None]  # (B, T)
                attn_mask = attn_mask & not_pad[:, None, None, :]  # (B, 1, T, T)
        x = self.wte(idx)  # (B, T, C)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(pos)
        else:
            rope = rotary(pos, c.head_dim)  # turns queries and keys in every layer
        x = self.drop(x)
        weights = []
        for i, block in enumerate(self.blocks):
            if i % c.kv_share == 0:  # a new group: its keys and values, which the group's other layers read
                kv = cache.layer(i // c.kv_share, slots, n_read) if cache is not None else \
                    SharedKV() if c.kv_share > 1 else None
            x, w = block(x, attn_mask, rope, kv, need_weights)
            weights.append(w)
        if cache is not None:
            cache.advance(T)
        return self.ln_f(x), weights

    @property
    def attention_dtype(self) -> torch.dtype:
        """What attention computes in, and a float cache's dtype (see attention_dtype)."""
        w = self.wte.weight
        return attention_dtype(w.dtype, w.device)

    def new_kv_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None, *,
                     read_all_slots: bool = False) -> "KVCache":
        """An empty cache for batch_size rows, on this model's device. max_len: its slots (default block_size;
        more let a chunk of tokens wrap the ring, see KVCache). dtype: the dtype attention computes in (see
        attention_dtype) unless given; torch.int8 stores int8 keys and values (model/quantize.py).
        read_all_slots: attention always reads every slot through the cache's mask (see KVCache)."""
        c = self.config
        shape = dict(n_layer=c.n_kv_layer, batch_size=batch_size, n_kv_head=c.n_kv_head,
                     max_len=max_len or c.block_size, head_dim=c.head_dim, window=c.block_size,
                     device=self.wte.weight.device, read_all_slots=read_all_slots)
        dtype = self.kv_cache_dtype(dtype)
        if dtype == torch.int8:
            from .quantize import Int8KVCache  # the int8 design lives beside the int8 weights
            return Int8KVCache(**shape, dtype=self.attention_dtype)
        return KVCache(**shape, dtype=dtype)

    def kv_cache_dtype(self, dtype: torch.dtype | None = None) -> torch.dtype:
        """The dtype new_kv_cache(dtype=dtype) stores keys and values in: attention's own unless given."""
        if dtype is not None and not (dtype.is_floating_point or dtype == torch.int8):
            raise ValueError(f"a KV cache holds floating-point keys and values, or int8 ones: dtype {dtype}")
        return dtype or self.attention_dtype


def kv_cache_bytes_per_token(config: GPTConfig, dtype: torch.dtype) -> int:
    """Bytes a KV cache of `dtype` holds per token and row: keys and values, for every layer that projects them
    (n_layer / kv_share) and each key/value head; int8 adds one KV_SCALE_DTYPE scale per token and head to each."""
    per_head = config.head_dim * dtype.itemsize + (KV_SCALE_DTYPE.itemsize if dtype == torch.int8 else 0)
    return 2 * config.n_kv_layer * config.n_kv_head * per_head


KV_SCALE_DTYPE = torch.float32  # an int8 cache's scales (model/quantize.py: Int8KVCache)


class LayerKV(NamedTuple):
    """One layer's view of the cache during one forward pass."""

    k: torch.Tensor  # (B, n_kv, max_len, hs)
    v: torch.Tensor  # (B, n_kv, max_len, hs)
    slots: torch.Tensor  # (T,) where the T new keys and values go
    n_read: int | None  # attention reads slots [:n_read]; None: all max_len of them, through the cache's mask

    def update(self, k_new, v_new):
        """Write the new keys/values (B, n_kv, T, hs) in place; return the keys and values attention reads."""
        self.k.index_copy_(2, self.slots, k_new.to(self.k.dtype))
        self.v.index_copy_(2, self.slots, v_new.to(self.v.dtype))
        return self.read()

    def read(self):
        """The keys and values attention reads, (B, n_kv, n_read or max_len, hs): the layer's own, or those of the
        layer that shares them with it."""
        return self.k[:, :, :self.n_read], self.v[:, :, :self.n_read]


class SharedKV:
    """Without a cache, the keys and values a group of layers shares: the first layer's update() keeps them and
    the others read() them."""

    def update(self, k, v):
        self.k, self.v = k, v
        return k, v

    def read(self):
        return self.k, self.v


class KVCache(nn.Module):
    """Keys and values of every layer, each (B, n_kv_head, max_len, head_dim), written in place, and which of
    them each new token may attend.

    The slots are a ring: token t (counted since reset(), left padding included) goes to slot t % max_len, so
    the cache holds the last max_len tokens. A token attends the slots holding itself and the `window` - 1 tokens
    before it (window: the model's block_size), never its row's left padding (a padding token sees only itself, so
    no query is left with no key). With learned positions the decoding loop refills the cache before it would wrap
    (generate.py). With rotary positions a score depends only on the distance between two tokens, so the ring
    simply rolls on: the oldest token drops out of view and every step feeds one token, with no refill.

    Which token each slot holds (attn_mask's `held`), for max_len 4 once tokens 0..5 are written (last = 5):

        slot                                   0    1    2    3
        held = last - (last - slot) % 4        4    5    2    3
        after tokens 0..1 only (last = 1)      0    1   -2   -1     (negative: empty so far)

    A chunk of t tokens writes t slots at once, so its first queries would lose keys they still see, unless
    max_len >= window + t - 1. max_len = window serves one token per step, and a chunk that fits before the first
    wrap; speculative decoding, which verifies k + 1 tokens in one pass, asks for window + k slots. rollback(n)
    then forgets the last n tokens exactly: the slots they overwrote held tokens that no later query sees.

    One counter, `pos` (tokens fed since reset), decides where keys go, what each query sees and each token's
    position. It is a 0-d tensor, so that a compiled one-token step has static shapes and never recompiles.
    """

    def __init__(self, n_layer: int, batch_size: int, n_kv_head: int, max_len: int, head_dim: int,
                 dtype=torch.float32, device=None, window: int | None = None, read_all_slots: bool = False):
        super().__init__()
        self.n_layer = n_layer
        # a buffer per layer (k0, v0, k1, ...), never views of one large buffer: a compiled step writes a buffer
        # in place, but to write into a view it would copy the whole large buffer, at every step.
        # persistent=False: a cache is scratch space, never part of a checkpoint
        self.add_layer_buffers(("k", "v"), (batch_size, n_kv_head, max_len, head_dim), dtype, device)
        self.register_buffer("pos", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        self.register_buffer("n_pad", torch.zeros(batch_size, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("slot_ids", torch.arange(max_len, device=device), persistent=False)
        self.window = window or max_len  # the most tokens a query sees: itself and window - 1 before it
        if self.window > max_len:
            raise ValueError(f"max_len {max_len} is below the window of {self.window} tokens that a query sees: give "
                             f"at least {self.window} slots")
        self.read_all_slots = read_all_slots
        self.padded = False  # whether reset() was given left padding

    def add_layer_buffers(self, names, shape, dtype, device) -> None:
        """A buffer of `shape` for each name and layer: name0, name1, ..., read by layer_buffers(name)."""
        for name in names:
            for i in range(self.n_layer):
                self.register_buffer(f"{name}{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def layer_buffers(self, name: str) -> list[torch.Tensor]:
        return [getattr(self, f"{name}{i}") for i in range(self.n_layer)]

    @property
    def k(self) -> list[torch.Tensor]:
        """Each layer's keys, (B, n_kv_head, max_len, head_dim); v: its values."""
        return self.layer_buffers("k")

    @property
    def v(self) -> list[torch.Tensor]:
        return self.layer_buffers("v")

    @property
    def dtype(self) -> torch.dtype:
        """What keys and values are stored in."""
        return self.k0.dtype

    @property
    def device(self) -> torch.device:
        return self.k0.device

    @property
    def max_len(self) -> int:
        return self.k0.size(2)

    @property
    def batch_size(self) -> int:
        return self.k0.size(0)

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values: B * max_len * kv_cache_bytes_per_token(config, dtype)."""
        return sum(t.nbytes for t in self.k + self.v)

    def __len__(self) -> int:
        """Tokens fed since reset(). Reads the counter back to the host (a sync on GPU): for tests and reports."""
        return int(self.pos)

    def reset(self, n_pad=None) -> None:
        """Empty the cache; n_pad (B,) gives how many left-padding tokens each row will start with."""
        self.pos.zero_()
        self.n_pad.zero_() if n_pad is None else self.n_pad.copy_(n_pad)
        self.padded = n_pad is not None

    def for_tokens(self, t: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int | None]:
        """What a forward pass of the next t tokens needs: (their positions (B, t) or (t,), the attention mask
        (B, 1, t, T_k) or None for plain causal attention, their slots (t,), how many slots attention reads
        (None: all))."""
        if t > 1 and not torch.compiler.is_compiling() and t > self.longest_chunk():
            raise ValueError(f"a chunk of {t} tokens must fit in the cache before it first wraps ({self.max_len} "
                             f"slots, {len(self)} fed), or the cache needs window + {t - 1} = {self.window + t - 1} "
                             f"slots; feed one token at a time past that")
        new = self.pos + self.slot_ids[:t]  # (t,) the new tokens' numbers since reset
        slots = new % self.max_len
        if self.static_shapes:
            return self.positions(new), self.attn_mask(new), slots, None
        return self.filled_slots_only(new, slots)

    def longest_chunk(self) -> int:
        """The most tokens the next forward pass may feed: those that fit before the ring first wraps, or
        max_len - window + 1 (see the class's docstring). Reads `pos` back (a sync on GPU)."""
        return max(self.max_len - len(self), self.max_len - self.window + 1)

    def positions(self, new):
        """(B, t) position of each new token in its row, counted from the row's first real token."""
        return (new[None, :] - self.n_pad[:, None]).clamp(min=0)

    def attn_mask(self, new):
        """(B, 1, t, max_len) bool, True where new token i may attend a slot, once the t tokens are written."""
        last = new[-1]
        held = last - (last - self.slot_ids) % self.max_len  # (max_len,) the token in each slot; < 0: none yet
        age = new[:, None] - held[None, :]  # (t, max_len) how far back each slot's token is
        seen = (held >= 0) & (age >= 0) & (age < self.window)  # (t, max_len): itself and window - 1 before it
        not_pad = held[None, :] >= self.n_pad[:, None]  # (B, max_len)
        own = held[None, :] == new[:, None]  # (t, max_len)
        return seen[None, None] & (not_pad[:, None, None, :] | own[None, None])

    def rollback(self, n: int) -> None:
        """Forget the last n tokens fed (speculative decoding's rejected drafts): the next ones overwrite them."""
        if not 0 <= n <= len(self):
            raise ValueError(f"cannot roll back {n} tokens: the cache holds {len(self)}")
        if n > self.max_len - self.window + 1 and len(self) > self.max_len:
            # the last of them overwrote a token that the next one fed would still see
            raise ValueError(f"cannot roll back {n} tokens of a ring of {self.max_len} slots that has wrapped: it "
                             f"rolls back max_len - window + 1 = {self.max_len - self.window + 1} at most; make "
                             f"the cache with max_len = window + {n - 1}")
        self.pos -= n

    def fill_from(self, other: "KVCache") -> None:
        """Copy another cache of the same shape into this one; a cache of one row fills every row, so that one
        prefill of a prompt serves many samples."""
        for mine, theirs in zip(self.buffers(), other.buffers()):
            mine.copy_(theirs.expand_as(mine))
        self.padded = other.padded

    # --- a faster path, for eager decoding on the CPU ---------------------------------------------------------
    # Everything above works everywhere, compiled or not. Eagerly on the CPU reading `pos` back costs nothing, so
    # a forward pass can attend to the filled slots only, and rows without padding often need no mask at all:
    # before any token leaves the window, the model's causal attention, aligned bottom-right, is exactly the
    # cache's rule, and past it a single token sees every filled slot when the ring is as long as the window (the
    # ring's order does not matter to attention). That spares each one-token step building a mask, and every
    # layer converting it. read_all_slots=True turns it off, to watch the rule above at work.

    @property
    def static_shapes(self) -> bool:
        """Whether attention reads all max_len slots, masked: when asked to (read_all_slots), when compiled (static
        shapes compile once), and off the CPU (reading `pos` back would wait for the device)."""
        return self.read_all_slots or torch.compiler.is_compiling() or self.pos.device.type != "cpu"

    def filled_slots_only(self, new, slots):
        fed = int(self.pos) + new.numel()
        n_read = min(fed, self.max_len)
        if not self.padded and (fed <= self.window or (new.numel() == 1 and self.max_len == self.window)):
            return new, None, slots, n_read
        return self.positions(new), self.attn_mask(new)[..., :n_read], slots, n_read

    def layer(self, i: int, slots: torch.Tensor, n_read: int | None) -> LayerKV:
        return LayerKV(getattr(self, f"k{i}"), getattr(self, f"v{i}"), slots, n_read)  # self.k would list every layer

    def advance(self, t: int) -> None:
        self.pos += t
