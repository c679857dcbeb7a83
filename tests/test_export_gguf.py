"""export.py --format gguf: the file read back with the gguf package holds every tensor and metadata field that
llama.cpp's GPT-2 and StarCoder2 graphs load, with kvgpt's weights; its tokenizer, read as llama.cpp reads an rwkv
one (written out here), gives kvgpt's ids for every character and names no end of text; designs llama.cpp cannot run
are refused in one line."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")  # requirements-dev.txt installs it; kvgpt runs without it

import export as export_py  # noqa: E402
from data import CharVocab  # noqa: E402
from runtime.checkpoint import build_checkpoint, save_checkpoint  # noqa: E402
from tiny_models import BLOCK_SIZE, random_model  # noqa: E402

VOCAB = CharVocab("\t\n !\\abcdefghijé—…")  # tab, newline, space, backslash, characters of two and three bytes
GPT2 = {}
STARCODER2 = {"pos_emb": "rope", "n_head": 4, "n_kv_head": 2}
# llama.cpp's graphs (src/models/gpt2.cpp, starcoder2.cpp): each tensor they load, with its shape in ggml's order
# (the torch shape reversed); written out here from their source, not from exporting/gguf.py
C, V, FF = 24, len(VOCAB), 96


def needed(arch: str, n_layer: int, n_kv_head: int, head_dim: int) -> dict[str, tuple]:
    kv = n_kv_head * head_dim
    out = {"token_embd.weight": (C, V), "output_norm.weight": (C,), "output_norm.bias": (C,)}
    if arch == "gpt2":
        out["position_embd.weight"] = (C, BLOCK_SIZE)
    for i in range(n_layer):
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": (C,), b + "attn_norm.bias": (C,), b + "attn_output.weight": (C, C),
                    b + "attn_output.bias": (C,), b + "ffn_norm.weight": (C,), b + "ffn_norm.bias": (C,),
                    b + "ffn_up.weight": (C, FF), b + "ffn_up.bias": (FF,), b + "ffn_down.weight": (FF, C),
                    b + "ffn_down.bias": (C,)})
        if arch == "gpt2":
            out.update({b + "attn_qkv.weight": (C, C + 2 * kv), b + "attn_qkv.bias": (C + 2 * kv,)})
        else:
            out.update({b + "attn_q.weight": (C, C), b + "attn_q.bias": (C,), b + "attn_k.weight": (C, kv),
                        b + "attn_k.bias": (kv,), b + "attn_v.weight": (C, kv), b + "attn_v.bias": (kv,)})
    return out


def exported(tmp_path, capsys, fields: dict):
    """(kvgpt model, the GGUFReader of its export, export.py's stderr)."""
    model = random_model(2, vocab_size=V, **fields)
    tmp_path.mkdir(exist_ok=True)
    save_checkpoint(build_checkpoint(model, VOCAB), tmp_path / "best.pt")
    export_py.main(["--checkpoint", str(tmp_path), str(tmp_path / "out"), "--format", "gguf"])
    err = capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["README.md", "model.gguf"]
    return model, gguf.GGUFReader(tmp_path / "out" / "model.gguf"), err


def field(reader, key):
    return reader.fields[key].contents()


@pytest.mark.parametrize("arch, fields", [("gpt2", GPT2), ("starcoder2", STARCODER2)])
def test_every_tensor_llama_cpp_loads_is_there_with_kvgpt_weights(tmp_path, capsys, arch, fields):
    model, reader, _ = exported(tmp_path, capsys, fields)
    c = model.config
    tensors = {t.name: t for t in reader.tensors}
    want = needed(arch, c.n_layer, c.n_kv_head, c.head_dim)
    assert {name: tuple(int(n) for n in t.shape) for name, t in tensors.items()} == want  # none missing, none over
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    state = {k: v.float() for k, v in model.state_dict().items()}
    qkv = state["blocks.1.attn.qkv.weight"]
    expected = {"token_embd.weight": state["wte.weight"], "blk.1.ffn_up.weight": state["blocks.1.mlp.fc.weight"],
                "blk.0.ffn_down.bias": state["blocks.0.mlp.proj.bias"], "output_norm.bias": state["ln_f.bias"]}
    if arch == "gpt2":
        expected.update({"position_embd.weight": state["wpe.weight"], "blk.1.attn_qkv.weight": qkv})
    else:
        kv = c.n_kv_head * c.head_dim
        expected.update({"blk.1.attn_q.weight": qkv[:C], "blk.1.attn_k.weight": qkv[C:C + kv],
                         "blk.1.attn_v.weight": qkv[C + kv:]})
    for name, weight in expected.items():  # the reader's data is in torch's (out, in) order
        np.testing.assert_array_equal(np.asarray(tensors[name].data), weight.numpy(), err_msg=name)


@pytest.mark.parametrize("arch, fields", [("gpt2", GPT2), ("starcoder2", STARCODER2)])
def test_every_metadata_field_llama_cpp_reads_is_there(tmp_path, capsys, arch, fields):
    model, reader, _ = exported(tmp_path, capsys, fields)
    c = model.config
    want = {"general.architecture": arch, f"{arch}.context_length": BLOCK_SIZE, f"{arch}.embedding_length": C,
            f"{arch}.feed_forward_length": FF, f"{arch}.block_count": c.n_layer,
            f"{arch}.attention.head_count": c.n_head, "general.file_type": 0,  # all float32
            "tokenizer.ggml.model": "rwkv", "tokenizer.ggml.add_bos_token": False,
            "tokenizer.ggml.add_eos_token": False}
    if arch == "starcoder2":
        want.update({f"{arch}.attention.head_count_kv": 2, f"{arch}.rope.freq_base": 10_000.0,
                     f"{arch}.rope.dimension_count": c.head_dim})
    assert {key: field(reader, key) for key in want} == want
    assert field(reader, f"{arch}.attention.layer_norm_epsilon") == pytest.approx(1e-5)
    assert field(reader, "tokenizer.ggml.token_type") == [gguf.TokenType.NORMAL] * V
    assert len(field(reader, "tokenizer.ggml.tokens")) == V
    named = [key for key in reader.fields if key.startswith("tokenizer.ggml.") and key.endswith("_token_id")]
    assert named == []  # no bos, eos or unk: llama.cpp's rwkv tokenizer then has no end-of-text token


def llama_cpp_unescape(token: str) -> bytes:
    """llama.cpp's llama_unescape_rwkv_token (src/llama-vocab.cpp), written out: a backslash starts \\t, \\n,
    \\r, \\x and two lowercase hex digits, or stands before a character that is then itself."""
    out, chars = bytearray(), iter(token)
    for c in chars:
        if c != "\\":
            out += c.encode()
            continue
        c = next(chars)
        if c == "x":  # its digits: c - 'a' + 10 from 'a' on, else c - '0' (so lowercase only)
            digits = [ord(d) - ord("a") + 10 if d >= "a" else ord(d) - ord("0") for d in (next(chars), next(chars))]
            out.append(16 * digits[0] + digits[1])
        else:
            out += {"t": b"\t", "n": b"\n", "r": b"\r"}.get(c, c.encode())
    return bytes(out)


def llama_cpp_tokenize(tokens: list[bytes], text: bytes) -> list[int]:
    """llama.cpp's rwkv tokenizer: at each place, the longest token whose bytes come next."""
    ids, at = [], 0
    while at < len(text):
        best = max((i for i, t in enumerate(tokens) if t and text.startswith(t, at)), key=lambda i: len(tokens[i]))
        ids.append(best)
        at += len(tokens[best])
    return ids


def test_the_tokenizer_read_as_llama_cpp_reads_it_gives_kvgpt_ids_for_every_character(tmp_path, capsys):
    """The file's tokens, unescaped and matched as llama.cpp does: every character, and a text of them, is kvgpt's
    ids, and their bytes joined give the text back."""
    _, reader, _ = exported(tmp_path, capsys, GPT2)
    tokens = [llama_cpp_unescape(t) for t in field(reader, "tokenizer.ggml.tokens")]
    assert tokens == [c.encode() for c in VOCAB.chars]
    text = "é—a… b\n\n \\ j!\té\né…—\\a\\j" + VOCAB.chars
    for piece in [*VOCAB.chars, text]:
        ids = llama_cpp_tokenize(tokens, piece.encode())
        assert ids == VOCAB.encode(piece) and b"".join(tokens[i] for i in ids) == piece.encode(), repr(piece)


def test_a_design_that_runs_exactly_only_up_to_block_size_is_exported_with_a_warning(tmp_path, capsys):
    _, _, err = exported(tmp_path, capsys, STARCODER2)
    assert err.count("\n") == 1 and err.startswith("export.py: warning: ") and "only up to block_size" in err, err
    assert exported(tmp_path / "gpt2", capsys, GPT2)[2] == ""


@pytest.mark.parametrize("fields, named", [
    ({"pos_emb": "rope"}, "rotary positions with multi-head attention is not exported to gguf"),
    ({"n_kv_head": 1}, "learned positions with multi-query attention is not exported to gguf"),
    ({"n_layer": 2, "kv_share": 2}, "shared layers (kv_share) have no exact equivalent in llama.cpp"),
])
def test_a_design_llama_cpp_cannot_run_exactly_is_refused_in_one_line(tmp_path, capsys, fields, named):
    save_checkpoint(build_checkpoint(random_model(**fields), CharVocab("\n !abcdefghij")), tmp_path / "best.pt")
    with pytest.raises(SystemExit) as stop:
        export_py.main(["--checkpoint", str(tmp_path), str(tmp_path / "out"), "--format", "gguf"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and named in err, err
    assert "the designs that export to gguf: learned positions with multi-head" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]


def test_the_gguf_weights_rebuild_kvgpt_logits(tmp_path, capsys):
    """Loaded back by name into a fresh kvgpt model, the file's tensors give the checkpoint's logits exactly."""
    model, reader, _ = exported(tmp_path, capsys, GPT2)
    t = {x.name: torch.from_numpy(np.array(x.data)) for x in reader.tensors}
    back = random_model(9, vocab_size=V)
    names = {"ln_1": "attn_norm", "ln_2": "ffn_norm", "attn.qkv": "attn_qkv", "attn.out_proj": "attn_output",
             "mlp.fc": "ffn_up", "mlp.proj": "ffn_down"}
    state = {"wte.weight": t["token_embd.weight"], "wpe.weight": t["position_embd.weight"],
             "lm_head.weight": t["token_embd.weight"], "ln_f.weight": t["output_norm.weight"],
             "ln_f.bias": t["output_norm.bias"]}
    state.update({f"blocks.{i}.{ours}.{p}": t[f"blk.{i}.{theirs}.{p}"] for i in range(model.config.n_layer)
                  for ours, theirs in names.items() for p in ("weight", "bias")})
    back.load_state_dict(state)
    x = torch.randint(0, V, (2, BLOCK_SIZE), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(x)[0], model(x)[0])
