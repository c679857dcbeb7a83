"""export.py: each exportable design, loaded by transformers and by onnxruntime, gives kvgpt's logits and greedy
text; an exported folder reads back into kvgpt; every refusal is one line and leaves the folder as it was."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")  # requirements-dev.txt installs it; kvgpt runs without it
ort = pytest.importorskip("onnxruntime")

import export as export_py  # noqa: E402
from data import CharVocab  # noqa: E402
from exporting.folder import export  # noqa: E402
from runtime.hf import to_hf  # noqa: E402
from model import GREEDY, CausalSelfAttention, KVCache, generate  # noqa: E402
from runtime.checkpoint import build_checkpoint, load_model, save_checkpoint  # noqa: E402
from runtime.errors import CheckpointError  # noqa: E402
from tiny_models import BLOCK_SIZE, random_model, trained_on  # noqa: E402
from tolerance import assert_forward_close, forward_atol  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB = CharVocab("\n !abcdefghij")  # 13 characters, spaces and newlines among them: tiny_models' VOCAB
RAREST = "b"  # the training text's rarest character, named bos, eos and unk: the greedy texts below write none
TRAINED_ON = trained_on(VOCAB, RAREST)
# design -> (GPTConfig fields, transformers class, seed). The rotary models' seeds are ones whose greedy text past
# block_size differs with and without kvgpt's window, so that a window lost on the way would show.
DESIGNS = {
    "learned multi-head": ({}, "GPT2LMHeadModel", 1),
    "learned multi-head, no biases": ({"bias": False}, "GPT2LMHeadModel", 1),
    "learned multi-query": ({"n_kv_head": 1}, "GPTBigCodeForCausalLM", 1),
    "rotary multi-head": ({"pos_emb": "rope"}, "GPTNeoXForCausalLM", 4),
    "rotary grouped-query": ({"pos_emb": "rope", "n_head": 4, "n_kv_head": 2}, "Starcoder2ForCausalLM", 4),
    "rotary multi-query": ({"pos_emb": "rope", "n_head": 4, "n_kv_head": 1}, "Starcoder2ForCausalLM", 5),
}
ROLLS = {"rotary grouped-query", "rotary multi-query"}  # transformers slides a window of block_size, as kvgpt does
PROMPT, ROTARY_PROMPT = "ab ba\n", "a\nbcdefghij  !\n"  # the second one token short of block_size


def kvgpt_model(design: str):
    """A tiny random model of the design, its biases random too, so that a bias dropped on the way would show."""
    fields, _, seed = DESIGNS[design]
    model = random_model(seed, **fields)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """design -> (kvgpt model, hf folder, its run directory), exported from a checkpoint file."""
    folders = {}
    for i, design in enumerate(DESIGNS):
        run = tmp_path_factory.mktemp(f"run{i}")
        model = kvgpt_model(design)
        save_checkpoint(build_checkpoint(model, VOCAB, text=TRAINED_ON), run / "best.pt")
        folders[design] = (model, export(run, run / "hf"), run)
    return folders


@pytest.fixture(scope="module")
def exported_onnx(exported):
    """design -> onnx folder, exported from the same checkpoint file."""
    return {design: export(run / "best.pt", run / "onnx", "onnx") for design, (_, _, run) in exported.items()}


def hf_model(folder):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info  # every weight named, none left over
    return model.eval()


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, len(VOCAB), (2, n), generator=torch.Generator().manual_seed(seed))


def kvgpt_greedy(model, prompt: str, n: int) -> str:
    """sample.py --temperature 0's text: kvgpt's decoding loop, greedy."""
    return VOCAB.decode(generate(model, torch.tensor([VOCAB.encode(prompt)]), n, sampling=GREEDY)[0].tolist())


@pytest.mark.parametrize("design", DESIGNS)
def test_transformers_gives_kvgpt_logits_whole_and_step_by_step_with_its_own_cache(exported, design):
    model, folder, _ = exported[design]
    hf = hf_model(folder)
    assert type(hf).__name__ == DESIGNS[design][1]
    length = 2 * BLOCK_SIZE if design in ROLLS else BLOCK_SIZE  # past block_size, kvgpt's window slides
    x = tokens(length)
    with torch.no_grad():
        want, _ = model(x)  # (B, T, V); past block_size each token sees the last block_size
        assert_forward_close(hf(x).logits, want, model)
        out = hf(x[:, :5], use_cache=True)
        steps = [out.logits]
        for t in range(5, length):
            out = hf(x[:, t:t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    assert_forward_close(torch.cat(steps, dim=1), want, model)


@pytest.mark.parametrize("design", DESIGNS)
def test_generate_gives_kvgpt_greedy_text_past_block_size_where_the_design_rolls(exported, design):
    model, folder, _ = exported[design]
    prompt, n = (ROTARY_PROMPT, 3 * BLOCK_SIZE) if design in ROLLS else (PROMPT, BLOCK_SIZE - len(PROMPT))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == VOCAB.encode(prompt)
    text = tokenizer.decode(hf_model(folder).generate(ids, do_sample=False, max_new_tokens=n)[0])
    assert text == kvgpt_greedy(model, prompt, n)


def test_rotary_multi_head_past_block_size_attends_every_token_in_transformers(exported):
    """GPT-NeoX has no sliding window: past block_size, generate is kvgpt's model over a cache that keeps every
    token (no window), which is not what kvgpt's own decoding does there."""
    model, folder, _ = exported["rotary multi-head"]
    prompt, n = torch.tensor([VOCAB.encode(ROTARY_PROMPT)]), 2 * BLOCK_SIZE
    c = model.config
    cache = KVCache(c.n_layer, 1, c.n_kv_head, prompt.size(1) + n, c.head_dim)
    ids, logits = prompt, model.decode_step(prompt, cache)
    for _ in range(n):
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        logits = model.decode_step(ids[:, -1:], cache)
    assert hf_model(folder).generate(prompt, do_sample=False, max_new_tokens=n).tolist() == ids.tolist()


