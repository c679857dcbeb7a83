"""What multi-head latent attention adds (MLA, DeepSeek-V2 and V3): the cache holds one small latent per token,
and every head's keys and values are projected up from it. Rotary positions cannot ride on keys made from a
cached latent (the up-projection would have to turn with each position), so a small rotary key, shared by every
head, is cached beside the latent, and each query head gets a rotary part of the same width.

Per token (kv_latent = d_c, kv_latent_rope = d_r, zero with learned positions):

    query   q_h = [q_h content (head_dim), q_h rotary (d_r)]            from x, per head
    latent  c = norm(down(x)) (d_c),  rotary key r = down_r(x) (d_r)    cached: d_c + d_r values, whatever n_head is
    key     k_h = [up_k,h(c) (head_dim), r (d_r)]                       the rotary key shared by every head
    value   v_h = up_v,h(c) (head_dim)
    score   q_h · k_h / √(head_dim + d_r)

The latent is normalised before it is cached (DeepSeek-V2 applies an RMSNorm there; here the model's LayerNorm),
so that keys and values, a product of two small matrices at initialisation, start at a useful scale.

The cache is the plain ring: it holds the latent and the rotary key as one vector per token, split in two halves
between its key and value buffers (GPTConfig.kv_cache_heads), so that every cache path, the int8 one included, serves it
unchanged. Training expands the latents into keys and values (the naive form). Decoding absorbs the
up-projections instead: q · up_k(c) = (up_kᵀ q) · c, and Σ w up_v(c) = up_v(Σ w c), so each step reads the cached
latents as they are, never projecting the whole context up again.
"""

import math
from typing import NamedTuple

import torch
import torch.nn as nn

from ..attention import rotate
from ..checks import is_integer
from .grouped import GroupedQueryAttention


def check_latent(config) -> None:
    """A ValueError naming what is wrong with kv_latent or kv_latent_rope, or what they cannot combine with."""
    latent, rope = config.kv_latent, config.kv_latent_rope
    if latent is None:
        if rope:
            raise ValueError(f"kv_latent_rope applies to multi-head latent attention: give kv_latent, or drop "
                             f"kv_latent_rope={rope}")
        return
    if not is_integer(latent) or latent < 1:
        raise ValueError(f"kv_latent must be an integer of at least 1, got {latent!r}")
    if config.pos_emb == "learned" and rope:
        raise ValueError(f"kv_latent_rope is the width of a rotary key, and pos_emb is learned: drop it")
    if config.pos_emb == "rope" and (not is_integer(rope) or rope < 2 or rope % 2):
        raise ValueError(f"with rotary positions, multi-head latent attention needs kv_latent_rope, the width of "
                         f"its rotary key: an even integer of at least 2, got {rope!r}")
    if (latent + rope) % 2:
        raise ValueError(f"kv_latent + kv_latent_rope = {latent + rope} must be even: the cache holds each token's "
                         f"latent and rotary key in two equal halves")
    if config.n_kv_head != config.n_head or config.kv_share != 1:
        raise ValueError("kv_latent replaces the key/value heads: it does not combine with n_kv_head or kv_share")


