"""A decoder-only transformer (GPT): token and position embeddings, pre-LayerNorm blocks, a tied
head.

GPT.decode_step feeds tokens after those already in a KV cache (model/kv_cache.py). Each block's
attention is the plain one (model/attention.py); the fields from n_kv_head on choose a design, which
model/designs/ builds."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import CausalSelfAttention, attention_dtype, causal_mask, rotary

POSITIONS = ("learned", "rope")


@dataclass
class GPTConfig:
    vocab_size: int  # a fact about the data: the number of distinct tokens
    block_size: int  # longest context the model sees (learned positions: how many)
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True  # in the Linear and LayerNorm layers
    pos_emb: str = "learned"  # learned: a vector per position (GPT-2); rope: rotary
    n_kv_head: int | None = None  # key/value heads (None: n_head); 1 is multi-query attention
    kv_share: int = 1  # adjacent layers that share one set of keys and values
    window_pattern: str = "G"  # tiled over the layers: L sees the last local_window tokens, G all
    local_window: int | None = None  # how many tokens a local layer sees, itself included
    learned_sink: bool = False  # a trained sink logit per head (designs/learned_sink.py)
    kv_latent: int | None = None  # MLA: the latent's width per token (designs/latent.py)
    kv_latent_rope: int = 0  # with rope: its rotary key's width, shared by all heads

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
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.pos_emb not in POSITIONS:
            raise ValueError(f"pos_emb must be one of {', '.join(POSITIONS)}, got {self.pos_emb!r}")
        if self.pos_emb == "rope" and self.head_dim % 2:
            raise ValueError(f"rope turns channel pairs: the head width n_embd / n_head = "
                             f"{self.head_dim} must be even")

    @property
    def plain_attention(self) -> bool:
        """Whether every layer's attention is the plain one (model/attention.py), with no smaller cache's design."""
        return (self.n_kv_head == self.n_head and self.kv_share == 1 and self.window_pattern == "G"
                and self.local_window is None and self.learned_sink is False
                and self.kv_latent is None and not self.kv_latent_rope)

    @property
    def kv_cache_heads(self) -> tuple[int, int]:
        """(heads, width) per token of a cache layer's keys, and of its values. A latent's cache holds one head:
        half of each token's latent and rotary key in the keys, half in the values (model/designs/latent.py)."""
        if self.kv_latent is None:
            return self.n_kv_head, self.head_dim
        return 1, (self.kv_latent + self.kv_latent_rope) // 2


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
    """attention: each block's attention layer, the plain one if None; build_model (model/designs/) hands GPT
    the layers of a design."""

    def __init__(self, config: GPTConfig, attention: list[nn.Module] | None = None):
        super().__init__()
        if attention is None and not config.plain_attention:
            raise ValueError("this config names an attention design: build its model with build_model(config)")
        attention = attention or [CausalSelfAttention(config, kv_layer=i) for i in range(config.n_layer)]
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.pos_emb == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, attn) for attn in attention)
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix embeds tokens and scores them

        self.apply(self._init_weights)
        for block in self.blocks:  # GPT-2: residual projections scaled by depth
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

    def forward(self, idx, targets=None, *, cache=None):
        """idx (B, T) token ids -> (logits (B, T, vocab_size), mean cross-entropy or None).
        cache: a KV cache (model/protocol.py: Cache), idx the tokens after those in it; or Uncached
        (model/caches/ring.py), which gives ragged rows their positions and mask, with no cache."""
        logits = self.lm_head(self._trunk(idx, cache))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def decode_step(self, idx, cache):
        """Feed idx (B, T) after the cached tokens: a prefill when T > 1, one decoding step when T = 1.
        Returns the logits of the last position (B, vocab_size)."""
        return self.lm_head(self._trunk(idx, cache)[:, -1])

    def _trunk(self, idx, cache=None):
        """Embeddings and blocks: the final normalised hidden states (B, T, C)."""
        B, T = idx.shape
        c = self.config
        if self.wpe is not None and cache is None and T > c.block_size:
            raise ValueError(f"{T} tokens, but learned positions stop at block_size={c.block_size}: "
                             f"feed the last {c.block_size} at most")
        step = cache.begin(T) if cache is not None else None  # positions: (T,) or (B, T)
        pos, attn_mask = (step.positions, step.mask) if step else (torch.arange(T, device=idx.device), None)
        if step is None and T > c.block_size:  # rope past block_size: each sees block_size back
            attn_mask = causal_mask(T, T, idx.device, reach=c.block_size)
        x = self.wte(idx)  # (B, T, C)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(pos)
        else:
            rope = rotary(pos, self.blocks[0].attn.rotary_dim)  # for every layer's queries and keys
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, attn_mask, rope, step.layer(block.attn.kv_layer) if step else None)
        return self.ln_f(x)

    @property
    def attention_dtype(self) -> torch.dtype:
        """What attention computes in, and a float cache's dtype (see attention_dtype)."""
        return attention_dtype(self.wte.weight.dtype, self.wte.weight.device)
