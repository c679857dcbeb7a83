"""kvgpt's designs as Hugging Face transformers models: the class per design, its config, and each weight's name.

    learned positions, multi-head          GPT2LMHeadModel
    learned positions, multi-query         GPTBigCodeForCausalLM (multi_query)
    rotary positions, multi-head           GPTNeoXForCausalLM (sequential residual)
    rotary positions, grouped queries      Starcoder2ForCausalLM (sliding_window = block_size)

Each is the same function as kvgpt's model, not an approximation: pre-LayerNorm blocks (eps 1e-5), the erf GELU
("gelu"), a 4x MLP, attention scaled by 1/sqrt(head_dim), rotary positions over the whole head (base 10,000,
halves rotated) and the head tied to the token embedding. Where kvgpt has no biases, the biases are zeros.
export.py writes a folder (exporting/folder.py: to_hf); sample.py reads one back (read_export, called by
runtime/checkpoint.py) with json and safetensors only, never transformers."""

import json
from pathlib import Path

import torch

from data import CharVocab
from model import GPT, CausalSelfAttention, GPTConfig
from model.designs.grouped import GroupedQueryAttention

from .tokenizer import read_vocab

EXPORTABLE = ("learned or rotary positions with multi-head attention, learned positions with multi-query "
              "attention (n_kv_head=1), rotary positions with grouped queries (n_kv_head < n_head)")
EPS = 1e-5  # torch's LayerNorm default, which kvgpt's blocks use
ROPE_BASE = 10_000.0  # model/attention.py: rotary()
ROLLING_POSITIONS = 1 << 20  # a rolling design's last position: engines that stop there stop far past block_size

# kvgpt's weights per block, except the fused qkv, -> each class's (transformers' name per block suffix)
BLOCK_NAMES = {
    "gpt2": {"ln_1": "ln_1", "ln_2": "ln_2", "attn.out_proj": "attn.c_proj", "mlp.fc": "mlp.c_fc",
             "mlp.proj": "mlp.c_proj"},
    "gpt_neox": {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.out_proj": "attention.dense",
                 "mlp.fc": "mlp.dense_h_to_4h", "mlp.proj": "mlp.dense_4h_to_h"},
    "starcoder2": {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.out_proj": "self_attn.o_proj",
                   "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"},
}
BLOCK_NAMES["gpt_bigcode"] = BLOCK_NAMES["gpt2"]
# model_type -> (class, the block prefix, embeddings and final norm: kvgpt's name -> transformers')
CLASSES = {
    "gpt2": ("GPT2LMHeadModel", "transformer.h.{}.",
             {"wte": "transformer.wte", "wpe": "transformer.wpe", "ln_f": "transformer.ln_f"}),
    "gpt_bigcode": ("GPTBigCodeForCausalLM", "transformer.h.{}.",
                    {"wte": "transformer.wte", "wpe": "transformer.wpe", "ln_f": "transformer.ln_f"}),
    "gpt_neox": ("GPTNeoXForCausalLM", "gpt_neox.layers.{}.",
                 {"wte": "gpt_neox.embed_in", "ln_f": "gpt_neox.final_layer_norm"}),
    "starcoder2": ("Starcoder2ForCausalLM", "model.layers.{}.", {"wte": "model.embed_tokens", "ln_f": "model.norm"}),
}


def model_type(config: GPTConfig) -> str:
    """The transformers model_type whose model equals config's, or a ValueError naming the designs that export."""
    no_equivalent = [name for name, used in (("shared layers (kv_share)", config.kv_share > 1),
                                             ("local layers (window_pattern, local_window)",
                                              config.window_pattern != "G" or config.local_window is not None),
                                             ("a learned sink", config.learned_sink is not False),
                                             ("latent attention (kv_latent)",
                                              config.kv_latent is not None or bool(config.kv_latent_rope)))
                     if used]
    if config.pos_emb == "learned" and 1 < config.n_kv_head < config.n_head:
        no_equivalent.append("learned positions with grouped queries")
    if no_equivalent:
        raise ValueError(f"{' and '.join(no_equivalent)} have no exact equivalent in transformers; the designs "
                         f"that export: {EXPORTABLE}")
    if config.pos_emb == "learned":
        return "gpt2" if config.n_kv_head == config.n_head else "gpt_bigcode"
    return "gpt_neox" if config.n_kv_head == config.n_head else "starcoder2"


