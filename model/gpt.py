"""A decoder-only transformer (GPT) built from MultiHeadAttention, with a KV-cache step for decoding."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import MultiHeadAttention, attention_dtype, causal_mask
from .kv_cache import KVCache


@dataclass
class GPTConfig:
    vocab_size: int  # a fact about the data: the number of distinct tokens
    block_size: int  # longest context, and the number of learned positions
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True  # in the Linear and LayerNorm layers

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


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

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = MultiHeadAttention(config.n_embd, config.n_head, bias=config.bias, dropout=config.dropout)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, attn_mask=None, cache=None, need_weights=False):
        """attn_mask None means plain causal attention; returns (x, attention weights or None)."""
        a, weights = self.attn(self.ln_1(x), attn_mask=attn_mask, is_causal=attn_mask is None,
                               cache=cache, need_weights=need_weights)
        x = x + a
        return x + self.mlp(self.ln_2(x)), weights


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
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
        if cache is not None:
            pos, attn_mask, slots = cache.for_tokens(T)  # (B, T) or (T,); (B, 1, T, T_k) or None
        elif n_pad is not None:
            steps = torch.arange(T, device=idx.device)
            pos = (steps[None, :] - n_pad[:, None]).clamp(min=0)  # (B, T), counted from each row's first token
            not_pad = steps[None, :] >= n_pad[:, None]  # (B, T)
            attn_mask = causal_mask(T, T, idx.device) & not_pad[:, None, None, :]  # (B, 1, T, T)
        else:
            pos = torch.arange(T, device=idx.device)  # (T,)
            attn_mask = None  # plain causal attention: the fastest SDPA kernels
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        weights = []
        for i, block in enumerate(self.blocks):
            x, w = block(x, attn_mask, cache.layer(i, slots) if cache is not None else None, need_weights)
            weights.append(w)
        if cache is not None:
            cache.advance(T)
        return self.ln_f(x), weights

    def new_kv_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """An empty cache for batch_size rows of up to max_len tokens (default block_size), on this model's
        device, in `dtype` if given, else in the dtype attention computes in (see attention_dtype)."""
        c, w = self.config, self.wte.weight
        dtype = dtype or attention_dtype(w.dtype, w.device)
        return KVCache(c.n_layer, batch_size, c.n_head, max_len or c.block_size, c.n_embd // c.n_head,
                       dtype=dtype, device=w.device)
