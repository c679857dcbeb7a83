"""Other engines load the exports with no change by hand and give kvgpt's greedy text: CTranslate2 converts the
transformers folder, vLLM runs it, llama.cpp (through llama-cpp-python) loads the GGUF file. Each test is skipped,
with its reason, where its engine is not installed; docs/export.md says how to install each.
`python -m pytest -m engines`."""

import importlib.util
import json
import math
import os
import shutil
import subprocess

import pytest
import torch

from data import CharVocab
from exporting.folder import export
from model import GREEDY, generate
from runtime.checkpoint import build_checkpoint, save_checkpoint
from tiny_models import BLOCK_SIZE, random_model, trained_on

pytestmark = pytest.mark.engines
VOCAB = CharVocab("\n !abcdefghij")
RAREST = "b"  # the training text's rarest character, which the export names bos, eos and unk
# design -> (GPTConfig fields, seed): seeds whose greedy text holds newlines, and RAREST for some
DESIGNS = {"learned multi-head": ({}, 9), "learned multi-head, no biases": ({"bias": False}, 9),
           "learned multi-query": ({"n_kv_head": 1}, 9), "rotary multi-head": ({"pos_emb": "rope"}, 9),
           "rotary grouped-query": ({"pos_emb": "rope", "n_head": 4, "n_kv_head": 2}, 2)}
PROMPTS = ("a", "j!", "hi", "ab ba\n", "\nab")


def missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def kvgpt_greedy(model, prompt: str, n: int) -> str:
    return VOCAB.decode(generate(model, torch.tensor([VOCAB.encode(prompt)]), n, sampling=GREEDY)[0].tolist())


def checkpoint(tmp_path, design: str):
    fields, seed = DESIGNS[design]
    model = random_model(seed, **fields)
    save_checkpoint(build_checkpoint(model, VOCAB, text=trained_on(VOCAB, RAREST)), tmp_path / "best.pt")
    return model


def up_to_eos(prompt: str, text: str) -> str:
    """text as an engine that stops at eos gives it: up to the first RAREST written after the prompt."""
    cut = text.find(RAREST, len(prompt))
    return text if cut < 0 else text[:cut]


@pytest.mark.skipif(missing("ctranslate2") or missing("transformers"),
                    reason="CTranslate2 is not installed: pip install ctranslate2 (docs/export.md)")
@pytest.mark.parametrize("design", DESIGNS)
def test_ctranslate2_converts_the_folder_unpatched_and_gives_kvgpt_greedy_text(tmp_path, design):
    import ctranslate2
    from ctranslate2.converters import TransformersConverter
    from transformers import AutoConfig

    model = checkpoint(tmp_path, design)
    folder = export(tmp_path, tmp_path / "hf")
    from ctranslate2.converters import transformers as loaders
    kind = type(AutoConfig.from_pretrained(folder)).__name__
    if kind not in loaders._MODEL_LOADERS:
        pytest.skip(f"CTranslate2 {ctranslate2.__version__} converts no {kind}")
    try:
        TransformersConverter(str(folder)).convert(str(tmp_path / "ct2"))
    except AttributeError as e:  # its GPT-NeoX converter reads rotary_pct, which transformers 5 keeps no more
        if "rotary_pct" not in str(e):
            raise
        pytest.skip(f"CTranslate2 {ctranslate2.__version__}'s converter fails on transformers' {kind}: {e}")
    generator = ctranslate2.Generator(str(tmp_path / "ct2"))
    past_newlines = 0
    for prompt in (*PROMPTS, RAREST + "a\n"):  # the last begins with bos
        n = BLOCK_SIZE - len(prompt)  # within block_size, where every design is kvgpt's
        want = kvgpt_greedy(model, prompt, n)
        # docs/export.md's call: the new characters alone, up to eos; a result with its prompt would leave out a
        # first character named bos
        result = generator.generate_batch([list(prompt)], max_length=n, sampling_topk=1,
                                          include_prompt_in_result=False)
        assert prompt + "".join(result[0].sequences[0]) == up_to_eos(prompt, want), (design, prompt)
        past_newlines += "\n" in up_to_eos(prompt, want)[len(prompt):]
        result = generator.generate_batch([list(prompt)], max_length=n, sampling_topk=1, end_token=[],
                                          include_prompt_in_result=False)
        assert prompt + "".join(result[0].sequences[0]) == want, (design, prompt)  # eos ends nothing
    assert past_newlines  # a newline ends no text


@pytest.mark.skipif(missing("llama_cpp"),
                    reason="llama.cpp's Python binding is not installed: pip install llama-cpp-python (docs/export.md)")
@pytest.mark.parametrize("design", ["learned multi-head", "learned multi-head, no biases", "rotary grouped-query"])
def test_llama_cpp_loads_the_gguf_file_and_gives_kvgpt_greedy_text_and_tokens(tmp_path, design):
    import llama_cpp

    model = checkpoint(tmp_path, design)
    export(tmp_path, tmp_path / "gguf", "gguf")
    llm = llama_cpp.Llama(str(tmp_path / "gguf" / "model.gguf"), n_ctx=BLOCK_SIZE, logits_all=True, verbose=False)
    for char in VOCAB.chars:  # llama.cpp's own tokenizer, both ways, space and newline included
        assert llm.tokenize(char.encode(), add_bos=False, special=False) == VOCAB.encode(char), repr(char)
        assert llm.detokenize(VOCAB.encode(char)) == char.encode(), repr(char)
    newlines = 0
    for prompt in PROMPTS:
        n = BLOCK_SIZE - len(prompt)
        assert llm.tokenize(prompt.encode(), add_bos=False, special=False) == VOCAB.encode(prompt)
        want = kvgpt_greedy(model, prompt, n)
        newlines += "\n" in want[len(prompt):]
        llm.reset()
        # llama.cpp's own loop at its defaults, as llama-completion's: an end-of-text token would end the text
        out = llm.create_completion(prompt, max_tokens=n, temperature=0)["choices"][0]
        assert (prompt + out["text"], out["finish_reason"]) == (want, "length"), (design, prompt)
        ids = VOCAB.encode(want)
        llm.reset()
        llm.eval(ids[:-1])
        with torch.no_grad():  # close, not equal: llama.cpp's tanh GELU and float16 cache (docs/export.md)
            logits = model(torch.tensor([ids[:-1]]))[0][0].numpy()
        assert abs(llm.scores[:len(ids) - 1] - logits).max() < 1e-2
    assert newlines  # the newline, the transformers folder's eos, is in the text and ends nothing
    del llm
    shutil.rmtree(tmp_path / "gguf")


