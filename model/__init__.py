"""The model. The core, read first: attention.py, gpt.py and kv_cache.py (the plain path: one design, a float
cache, one token per step), and checks.py, the type checks every folder's errors share. Beside it, each folder holds
modules that add one idea each, and stands on those before it: designs/ (other attention designs), caches/ (the
ring that rolls on, the other caches, and every cache by name), decoding/ (the real decoding loop, its compiled
steps and decoding precisions), serving/ (many requests, speculation, conversations) and measuring/. Knows nothing
of files, configs or logging."""

from .attention import CausalSelfAttention, causal_mask
from .caches.factory import kv_cache_bytes, kv_cache_bytes_per_token, new_cache, new_kv_cache
from .caches.ring import RingKVCache, Uncached
from .decoding.generate import generate, generate_tokens
from .decoding.sampling import GREEDY, Sampling
from .designs.layers import build_model
from .designs.multihead import MultiHeadAttention
from .gpt import GPT, GPTConfig
from .kv_cache import CachePass, KVCache, LayerKV, greedy_decode
from .protocol import Abilities, Cache

__all__ = ["Abilities", "Cache", "CachePass", "GPT", "GPTConfig", "GREEDY", "CausalSelfAttention", "KVCache",
           "LayerKV", "MultiHeadAttention", "RingKVCache", "Sampling", "Uncached", "build_model", "causal_mask",
           "generate", "generate_tokens", "greedy_decode", "kv_cache_bytes", "kv_cache_bytes_per_token",
           "new_cache", "new_kv_cache"]