def test_the_pipeline_and_sample_py_give_the_greedy_text_of_the_folder(exported):
    model, folder, _ = exported["rotary grouped-query"]
    prompt, n = "\nab", 2 * BLOCK_SIZE  # its greedy text writes newlines, past block_size too
    pipe = transformers.pipeline("text-generation", model=str(folder))
    # at its defaults: it leaves special tokens out, and only RAREST is one, which this text does not hold
    text = pipe(prompt, max_new_tokens=n)[0]["generated_text"]
    assert text == kvgpt_greedy(model, prompt, n) and "\n" in text[len(prompt):]
    sampled = subprocess.run([sys.executable, "sample.py", "--checkpoint", str(folder), "--prompt", prompt,
                              "--temperature", "0", "--max-new-tokens", str(n)],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout == text + "\n" and "weights only" in sampled.stderr


def test_the_tokenizer_encodes_and_decodes_every_character_exactly(exported):
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported["learned multi-head"][1])
    text = "  a\n\nb  j!\n ihg fedcba \n"
    ids = tokenizer(text).input_ids
    assert ids == VOCAB.encode(text) and tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(list(range(len(VOCAB)))) == list(VOCAB.chars)


def test_engines_read_bos_eos_unk_and_context_from_the_folder_which_adds_no_token_and_no_cap(exported):
    """bos, eos and unk name the training text's rarest character, so no id is added past the logits (the tests
    above give kvgpt's logits and text with them); GPT-2 has n_ctx; a rolling design's config stops nothing at
    block_size."""
    for design, (_, folder, _) in exported.items():
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == (RAREST,) * 3
        assert len(tokenizer) == len(VOCAB) and tokenizer.eos_token_id == VOCAB.encode(RAREST)[0]
        config = json.loads((folder / "config.json").read_text())
        if design in ROLLS:
            assert config["sliding_window"] == BLOCK_SIZE and config["max_position_embeddings"] >= 1 << 20
        if config["model_type"] == "gpt2":
            assert config["n_ctx"] == config["n_positions"] == BLOCK_SIZE


def onnx_greedy(folder, prompt: str, n: int, block_size: int) -> tuple[str, list[np.ndarray]]:
    """docs/export.md's loop: prefill, then one token per step, the cache fed back and kept to block_size - 1."""
    session = ort.InferenceSession(str(folder / "model.onnx"))
    names = [i.name for i in session.get_inputs()[2:]]
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in session.get_inputs()[2:]}
    ids, feed, position, logits = VOCAB.encode(prompt), VOCAB.encode(prompt), 0, []
    for _ in range(n):
        out = session.run(None, {"input_ids": np.array([feed]),
                                 "position_ids": np.arange(position, position + len(feed))[None], **past})
        position += len(feed)
        past = {name: present[:, :, -(block_size - 1):] for name, present in zip(names, out[1:])}
        logits.append(out[0][0])
        feed = [int(out[0][0, -1].argmax())]
        ids += feed
    return VOCAB.decode(ids), logits


@pytest.mark.parametrize("design", DESIGNS)
def test_onnxruntime_with_its_cache_fed_back_gives_kvgpt_logits_and_greedy_text(exported, exported_onnx, design):
    model, folder = exported[design][0], exported_onnx[design]
    rolls = model.config.pos_emb == "rope"  # kvgpt's own graph: with rotary positions it rolls like kvgpt
    prompt, n = (ROTARY_PROMPT, 3 * BLOCK_SIZE) if rolls else (PROMPT, BLOCK_SIZE - len(PROMPT))
    text, logits = onnx_greedy(folder, prompt, n, BLOCK_SIZE)
    assert text == kvgpt_greedy(model, prompt, n)
    with torch.no_grad():
        want, _ = model(torch.tensor([VOCAB.encode(text[:-1])]))  # past block_size: the window, as the loop's
    # onnxruntime's kernels are a third float32 evaluation of the same forward
    np.testing.assert_allclose(np.concatenate(logits), want[0].numpy(), atol=forward_atol(model.config, want), rtol=0)


