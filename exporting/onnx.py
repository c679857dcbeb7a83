"""kvgpt's model as one ONNX decoder that carries its KV cache in and out, for onnxruntime.

Inputs:  input_ids (B, T) int64; position_ids (B, T) int64, each new token's position;
         past_key_values.{i}.key and .value (B, n_kv_head, P, head_dim) float32 for each layer i; P may be 0.
Outputs: logits (B, T, vocab_size); present.{i}.key and .value (B, n_kv_head, P + T, head_dim): the past with
         the new tokens' keys and values after it, to feed back as the next call's past.

One graph serves a prefill (T > 1, P = 0) and one-token steps (T = 1) alike. Each new token attends every past key
and the new ones up to itself. Keys are cached already turned by their rotary positions, as kvgpt caches them, so a
loop that keeps only the last block_size - 1 keys, with positions counting on, is kvgpt's rolling cache
(docs/export.md). The graph runs kvgpt's own model: only the cache and the attention over it are this file's."""

import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import GPT
from model.kv_cache import CachePass

OPSET = 17


class PastView:
    """One layer's view: the new keys and values go after the past ones, and are kept as the layer's present."""

    def __init__(self, past_k, past_v, mask, presents: list):
        self.past_k, self.past_v, self.mask, self.presents = past_k, past_v, mask, presents

    def update(self, k, v):
        k, v = torch.cat([self.past_k, k], dim=2), torch.cat([self.past_v, v], dim=2)  # (B, n_kv, P + T, hs)
        self.presents += [k, v]
        return k, v

    def attend(self, q, k, v, attn_mask, sink):
        """softmax(q kᵀ / √hs, masked) v, written out: no branch on a shape, so that one graph fits every T and P.
        q (B, nh, T, hs); k, v (B, n_kv, P + T, hs) -> (B, nh, T, hs)."""
        group = q.size(1) // k.size(1)  # query heads per key/value head: a fact of the model, fixed in the graph
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5  # (B, nh, T, P + T)
        return F.softmax(scores.masked_fill(~self.mask, float("-inf")), dim=-1) @ v


class PastCache:
    """Just enough of the cache protocol (model/kv_cache.py) for one forward pass over past keys and values."""

    def __init__(self, position_ids, pasts: list, mask):
        self.position_ids, self.mask, self.presents = position_ids, mask, []
        self.views = [PastView(k, v, mask, self.presents) for k, v in zip(pasts[::2], pasts[1::2])]

    def begin(self, t: int) -> CachePass:
        return CachePass(self.position_ids, self.mask, lambda i: self.views[i])


class Decoder(nn.Module):
    """(input_ids, position_ids, past keys and values...) -> (logits, present keys and values...)."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, *pasts):
        T, P = input_ids.size(1), pasts[0].size(2)
        # (T, P + T): new token i sees every past key and new keys 0..i
        mask = torch.arange(P + T, device=input_ids.device)[None, :] <= \
            (torch.arange(T, device=input_ids.device) + P)[:, None]
        cache = PastCache(position_ids, list(pasts), mask)
        logits, _ = self.model(input_ids, cache=cache)
        return (logits, *cache.presents)


def io_names(n_layer: int) -> tuple[list[str], list[str]]:
    """The graph's input and output names."""
    pasts = [f"past_key_values.{i}.{kind}" for i in range(n_layer) for kind in ("key", "value")]
    presents = [f"present.{i}.{kind}" for i in range(n_layer) for kind in ("key", "value")]
    return ["input_ids", "position_ids", *pasts], ["logits", *presents]


def write_onnx(model: GPT, path: Path) -> None:
    """Trace model, in float32 on the CPU, into an ONNX file at path, with dynamic batch, new and past lengths."""
    model = model.float().cpu().eval()
    c = model.config
    heads, width = c.kv_cache_heads
    inputs, outputs = io_names(c.n_kv_layer)
    # an example with a past and several new tokens, so that no length is taken for a constant
    example = (torch.zeros(1, 2, dtype=torch.long), torch.tensor([[3, 4]]),
               *[torch.zeros(1, heads, 3, width) for _ in range(2 * c.n_kv_layer)])
    axes = {name: {0: "batch", 1: "new"} for name in ("input_ids", "position_ids", "logits")}
    axes.update({name: {0: "batch", 2: "past"} for name in inputs[2:]})
    axes.update({name: {0: "batch", 2: "past_and_new"} for name in outputs[1:]})
    with warnings.catch_warnings(), torch.no_grad():  # the tracer's warnings are about shapes that stay symbolic
        warnings.simplefilter("ignore")
        torch.onnx.export(Decoder(model), example, str(path), dynamo=False, input_names=inputs,
                          output_names=outputs, dynamic_axes=axes, opset_version=OPSET)
