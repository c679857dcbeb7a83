"""The model: attention block, decoder-only GPT, its KV cache and the decoding loop. Knows nothing of files,
configs or logging."""

from .attention import MultiHeadAttention, causal_mask
from .generate import generate, generate_tokens
from .gpt import GPT, GPTConfig
from .kv_cache import KVCache, LayerKV
from .sampling import GREEDY, Sampling

__all__ = ["GPT", "GPTConfig", "GREEDY", "KVCache", "LayerKV", "MultiHeadAttention", "Sampling", "causal_mask",
           "generate", "generate_tokens"]
