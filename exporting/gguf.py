"""kvgpt's model as one GGUF file for llama.cpp, written with gguf, the package llama.cpp's authors publish.

    learned positions, multi-head          gpt2        llama.cpp's GPT-2 graph, up to its arithmetic (below)
    rotary positions, grouped queries      starcoder2  its rotary halves match, but it has no window: kvgpt's
                                                       text up to block_size tokens only, so a warning says so

Other designs are refused: llama.cpp's GPT-NeoX and StarCoder graphs are not exported (docs/export.md).
Weights are kvgpt's float32 ones, a zero bias where kvgpt has none; the head is tied, so no output tensor is
written and llama.cpp uses the token embedding. llama.cpp computes GELU with its tanh approximation, not
kvgpt's erf, and caches keys and values in float16 by default: its logits are close to kvgpt's, not equal.
No llama.cpp architecture computes the erf GELU, so no design is exported without this difference.

The tokenizer is llama.cpp's "rwkv" one: a list of token texts, of which the longest that matches is taken, so
a text splits into its characters with kvgpt's ids. Its defaults name no end-of-text token, and none is named
here, so llama.cpp never ends kvgpt's text early. GPT-2's byte-level BPE would name id 11 by default, and any id
named is a character the model writes: llama.cpp would stop there."""

from pathlib import Path

import numpy as np

from data import CharVocab
from model import GPT
from runtime.hf import EPS, ROPE_BASE, check_layers, model_type, with_zero_biases

GGUF_DESIGNS = "learned positions with multi-head attention, rotary positions with grouped queries (n_kv_head < n_head)"
ARCH = {"gpt2": "gpt2", "starcoder2": "starcoder2"}  # transformers' model_type -> llama.cpp's architecture
UP_TO_BLOCK_SIZE = {"starcoder2"}  # no sliding window in llama.cpp: past block_size it attends every token


def gguf_arch(model: GPT) -> str:
    """llama.cpp's architecture for model, or a ValueError naming the designs that export to GGUF."""
    try:
        kind = model_type(model.config)
        check_layers(model)
    except ValueError as e:
        raise ValueError(f"{str(e).split(';')[0].replace('transformers', 'llama.cpp')}; the designs that export "
                         f"to gguf: {GGUF_DESIGNS}") from None
    if kind not in ARCH:
        what = "learned positions with multi-query attention" if kind == "gpt_bigcode" else \
            "rotary positions with multi-head attention"
        raise ValueError(f"{what} is not exported to gguf; the designs that export to gguf: {GGUF_DESIGNS}; "
                         f"--format hf exports it")
    return ARCH[kind]


def gguf_warning(model: GPT) -> str | None:
    """The line export.py prints for a design whose text in llama.cpp is kvgpt's only up to block_size."""
    if model_type(model.config) in UP_TO_BLOCK_SIZE:
        return (f"llama.cpp gives this design's text only up to block_size ({model.config.block_size} tokens, "
                f"prompt included): it has no sliding window, where kvgpt keeps the last block_size tokens")
    return None


def rwkv_token(char: str) -> str:
    """A character as llama.cpp's rwkv tokenizer reads it: a backslash or control character as a lowercase \\xHH
    escape, which it turns back into that byte; any other character as itself."""
    return f"\\x{ord(char):02x}" if char == "\\" or ord(char) < 0x20 or ord(char) == 0x7F else char


def write_gguf(model: GPT, vocab: CharVocab, path: Path, name: str = "kvgpt") -> None:
    """Write model and vocab as one GGUF file at path, all float32."""
    import gguf  # only here: kvgpt runs without it
    arch, c = gguf_arch(model), model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(c.block_size)
    writer.add_embedding_length(c.n_embd)
    writer.add_feed_forward_length(4 * c.n_embd)
    writer.add_block_count(c.n_layer)
    writer.add_head_count(c.n_head)
    writer.add_layer_norm_eps(EPS)
    if arch == "starcoder2":
        writer.add_head_count_kv(c.n_kv_head)
        writer.add_rope_freq_base(ROPE_BASE)
        writer.add_rope_dimension_count(c.head_dim)
    write_tokenizer(writer, vocab, gguf)
    for tensor_name, weight in tensors(model, arch, gguf).items():
        writer.add_tensor(tensor_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tokenizer(writer, vocab: CharVocab, gguf) -> None:
    """llama.cpp's rwkv tokenizer over kvgpt's characters, in id order. No bos, eos or unk is named, so nothing
    ends the text but its length; nothing is added to a prompt."""
    writer.add_tokenizer_model("rwkv")
    writer.add_token_list([rwkv_token(char) for char in vocab.chars])
    writer.add_token_types([gguf.TokenType.NORMAL] * len(vocab))
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def tensors(model: GPT, arch: str, gguf) -> dict[str, np.ndarray]:
    """llama.cpp's tensor names -> kvgpt's float32 weights, each (out, in) as torch stores it: gguf writes the
    shape reversed, which is ggml's order."""
    state = {name: w.numpy() for name, w in with_zero_biases(model).items()}
    c, names = model.config, gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR
    out = {f"{names[T.TOKEN_EMBD]}.weight": state["wte.weight"]}
    if arch == "gpt2":
        out[f"{names[T.POS_EMBD]}.weight"] = state["wpe.weight"]
    for part in ("weight", "bias"):
        out[f"{names[T.OUTPUT_NORM]}.{part}"] = state[f"ln_f.{part}"]
    per_block = {T.ATTN_NORM: "ln_1", T.ATTN_OUT: "attn.out_proj", T.FFN_NORM: "ln_2", T.FFN_UP: "mlp.fc",
                 T.FFN_DOWN: "mlp.proj"}
    kv = c.n_kv_head * c.head_dim
    for i in range(c.n_layer):
        for part in ("weight", "bias"):
            for tensor, ours in per_block.items():
                out[f"{names[tensor].format(bid=i)}.{part}"] = state[f"blocks.{i}.{ours}.{part}"]
            qkv = state[f"blocks.{i}.attn.qkv.{part}"]  # rows: Q, then K, then V, as llama.cpp's fused one
            if arch == "gpt2":
                out[f"{names[T.ATTN_QKV].format(bid=i)}.{part}"] = qkv
            else:
                for tensor, rows in zip((T.ATTN_Q, T.ATTN_K, T.ATTN_V), np.split(qkv, [c.n_embd, c.n_embd + kv])):
                    out[f"{names[tensor].format(bid=i)}.{part}"] = np.ascontiguousarray(rows)
    return out
