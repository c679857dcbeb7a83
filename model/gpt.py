"""A decoder-only transformer (GPT) built from MultiHeadAttention, with KV-cache generation."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import MultiHeadAttention, causal_mask
from .kv_cache import KVCache


@dataclass
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 256  # longest context, and the number of learned positions
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True

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
        self._compiled_step = None

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

    def forward(self, idx, targets=None, *, cache=None, padding_mask=None):
        """idx (B, T) token ids -> (logits (B, T, vocab_size), mean cross-entropy or None).

        cache: a KVCache; idx are the next tokens after those already in it.
        padding_mask: (B, T) bool, True at left padding (without a cache; a cache holds its own).
        """
        x, _ = self._trunk(idx, cache, padding_mask)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def attention_weights(self, idx) -> list:
        """Each layer's attention weights for idx (B, T): a list of n_layer tensors (B, n_head, T, T)."""
        return self._trunk(idx, need_weights=True)[1]

    def _trunk(self, idx, cache=None, padding_mask=None, need_weights=False):
        """Embeddings and blocks: (final normalised hidden states (B, T, C), per-layer weights)."""
        B, T = idx.shape
        if cache is not None:
            slots = cache.next_slots(T)
            pos = cache.positions(slots)  # (B, T)
            attn_mask = cache.attn_mask(slots)  # (B, 1, T, max_len)
        elif padding_mask is not None:
            n_pad = padding_mask.sum(dim=1, keepdim=True)  # (B, 1)
            pos = (torch.arange(T, device=idx.device) - n_pad).clamp(min=0)  # (B, T)
            attn_mask = causal_mask(T, T, idx.device) & ~padding_mask[:, None, None, :]  # (B, 1, T, T)
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

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty cache for batch_size rows, on this model's device and in its dtype."""
        c, w = self.config, self.wte.weight
        return KVCache(c.n_layer, batch_size, c.n_head, max_len or c.block_size, c.n_embd // c.n_head,
                       dtype=w.dtype, device=w.device)

    def _step(self, idx, cache):
        """Feed idx (B, T) after the cached tokens; logits of the last position (B, vocab_size)."""
        x, _ = self._trunk(idx, cache)
        return self.lm_head(x[:, -1])

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True,
                 generator=None, **kwargs):
        """idx (B, T) -> (B, T + max_new_tokens). See generate_tokens for every argument."""
        new = list(self.generate_tokens(idx, max_new_tokens, temperature, top_k, top_p, use_cache,
                                        generator, **kwargs))
        return torch.cat([idx, torch.stack(new, dim=1)], dim=1) if new else idx

    @torch.no_grad()
    def generate_tokens(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True,
                        generator=None, window=None, padding_mask=None, cache=None, compile_step=False):
        """Yield the next token of every row, (B,), max_new_tokens times.

        temperature 0 is greedy; top_k keeps the k likeliest tokens; top_p the fewest whose
        probabilities sum to at least p. generator: a torch.Generator for reproducible sampling.

        Past block_size. Positions are learned, so cached keys cannot slide along: the model sees
        a context seq[start:] of at most block_size tokens, and when the next token would make it
        longer, start jumps forward so that only the last `window` tokens remain (default
        block_size // 2), and the cache is rebuilt with one prefill over them. A rebuild every
        block_size - window + 1 tokens keeps the cost O(1) forward passes per token, amortised.
        window = block_size rebuilds every step, which is exactly the classic crop to the last
        block_size tokens. use_cache=False runs a full forward over the very same context.

        padding_mask: (B, T) bool, True at left padding, for prompts of different lengths. Each row's
        context, and when its window moves, is the one it would have alone; a batch whose rows fill up
        at different steps rebuilds the cache (for all rows) whenever one of them does.
        cache: a KVCache to reuse (from new_kv_cache); compile_step: torch.compile the one-token step.
        """
        block_size = self.config.block_size
        window = block_size // 2 if window is None else window
        _check_sampling(temperature, top_k, top_p)
        if not 1 <= window <= block_size:
            raise ValueError(f"window must be in [1, block_size={block_size}], got {window}")
        if padding_mask is not None and (padding_mask[:, 1:] > padding_mask[:, :-1]).any():
            raise ValueError("padding_mask must mark left padding: True only before a row's first token")
        if use_cache:
            cache = cache if cache is not None else self.new_kv_cache(idx.size(0))
            if compile_step:
                self._compiled_step = self._compiled_step or torch.compile(self._step, fullgraph=True)
        seq = idx
        # row b's context is seq[b, start[b]:]: it starts after the row's left padding, and each row's
        # window moves on its own schedule, exactly as if the row were generated alone
        start = [0] * idx.size(0) if padding_mask is None else padding_mask.sum(dim=1).tolist()
        n_cached = 0  # how many of the (padded) context's tokens the cache holds
        for _ in range(max_new_tokens):
            if seq.size(1) - min(start) > block_size:  # some row's context would pass block_size
                start = [s if seq.size(1) - s <= block_size else seq.size(1) - window for s in start]
                n_cached = 0
            first = min(start)  # the batch's context is seq[:, first:], each row left-padded to it
            if not use_cache:
                padding = None
                if max(start) > first:
                    row_start = torch.tensor(start, device=seq.device)[:, None]
                    padding = torch.arange(first, seq.size(1), device=seq.device)[None, :] < row_start
                logits = self(seq[:, first:], padding_mask=padding)[0][:, -1]
            else:
                if n_cached == 0:  # (re)fill the cache: each row's padding is its start past the batch's
                    cache.reset(torch.tensor([s - first for s in start], device=seq.device))
                new_tokens = seq[:, first + n_cached:]
                step = self._compiled_step if compile_step and new_tokens.size(1) == 1 else self._step
                logits = step(new_tokens, cache)
                n_cached += new_tokens.size(1)
            next_ids = sample_next(logits, temperature, top_k, top_p, generator)  # (B,)
            seq = torch.cat([seq, next_ids[:, None]], dim=1)
            yield next_ids


def _check_sampling(temperature, top_k, top_p):
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """logits (B, vocab_size) -> next token ids (B,)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth_best = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the likelier ones before it already reach top_p (the first always stays)
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