def rolls(config) -> bool:
    """Whether the transformers model goes on past block_size as kvgpt does: a sliding window of block_size."""
    return config.pos_emb == "rope" and config.n_kv_head < config.n_head


def check_layers(model: GPT) -> None:
    """A ValueError if a block's attention is not the plain or grouped one its config names (say the textbook
    MultiHeadAttention), or turns fewer channels than the whole head."""
    for i, block in enumerate(model.blocks):
        if type(block.attn) not in (CausalSelfAttention, GroupedQueryAttention) or \
                block.attn.rotary_dim != model.config.head_dim:
            raise ValueError(f"block {i}'s attention, {type(block.attn).__name__}, has no exact equivalent in "
                             f"transformers; the designs that export: {EXPORTABLE}")


def hf_config(config: GPTConfig) -> dict:
    """config.json's fields (less transformers' version) for config's transformers class."""
    kind = model_type(config)
    c, common = config, {"vocab_size": config.vocab_size, "tie_word_embeddings": True, "use_cache": True,
                         "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if kind in ("gpt2", "gpt_bigcode"):
        fields = {"n_positions": c.block_size, "n_ctx": c.block_size,  # llama.cpp's converter reads n_ctx
                  "n_embd": c.n_embd, "n_layer": c.n_layer, "n_head": c.n_head, "n_inner": 4 * c.n_embd,
                  "activation_function": "gelu", "layer_norm_epsilon": EPS,
                  "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
                  "scale_attn_weights": True}
        fields.update({"multi_query": True} if kind == "gpt_bigcode" else
                      {"scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False})
    else:
        fields = {"hidden_size": c.n_embd, "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
                  "intermediate_size": 4 * c.n_embd, "hidden_act": "gelu", "max_position_embeddings": c.block_size,
                  "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_BASE}, "attention_dropout": c.dropout}
        if kind == "gpt_neox":
            fields.update(layer_norm_eps=EPS, use_parallel_residual=False, attention_bias=True,
                          hidden_dropout=c.dropout)
            fields["rope_parameters"]["partial_rotary_factor"] = 1.0
        else:  # kvgpt's rotary cache rolls on past block_size: each token sees block_size tokens, itself included
            fields.update(num_key_value_heads=c.n_kv_head, norm_epsilon=EPS, use_bias=True,
                          sliding_window=c.block_size, residual_dropout=c.dropout, embedding_dropout=c.dropout,
                          max_position_embeddings=ROLLING_POSITIONS)
    return {"model_type": kind, "architectures": [CLASSES[kind][0]], **common, **fields}


def with_zero_biases(model: GPT) -> dict[str, torch.Tensor]:
    """model's weights in float32, with a zero bias for each Linear and LayerNorm that has none (not the head):
    every transformers class here has them, and a zero bias changes nothing."""
    state = {name: w.detach().float().cpu().contiguous() for name, w in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and module.bias is None and name != "lm_head":
            state[f"{name}.bias"] = torch.zeros(module.weight.size(0), dtype=torch.float32)
    return state


def to_hf(model: GPT) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json's fields, model.safetensors' tensors) of model's transformers equivalent. The head is tied, so
    its weight is the token embedding's, stored once."""
    config = model.config
    check_layers(model)
    kind, hf = model_type(config), hf_config(config)
    block = CLASSES[kind][1]
    state = with_zero_biases(model)  # every block's bias is there; the embeddings' and final norm's may not be
    out = {theirs: stored(state[ours], conv1d) for ours, theirs, conv1d in weight_names(kind, config.n_layer)
           if ours in state}
    for i in range(config.n_layer):
        for part in ("weight", "bias"):
            out.update(split_qkv(kind, state[f"blocks.{i}.attn.qkv.{part}"], config, block.format(i), part))
    return hf, out


def weight_names(kind: str, n_layer: int) -> list[tuple[str, str, bool]]:
    """(kvgpt's name, transformers' name, whether stored transposed) for each weight and bias of a model of kind
    with n_layer blocks, but the fused projection's (split_qkv)."""
    _, block, top = CLASSES[kind]
    pairs = [(ours, theirs, False) for ours, theirs in top.items()]
    pairs += [(f"blocks.{i}.{suffix}", block.format(i) + name, kind == "gpt2") for i in range(n_layer)
              for suffix, name in BLOCK_NAMES[kind].items()]  # GPT-2's blocks hold Conv1D layers
    return [(f"{ours}.{part}", f"{theirs}.{part}", conv1d and part == "weight") for ours, theirs, conv1d in pairs
            for part in ("weight", "bias")]


def stored(w: torch.Tensor, conv1d: bool) -> torch.Tensor:
    """A matrix as GPT-2's Conv1D stores it, (in, out), where conv1d; transposing twice gives it back."""
    return w.t().contiguous() if conv1d and w.dim() == 2 else w


def split_qkv(kind: str, w: torch.Tensor, config: GPTConfig, prefix: str, part: str) -> dict[str, torch.Tensor]:
    """The fused projection's rows (Q, then K, then V) as each class stores them."""
    hd, C, kv = config.head_dim, config.n_embd, config.n_kv_head * config.head_dim
    if kind == "gpt2":
        return {f"{prefix}attn.c_attn.{part}": w.t().contiguous() if part == "weight" else w}
    if kind == "gpt_bigcode":
        return {f"{prefix}attn.c_attn.{part}": w}
    if kind == "gpt_neox":  # one head's q, k and v rows side by side, head after head
        heads = w.reshape(3, config.n_head, hd, *w.shape[1:]).transpose(0, 1)
        return {f"{prefix}attention.query_key_value.{part}": heads.reshape(w.shape).contiguous()}
    q, k, v = w.split([C, kv, kv])
    return {f"{prefix}self_attn.{n}_proj.{part}": t.contiguous() for n, t in zip("qkv", (q, k, v))}


def join_qkv(kind: str, tensors: dict, config: GPTConfig, prefix: str, part: str) -> torch.Tensor:
    """split_qkv undone: the fused projection's rows from a class's tensors."""
    if kind == "gpt2":
        w = tensors[f"{prefix}attn.c_attn.{part}"]
        return w.t().contiguous() if part == "weight" else w
    if kind == "gpt_bigcode":
        return tensors[f"{prefix}attn.c_attn.{part}"]
    if kind == "gpt_neox":
        w = tensors[f"{prefix}attention.query_key_value.{part}"]
        return w.reshape(config.n_head, 3, config.head_dim, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
    return torch.cat([tensors[f"{prefix}self_attn.{n}_proj.{part}"] for n in "qkv"])


def gpt_config(hf: dict) -> GPTConfig:
    """The GPTConfig of a config.json that hf_config wrote; a ValueError if it names a model kvgpt's cannot be."""
    kind = hf.get("model_type")
    if kind not in CLASSES:
        raise ValueError(f"model_type {kind!r} is none of {', '.join(CLASSES)}")
    learned = kind in ("gpt2", "gpt_bigcode")
    window = "sliding_window" if kind == "starcoder2" else "max_position_embeddings"  # a rolling design's block_size
    n = ((lambda k: hf[{"block_size": "n_positions"}.get(k, k)]) if learned else
         (lambda k: hf[{"block_size": window, "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                        "n_embd": "hidden_size"}[k]]))
    n_head = n("n_head")
    n_kv_head = {"gpt2": n_head, "gpt_bigcode": 1 if hf.get("multi_query") else n_head, "gpt_neox": n_head,
                 "starcoder2": hf.get("num_key_value_heads", n_head)}[kind]
    config = GPTConfig(vocab_size=hf["vocab_size"], block_size=n("block_size"), n_layer=n("n_layer"),
                       n_head=n_head, n_embd=n("n_embd"), pos_emb="learned" if learned else "rope",
                       n_kv_head=n_kv_head, dropout=hf.get("resid_pdrop", hf.get("attention_dropout", 0.0)))
    expected, differ = hf_config(config), []
    for key in ("activation_function", "hidden_act", "n_inner", "intermediate_size", "layer_norm_epsilon",
                "layer_norm_eps", "norm_epsilon", "use_parallel_residual", "sliding_window", "tie_word_embeddings",
                "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "multi_query"):
        if key in expected and hf.get(key, expected[key]) != expected[key]:
            differ.append(f"{key} {hf.get(key)!r}, not {expected[key]!r}")
    rope, want = hf.get("rope_parameters") or {}, expected.get("rope_parameters", {})
    differ += [f"rope {k} {rope.get(k)!r}, not {v!r}" for k, v in want.items() if rope.get(k, v) != v]
    if differ:
        raise ValueError(f"its {', '.join(differ)}: kvgpt's model is not that function")
    return config


def from_hf(hf: dict, tensors: dict[str, torch.Tensor]) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """(GPTConfig, kvgpt state_dict) of a transformers config and its tensors: to_hf undone. Biases that are all
    zeros make a model without biases (bias=False), which is the same function."""
    config = gpt_config(hf)
    kind = hf["model_type"]
    block = CLASSES[kind][1]
    state = {ours: stored(tensors[theirs], conv1d) for ours, theirs, conv1d in weight_names(kind, config.n_layer)
             if theirs in tensors or ours.startswith("blocks.")}  # a missing block weight: a KeyError, as damaged
    for i in range(config.n_layer):
        for part in ("weight", "bias"):
            state[f"blocks.{i}.attn.qkv.{part}"] = join_qkv(kind, tensors, config, block.format(i), part)
    state["lm_head.weight"] = state["wte.weight"]
    biases = [name for name in state if name.endswith(".bias")]
    if all(not state[name].any() for name in biases):
        config.bias = False
        state = {name: w for name, w in state.items() if name not in biases}
    return config, {name: w.contiguous() for name, w in state.items()}


ONNX_FILE, GGUF_FILE = "model.onnx", "model.gguf"  # the model's file in export.py's onnx and gguf folders
UNREADABLE_EXPORTS = {ONNX_FILE: "an ONNX export", GGUF_FILE: "a GGUF export (llama.cpp's)"}  # not read back


SOURCE_KEY = "checkpoint"  # model.safetensors' metadata: the checkpoint file the folder was exported from


def exported_from(folder: Path) -> Path | None:
    """The checkpoint file an exported folder was written from, as its metadata records it; None where it records
    none (an export of an earlier version) or cannot be read."""
    from safetensors import safe_open
    try:
        with safe_open(folder / "model.safetensors", framework="pt") as f:
            source = (f.metadata() or {}).get(SOURCE_KEY)
    except Exception:  # a damaged file can fail anywhere in safetensors: then nothing is known
        return None
    return Path(source) if source else None


def is_export(path: Path) -> bool:
    """Whether path is a folder that `export.py --format hf` wrote."""
    return path.is_dir() and (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def unreadable_export(path: Path) -> str | None:
    """What export path is when export.py wrote it in a format kvgpt does not read back, else None."""
    return next((kind for name, kind in UNREADABLE_EXPORTS.items() if (path / name).is_file()), None)


def read_export(folder: Path) -> tuple[GPTConfig, dict[str, torch.Tensor], CharVocab, dict]:
    """(GPTConfig, kvgpt state_dict, vocabulary, what model.safetensors' metadata records) of an exported folder,
    checked whole: a tokenizer of another size than the model's vocabulary, or a JSON file that does not parse, is
    a ValueError here, not found midway through the output."""
    from safetensors import safe_open  # only when a folder is read: sample.py needs it for nothing else
    hf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
        metadata = f.metadata() or {}
    config, state = from_hf(hf, tensors)
    vocab = read_vocab(folder)
    if len(vocab) != config.vocab_size:
        raise ValueError(f"tokenizer.json holds {len(vocab)} characters, config.json's vocab_size is "
                         f"{config.vocab_size}")
    for name in ("generation_config.json", "tokenizer_config.json"):  # read by transformers, not by kvgpt
        if (folder / name).exists() and not isinstance(json.loads((folder / name).read_text("utf-8")), dict):
            raise ValueError(f"{name} holds no JSON object")
    return config, state, vocab, metadata
