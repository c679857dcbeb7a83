"""The model: attention block, decoder-only GPT and its KV cache. Knows nothing of files or configs."""

from .attention import MultiHeadAttention, causal_mask
from .gpt import GPT, GPTConfig, sample_next
from .kv_cache import KVCache, LayerKV

__all__ = ["GPT", "GPTConfig", "KVCache", "LayerKV", "MultiHeadAttention", "causal_mask", "sample_next"]
