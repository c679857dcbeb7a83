"""The model: attention block, decoder-only GPT, its KV cache and the decoding loop. Knows nothing of files,
configs or logging."""

from .attention import MultiHeadAttention, causal_mask
from .generate import GREEDY, Sampling, generate, generate_tokens, greedy_decode
from .gpt import GPT, GPTConfig, KVCache, LayerKV, kv_cache_bytes_per_token

__all__ = ["GPT", "GPTConfig", "GREEDY", "KVCache", "LayerKV", "MultiHeadAttention", "Sampling", "causal_mask",
           "generate", "generate_tokens", "greedy_decode", "kv_cache_bytes_per_token"]
