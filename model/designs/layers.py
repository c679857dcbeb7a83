"""Each layer's attention for a config with a design, and the model built from them: build_model(config) makes the
model any config describes, handing GPT (model/gpt.py) each block's attention.

A layer is a design class (grouped queries, shared layers or latent attention), with a local window and a learned
sink mixed in front where the config asks for them. Every combination is a class of its own, named below.
"""

from torch import nn

from ..gpt import GPT, GPTConfig
from .grouped import GroupedQueryAttention
from .latent import LatentAttention, check_latent
from .learned_sink import LearnedSink
from .local_window import LocalWindow, check_window_pattern, local_layers
from .shared_kv import SharedKVAttention


class LocalGroupedAttention(LocalWindow, GroupedQueryAttention):
    """A local layer with grouped queries."""


class SinkGroupedAttention(LearnedSink, GroupedQueryAttention):
    """Grouped queries with a learned sink."""


class LocalSinkGroupedAttention(LocalWindow, LearnedSink, GroupedQueryAttention):
    """A local layer with grouped queries and a learned sink."""


class LocalSharedKVAttention(LocalWindow, SharedKVAttention):
    """A local layer of a group that shares keys and values."""


class SinkSharedKVAttention(LearnedSink, SharedKVAttention):
    """A layer of a group that shares keys and values, with a learned sink."""


class LocalSinkSharedKVAttention(LocalWindow, LearnedSink, SharedKVAttention):
    """A local layer of a group that shares keys and values, with a learned sink."""


class LocalLatentAttention(LocalWindow, LatentAttention):
    """A local layer of latent attention."""


class SinkLatentAttention(LearnedSink, LatentAttention):
    """Latent attention with a learned sink."""


class LocalSinkLatentAttention(LocalWindow, LearnedSink, LatentAttention):
    """A local layer of latent attention with a learned sink."""


# (design, local, sink) -> the layer's class
LAYER_CLASSES = {
    ("grouped", False, False): GroupedQueryAttention, ("grouped", True, False): LocalGroupedAttention,
    ("grouped", False, True): SinkGroupedAttention, ("grouped", True, True): LocalSinkGroupedAttention,
    ("shared", False, False): SharedKVAttention, ("shared", True, False): LocalSharedKVAttention,
    ("shared", False, True): SinkSharedKVAttention, ("shared", True, True): LocalSinkSharedKVAttention,
    ("latent", False, False): LatentAttention, ("latent", True, False): LocalLatentAttention,
    ("latent", False, True): SinkLatentAttention, ("latent", True, True): LocalSinkLatentAttention,
}


def check_design(config: GPTConfig) -> None:
    """A ValueError naming what is wrong with the design's fields, or what they cannot combine with."""
    if config.n_head % config.n_kv_head:
        raise ValueError(f"n_kv_head {config.n_kv_head} must divide n_head {config.n_head}: each key/value head "
                         f"serves an equal group of query heads")
    if config.n_layer % config.kv_share:
        raise ValueError(f"kv_share {config.kv_share} must divide n_layer {config.n_layer}: layers share keys and "
                         f"values in equal groups")
    if not isinstance(config.learned_sink, bool):
        raise ValueError(f"learned_sink must be true or false, got {config.learned_sink!r}")
    check_window_pattern(config)
    check_latent(config)


def design_attention_layers(config: GPTConfig) -> list[nn.Module]:
    """Each layer's attention for grouped queries (n_kv_head < n_head), shared layers (kv_share > 1), latent
    attention (kv_latent), local layers (window_pattern) and a learned sink."""
    design = "shared" if config.kv_share > 1 else "latent" if config.kv_latent is not None else "grouped"
    layers, first = [], None
    for i, local in enumerate(local_layers(config)):
        cls = LAYER_CLASSES[design, local, config.learned_sink]
        if i % config.kv_share == 0:
            first = cls(config, kv_layer=i // config.kv_share)
            layers.append(first)
        else:
            layers.append(cls(config, kv_layer=i // config.kv_share, reads=first))
    return layers


def build_model(config: GPTConfig) -> GPT:
    """The model config describes: the plain one, or one with the design its fields choose."""
    if config.plain_attention:
        return GPT(config)
    check_design(config)
    return GPT(config, design_attention_layers(config))