def ggml_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU as ggml computes it on the CPU: the tanh approximation, read from a float16 table at x in float16."""
    h = x.half().float()
    y = (0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * h * (1 + 0.044715 * h * h)))).half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


@pytest.mark.skipif(missing("llama_cpp"),
                    reason="llama.cpp's Python binding is not installed: pip install llama-cpp-python (docs/export.md)")
@pytest.mark.parametrize("design", ["learned multi-head", "learned multi-head, no biases", "rotary grouped-query"])
def test_llama_cpp_with_a_float32_cache_differs_from_kvgpt_by_its_gelu_alone(tmp_path, design, monkeypatch):
    """With its cache in float32, llama.cpp's logits and greedy text are those of kvgpt's model with ggml's GELU:
    every weight, position and attention in the file is kvgpt's, and the GELU is all that is not."""
    import llama_cpp

    model = checkpoint(tmp_path, design)
    export(tmp_path, tmp_path / "gguf", "gguf")
    llm = llama_cpp.Llama(str(tmp_path / "gguf" / "model.gguf"), n_ctx=BLOCK_SIZE, logits_all=True, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    ids = VOCAB.encode("ab ba\nhij  ajb\n" * 3)[:BLOCK_SIZE]
    llm.eval(ids)
    with torch.no_grad():
        kvgpt_own = model(torch.tensor([ids]))[0][0].numpy()
        monkeypatch.setattr(torch.nn.functional, "gelu", ggml_gelu)
        with_ggml_gelu = model(torch.tensor([ids]))[0][0].numpy()
    assert abs(llm.scores[:len(ids)] - with_ggml_gelu).max() < 1e-4
    assert abs(llm.scores[:len(ids)] - kvgpt_own).max() > 1e-4  # the GELU alone moves them by more
    for prompt in PROMPTS:  # its greedy text is that of kvgpt's model with ggml's GELU, still patched in
        llm.reset()
        out = llm.create_completion(prompt, max_tokens=BLOCK_SIZE - len(prompt), temperature=0)["choices"][0]
        assert prompt + out["text"] == kvgpt_greedy(model, prompt, BLOCK_SIZE - len(prompt)), (design, prompt)
    del llm
    shutil.rmtree(tmp_path / "gguf")


VLLM = os.environ.get("KVGPT_VLLM_PYTHON", "")
# vLLM's CPU attention takes heads of 32 channels or more: design -> (GPTConfig fields, seed, prompt, new tokens)
VLLM_DESIGNS = {"learned multi-head": ({"n_embd": 64, "n_head": 2}, 1, "ab ba\n", 32 - 6),
                "rotary grouped-query": ({"n_embd": 128, "n_head": 4, "n_kv_head": 2, "pos_emb": "rope"}, 8, "a", 200)}
VLLM_RUN = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":  # vLLM starts its engine in processes of its own
    folder, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llm = LLM(model=folder, dtype="float32")
    out = {}
    for name, extra in (("default", {}), ("told", {"ignore_eos": True, "skip_special_tokens": False})):
        o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, **extra))[0].outputs[0]
        out[name] = [prompt + o.text, o.finish_reason]
    import vllm
    print("KVGPT " + json.dumps({"version": vllm.__version__, **out}))
"""


@pytest.mark.skipif(not os.access(VLLM, os.X_OK), reason="vLLM is not set up: set KVGPT_VLLM_PYTHON to the python "
                    "of a virtual environment where vLLM is installed (docs/export.md)")
@pytest.mark.parametrize("design", VLLM_DESIGNS)
def test_vllm_gives_kvgpt_greedy_text_past_block_size_where_the_design_rolls(tmp_path, design):
    """At its defaults, as told to ignore eos, vLLM's greedy text is kvgpt's, newlines included: for learned
    positions up to block_size, for rotary grouped queries far past it."""
    fields, seed, prompt, n = VLLM_DESIGNS[design]
    model = random_model(seed, block_size=32, **fields)
    save_checkpoint(build_checkpoint(model, VOCAB, text=trained_on(VOCAB, RAREST)), tmp_path / "best.pt")
    folder = export(tmp_path, tmp_path / "hf")
    (tmp_path / "run.py").write_text(VLLM_RUN)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    done = subprocess.run([VLLM, str(tmp_path / "run.py"), str(folder), prompt, str(n)], capture_output=True,
                          text=True, timeout=900, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("KVGPT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    got = json.loads(lines[-1][len("KVGPT "):])
    want = kvgpt_greedy(model, prompt, n)
    assert len(want) - len(prompt) == n and (n > 32) == (design == "rotary grouped-query")
    assert "\n" in want[len(prompt):] and RAREST not in want[len(prompt):]  # newlines, and nothing named eos
    assert got["default"] == got["told"] == [want, "length"], got
