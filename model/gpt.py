"""A decoder-only transformer (GPT): token and position embeddings, pre-LayerNorm blocks, a tied head.

GPT.decode_step feeds tokens after those already in a KV cache (model/kv_cache.py). The fields n_kv_head and
kv_share choose a smaller cache's design (model/designs/grouped.py, model/designs/shared_kv.py); by default each layer's
attention is the plain one (model/attention.py)."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import CausalSelfAttention, attention_dtype, rotary

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
    window_pattern: str = "G"  # tiled over the layers: L sees the last local_window tokens, G all (model/designs/local_global.py)
    local_window: int | None = None  # how many tokens a local layer sees, itself included
    learned_sink: bool = False  # a trained sink logit per head in every softmax (labs/learned_sink.py)
    kv_latent: int | None = None  # multi-head latent attention: the latent's width per token (labs/latent.py)
    kv_latent_rope: int = 0  # with rotary positions, the width of its rotary key, shared by every head

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
        if not isinstance(self.learned_sink, bool):
            raise ValueError(f"learned_sink must be true or false, got {self.learned_sink!r}")
        from .designs.latent import check_latent
        from .designs.local_global import check_window_pattern
        check_window_pattern(self)
        check_latent(self)

    @property
    def plain_attention(self) -> bool:
        """Whether every layer's attention is the plain one (model/attention.py), with no smaller cache's design."""
        return (self.n_kv_head == self.n_head and self.kv_share == 1 and self.local_window is None
                and not self.learned_sink and self.kv_latent is None)

    @property
    def rotary_dim(self) -> int:
        """The channels that rotary positions turn in each head: head_dim, or a latent's rotary key (labs/latent.py)."""
        return self.head_dim if self.kv_latent is None else self.kv_latent_rope

    @property
    def kv_cache_heads(self) -> tuple[int, int]:
        """(heads, width) per token of a cache layer's keys, and of its values."""
        if self.kv_latent is None:
            return self.n_kv_head, self.head_dim
        from .designs.latent import cache_layout
        return cache_layout(self)


def attention_layers(config: GPTConfig) -> list[nn.Module]:
    """Each block's attention: the plain one, or the designs of model/labs/."""
    if config.plain_attention:
        return [CausalSelfAttention(config, kv_layer=i) for i in range(config.n_layer)]
    from .designs.shared_kv import design_attention_layers
    return design_attention_layers(config)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attention(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, attn: nn.Module):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = attn
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, attn_mask=None, rope=None, kv=None):
        x = x + self.attn(self.ln_1(x), attn_mask, rope, kv)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.pos_emb == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, attn) for attn in attention_layers(config))
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
        cache: a KV cache; idx are the next tokens after those in it. n_pad (B,): left-padding tokens per row,
        without a cache (model/decoding/ring_cache.py); a padded row gets the logits it would get alone."""
        logits = self.lm_head(self._trunk(idx, cache, n_pad))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def decode_step(self, idx, cache):
        """Feed idx (B, T) after the cached tokens: a prefill when T > 1, one decoding step when T = 1.
        Returns the logits of the last position (B, vocab_size)."""
        return self.lm_head(self._trunk(idx, cache)[:, -1])

    def _trunk(self, idx, cache=None, n_pad=None):
        """Embeddings and blocks: the final normalised hidden states (B, T, C)."""
        B, T = idx.shape
        c = self.config
        if self.wpe is not None and cache is None and T > c.block_size:
            raise ValueError(f"{T} tokens, but learned positions stop at block_size={c.block_size}: "
                             f"feed the last {c.block_size} at most")
        if cache is not None:
            pos, attn_mask, slots, n_read = cache.for_tokens(T)  # positions (T,) or (B, T); mask None: causal
        elif n_pad is not None or T > c.block_size:  # ragged rows, or rotary positions past block_size
            from .decoding.ring_cache import uncached_context
            pos, attn_mask = uncached_context(T, c.block_size, n_pad, idx.device)
        else:
            pos, attn_mask = torch.arange(T, device=idx.device), None  # plain causal: SDPA's fastest kernels
        x = self.wte(idx)  # (B, T, C)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(pos)
        else:
            rope = rotary(pos, c.rotary_dim)  # turns queries and keys in every layer
        x = self.drop(x)
        for block in self.blocks:
            kv = cache.layer(block.attn.kv_layer, slots, n_read) if cache is not None else None
            x = block(x, attn_mask, rope, kv)
        if cache is not None:
            cache.advance(T)
        return self.ln_f(x)

    @property
    def attention_dtype(self) -> torch.dtype:
        """What attention computes in, and a float cache's dtype (see attention_dtype)."""
        w = self.wte.weight
        return attention_dtype(w.dtype, w.device)

    def kv_cache_shape(self, batch_size: int) -> dict:
        """The plain KVCache's arguments for batch_size rows of block_size tokens: KVCache(**shape)."""
        c = self.config
        n_kv_head, head_dim = c.kv_cache_heads
        return dict(n_kv_layer=c.n_kv_layer, batch_size=batch_size, n_kv_head=n_kv_head, max_len=c.block_size,
                    head_dim=head_dim, dtype=self.attention_dtype, device=self.wte.weight.device)

    def new_kv_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None, *,
                     read_all_slots: bool = False):
        """The cache generate() uses: a ring that rolls on past block_size (model/decoding/ring_cache.py)."""
        from .decoding.ring_cache import new_kv_cache
        return new_kv_cache(self, batch_size, max_len, dtype, read_all_slots=read_all_slots)