class LatentAttention(GroupedQueryAttention):
    """Causal self-attention whose keys and values come from a cached latent per token. Decoding reads the latent
    as one key/value head for every query head: grouped-query attention's one-token step (model/designs/grouped.py)."""

    def __init__(self, config, kv_layer: int):
        super().__init__(config, kv_layer)
        self.latent, self.rotary_dim = config.kv_latent, config.kv_latent_rope
        self.latent_norm = nn.LayerNorm(config.kv_latent, bias=config.bias)
        self.up = nn.Linear(config.kv_latent, 2 * config.n_embd, bias=config.bias)  # each head's key and value

    def qkv_widths(self, config) -> list[int]:
        """Queries (a content and a rotary part per head), then the latent and the rotary key."""
        return [config.n_head * (config.head_dim + config.kv_latent_rope), config.kv_latent, config.kv_latent_rope]

    def forward(self, x, attn_mask=None, rope=None, kv=None):
        """Without a cache (training), or with biases in the up-projection, the naive expansion (project); while
        decoding, the absorbed form: the up-projections move into the queries and the output, so attention reads
        the cached latents as they are, one key/value head of width kv_latent + kv_latent_rope for every query head."""
        if kv is None or self.up.bias is not None:
            return super().forward(x, attn_mask, rope, kv if kv is None else FloatView(kv))
        B, T, C = x.shape
        nh, hs, d_c, d_r = self.n_head, self.head_dim, self.latent, self.rotary_dim
        q, z = self.queries_and_latents(x, rope, kv)  # z (B, 1, T_k, d_c + d_r): each token's latent, rotary key
        up_k, up_v = self.up.weight.view(2, nh, hs, d_c)  # each head's rows of the up-projection
        # q · up_k(c) = (up_kᵀ q) · c; SDPA divides by √(d_c + d_r), the score needs √(hs + d_r)
        q = torch.cat([torch.einsum("bhtd,hdc->bhtc", q[..., :hs], up_k), q[..., hs:]], dim=-1)
        q = q * math.sqrt((d_c + d_r) / (hs + d_r))
        y = self.attend(q.to(z.dtype), z, z[..., :d_c], attn_mask)  # (B, nh, T, d_c): Σ w c, per head
        y = torch.einsum("bhtc,hdc->bhtd", y.to(x.dtype), up_v)  # up_v(Σ w c) = Σ w up_v(c): (B, nh, T, hs)
        return self.out_dropout(self.out_proj(y.transpose(1, 2).reshape(B, T, C)))

    def project(self, x, rope, kv):
        """The naive expansion: every head's keys and values, projected up from every cached latent."""
        B = x.size(0)
        nh, hs, d_r = self.n_head, self.head_dim, self.rotary_dim
        q, z = self.queries_and_latents(x, rope, kv)
        T_k = z.size(2)
        latent, rotary_key = z.split([self.latent, d_r], dim=-1)  # (B, 1, T_k, d_c), (B, 1, T_k, d_r)
        k, v = self.up(latent[:, 0].to(x.dtype)).view(B, T_k, 2, nh, hs).permute(2, 0, 3, 1, 4)  # (B, nh, T_k, hs)
        k = torch.cat([k, rotary_key.to(k.dtype).expand(B, nh, T_k, d_r)], dim=-1)
        return q, k, v

    def queries_and_latents(self, x, rope, kv):
        """Queries (B, nh, T, hs + d_r), turned; and z (B, 1, T_k, d_c + d_r), each token's latent and rotary key:
        the new tokens', written to kv and read back with the cached ones."""
        B, T, _ = x.shape
        nh, hs, d_r = self.n_head, self.head_dim, self.rotary_dim
        q, latent, rotary_key = self.qkv(x).split(self.widths, dim=-1)
        q = q.view(B, T, nh, hs + d_r).transpose(1, 2)  # (B, nh, T, hs + d_r)
        latent, rotary_key = self.latent_norm(latent)[:, None], rotary_key[:, None]  # (B, 1, T, d_c), (B, 1, T, d_r)
        if rope is not None:  # the rotary parts turn; the rotary key before it is cached, as keys do
            q = torch.cat([q[..., :hs], rotate(q[..., hs:], *rope)], dim=-1)
            rotary_key = rotate(rotary_key, *rope)
        z = torch.cat([latent, rotary_key], dim=-1)  # (B, 1, T, d_c + d_r)
        if kv is not None:
            half = z.size(-1) // 2
            z = torch.cat([t.to(x.dtype) for t in kv.update(z[..., :half], z[..., half:])], dim=-1)  # int8: dequantized
        return q, z


class FloatView(NamedTuple):
    """A cache view whose keys and values this layer reads as floats, so that its own attention applies, never the
    cache's (an int8 cache attends int8 keys itself)."""

    kv: object

    def update(self, k_new, v_new):
        return self.kv.update(k_new, v_new)