@pytest.mark.parametrize("design", ["learned multi-head", "learned multi-head, no biases", "rotary grouped-query"])
def test_a_checkpoint_from_the_export_gives_the_same_weights_and_logits(exported, design):
    model, folder, _ = exported[design]
    back, vocab, contents = load_model(folder)
    assert vocab == VOCAB and back.config.bias == model.config.bias and "training" not in contents
    assert back.config == model.config
    x = tokens(BLOCK_SIZE, seed=3)
    with torch.no_grad():
        assert torch.equal(back(x)[0], model(x)[0])


def test_a_damaged_export_is_one_checkpoint_error(exported, tmp_path):
    folder = tmp_path / "damaged"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_bytes((exported["learned multi-head"][1] / name).read_bytes())
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(CheckpointError, match="damaged"):
        load_model(folder)


def run_export(capsys, *argv) -> tuple[int, str]:
    """export.py's main in this process: (exit status, stderr)."""
    with pytest.raises(SystemExit) as stop:
        export_py.main([str(a) for a in argv])
    return stop.value.code, capsys.readouterr().err


@pytest.fixture
def run(tmp_path):
    save_checkpoint(build_checkpoint(kvgpt_model("learned multi-head"), VOCAB, text=TRAINED_ON), tmp_path / "best.pt")
    return tmp_path


def refused(capsys, *argv, match: str) -> None:
    status, err = run_export(capsys, *argv)
    assert status == 2 and err.count("\n") == 1 and err.startswith("export.py: error: ") and match in err, err


def test_an_out_folder_that_is_not_empty_is_refused_and_left_as_it_was(run, capsys):
    out = run / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    refused(capsys, "--checkpoint", run, out, match="exists and is not empty")
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "keep me"
    refused(capsys, "--checkpoint", run, out / "mine.txt", match="is a file")


def test_an_unwritable_folder_a_precision_and_a_missing_or_damaged_checkpoint_are_refused(run, capsys):
    if Path("/proc/self").is_dir():  # a folder that exists, in which even root makes no file
        refused(capsys, "--checkpoint", run, "/proc/kvgpt-export", match="cannot write in /proc")
    refused(capsys, "--checkpoint", run, run / "no" / "out", match="does not exist")
    for precision in ("int8", "bf16"):
        refused(capsys, "--checkpoint", run, run / "out", "--precision", precision, match=f"--precision {precision}")
    refused(capsys, "--checkpoint", run / "nothing.pt", run / "out", match="no checkpoint at")
    (run / "last.pt").write_bytes(b"not a checkpoint")
    refused(capsys, "--checkpoint", run / "last.pt", run / "out", match="corrupt")
    assert sorted(p.name for p in run.iterdir()) == ["best.pt", "last.pt"]


@pytest.mark.parametrize("fields, named", [
    ({"n_layer": 2, "kv_share": 2}, "shared layers"),
    ({"window_pattern": "LG", "local_window": 4}, "local layers"),
    ({"learned_sink": True}, "a learned sink"),
    ({"kv_latent": 12}, "latent attention"),
    ({"n_head": 4, "n_kv_head": 2}, "learned positions with grouped queries"),
])
def test_a_design_with_no_exact_equivalent_is_refused_naming_those_that_export(tmp_path, capsys, fields, named):
    save_checkpoint(build_checkpoint(random_model(**fields), VOCAB), tmp_path / "best.pt")
    refused(capsys, "--checkpoint", tmp_path, tmp_path / "out", match=f"{named}")
    refused(capsys, "--checkpoint", tmp_path, tmp_path / "out", match="the designs that export: learned or rotary")
    assert not (tmp_path / "out").exists()


def test_an_attention_layer_of_another_class_is_refused():
    class Other(CausalSelfAttention):
        pass

    model = random_model()
    model.blocks[1].attn = Other(model.config, kv_layer=1)
    with pytest.raises(ValueError, match="block 1's attention, Other, has no exact equivalent"):
        to_hf(model)


def test_a_failed_export_leaves_no_folder_and_a_refusal_is_one_line_from_the_command(run, capsys, monkeypatch):
    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("exporting.folder.write_tokenizer", full_disk)
    monkeypatch.setattr("runtime.command.silence", lambda stream: None)  # capsys' stdout has no file to point away
    status, err = run_export(capsys, "--checkpoint", run, run / "out")
    assert status == 1 and "No space left on device" in err and err.count("\n") == 1, err
    (run / "empty").mkdir()
    assert run_export(capsys, "--checkpoint", run, run / "empty", "--format", "onnx")[0] == 1
    assert sorted(p.name for p in run.iterdir()) == ["best.pt", "empty"] and not any((run / "empty").iterdir())
    command = subprocess.run([sys.executable, "export.py", "--checkpoint", str(run), str(run), "--format", "hf"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert command.returncode == 2 and command.stdout == "", command.stderr
    assert command.stderr == f"export.py: error: {run} exists and is not empty; pass a new or empty folder, " \
                             f"nothing was overwritten\n"
