"""The model. The core, read first: attention.py, gpt.py and kv_cache.py (the plain path: one design, a float
cache, one token per step). Each module in labs/ adds one idea to it. Knows nothing of files, configs or logging."""

from .attention import CausalSelfAttention, causal_mask
from .gpt import GPT, GPTConfig
from .kv_cache import KVCache, LayerKV, greedy_decode
from .decoding.generate import generate, generate_tokens
from .designs.multihead import MultiHeadAttention
from .decoding.ring_cache import RingKVCache, kv_cache_bytes, kv_cache_bytes_per_token
from .decoding.sampling import GREEDY, Sampling

__all__ = ["GPT", "GPTConfig", "GREEDY", "CausalSelfAttention", "KVCache", "LayerKV", "MultiHeadAttention",
           "RingKVCache", "Sampling", "causal_mask", "generate", "generate_tokens", "greedy_decode",
           "kv_cache_bytes", "kv_cache_bytes_per_token"]
