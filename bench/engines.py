"""Each engine that runs kvgpt's exports, in one run on the same machine: does it load, is its greedy text
kvgpt's, and how fast is it at batch 1, beside sample.py.

    python bench/engines.py --design gpt2
    python bench/engines.py --design starcoder2 --vllm-python ~/vllm-venv/bin/python

A random model of the classic shape, its weights drawn wide so that its text depends on its context, is saved as a
checkpoint and exported by export.py to each format. Every engine decodes the same prompt greedily, batch 1:
NEW_TOKENS new characters with learned positions (up to block_size), twice as many with rotary grouped queries
(past block_size, where kvgpt's window rolls). An engine's text is compared with kvgpt's own greedy text.
sample.py runs as the real command, at fp32; its tokens/s is its own summary line's. Other engines are timed
around their own generate call, after loading and one warm-up, the best of --repeats. Each runs with the setting
docs/export.md names for kvgpt's text, shown in the table. An engine that is not installed is listed as such.
vLLM runs from the python that --vllm-python or KVGPT_VLLM_PYTHON names, in a process of its own."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import REPO, host, model_config, run_tool  # noqa: E402
from bench.decode import NEW_TOKENS  # noqa: E402
from bench.sample_speed import PROMPT, SUMMARY, VOCAB  # noqa: E402
from model import GREEDY, build_model, generate  # noqa: E402
from runtime.checkpoint import build_checkpoint, save_checkpoint  # noqa: E402
from runtime.errors import OneLineErrorParser, UsageError, one_line, positive_int  # noqa: E402

DESIGNS = {"gpt2": {}, "starcoder2": {"pos_emb": "rope", "n_kv_head": 2}}  # the classic shape's fields changed
VLLM_TIMED = """
import json, sys, time
if __name__ == "__main__":  # vLLM starts its engine in processes of its own
    folder, prompt, n, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    try:
        import vllm
        llm = vllm.LLM(model=folder, dtype="float32")
    except Exception as e:
        print("KVGPT " + json.dumps({"error": f"{type(e).__name__}: {e}"}))
        sys.exit()
    params = vllm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, skip_special_tokens=False)
    seconds = []
    for _ in range(repeats + 1):  # the first one warms up
        start = time.perf_counter()
        text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
        seconds.append(time.perf_counter() - start)
    print("KVGPT " + json.dumps({"version": vllm.__version__, "text": prompt + text, "seconds": min(seconds[1:])}))
"""


def timed(run, repeats: int) -> tuple[str, float]:
    """(run's text, its best seconds): one warm-up call, then repeats timed ones."""
    text = run()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        text = run()
        seconds.append(time.perf_counter() - start)
    return text, min(seconds)


def export(checkpoint: Path, out: Path, fmt: str) -> Path:
    done = subprocess.run([sys.executable, str(REPO / "export.py"), "--checkpoint", str(checkpoint), str(out),
                           "--format", fmt], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip())
    return out


def sample_py(checkpoint: Path, n: int, repeats: int) -> tuple[str, str, float]:
    """(torch's version, sample.py's text, its best tokens/s from its summary line)."""
    command = [sys.executable, str(REPO / "sample.py"), "--checkpoint", str(checkpoint), "--prompt", PROMPT,
               "--temperature", "0", "--max-new-tokens", str(n), "--device", "cpu", "--precision", "fp32"]
    best, text = 0.0, ""
    for _ in range(repeats):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip())
        text, best = done.stdout.removesuffix("\n"), max(best, float(SUMMARY.search(done.stderr).group(1)))
    return torch.__version__, text, best


def transformers_engine(folders: dict, n: int, repeats: int):
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(folders["hf"])
    model = transformers.AutoModelForCausalLM.from_pretrained(folders["hf"]).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        run = lambda: tokenizer.decode(model.generate(ids, do_sample=False, max_new_tokens=n)[0])  # noqa: E731
        return (transformers.__version__, "generate(do_sample=False)", *timed(run, repeats))


def onnxruntime_engine(folders: dict, n: int, repeats: int, block_size: int):
    import onnxruntime
    session = onnxruntime.InferenceSession(str(folders["onnx"] / "model.onnx"))
    pasts = session.get_inputs()[2:]

    def run() -> str:  # docs/export.md's loop: the cache fed back, kept to block_size - 1
        past = {p.name: np.zeros((1, p.shape[1], 0, p.shape[3]), np.float32) for p in pasts}
        ids = VOCAB.encode(PROMPT)
        feed, position = ids, 0
        for _ in range(n):
            out = session.run(None, {"input_ids": np.array([feed]),
                                     "position_ids": np.arange(position, position + len(feed))[None], **past})
            position += len(feed)
            past = {p.name: present[:, :, -(block_size - 1):] for p, present in zip(pasts, out[1:])}
            feed = [int(out[0][0, -1].argmax())]
            ids = ids + feed
        return VOCAB.decode(ids)
    return (onnxruntime.__version__, "docs/export.md's loop", *timed(run, repeats))


def ctranslate2_engine(folders: dict, n: int, repeats: int):
    import ctranslate2
    from ctranslate2.converters import TransformersConverter
    out = folders["hf"].parent / "ct2"
    TransformersConverter(str(folders["hf"])).convert(str(out))
    generator = ctranslate2.Generator(str(out))

    def run() -> str:  # max_length counts every token but the prompt's first
        result = generator.generate_batch([list(PROMPT)], max_length=len(PROMPT) - 1 + n, sampling_topk=1,
                                          end_token=[])
        return "".join(result[0].sequences[0])
    return (ctranslate2.__version__, "end_token=[]", *timed(run, repeats))


def llama_cpp_engine(folders: dict, n: int, repeats: int, float32_cache: bool = False):
    import llama_cpp
    cache = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if float32_cache else {}
    llm = llama_cpp.Llama(str(folders["gguf"] / "model.gguf"), n_ctx=len(PROMPT) + n, verbose=False, **cache)
    run = lambda: PROMPT + llm.create_completion(PROMPT, max_tokens=n, temperature=0)["choices"][0]["text"]  # noqa
    setting = "create_completion(temperature=0)" + (", type_k and type_v f32" if float32_cache else "")
    return (llama_cpp.__version__, setting, *timed(run, repeats))


def vllm_engine(folders: dict, n: int, repeats: int, python: str):
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    script = folders["hf"].parent / "vllm_timed.py"
    script.write_text(VLLM_TIMED)
    done = subprocess.run([python, str(script), str(folders["hf"]), PROMPT, str(n), str(repeats)],
                          capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("KVGPT ")]
    if not lines:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output")
    got = json.loads(lines[-1][len("KVGPT "):])
    if "error" in got:
        raise RuntimeError(got["error"])
    return got["version"], "ignore_eos=True, skip_special_tokens=False", got["text"], got["seconds"]


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def compared(text: str, want: str, block_size: int) -> str:
    if text == want:
        return "yes" + (", past block_size" if len(want) > block_size else "")
    at = next((i for i, (a, b) in enumerate(zip(text, want)) if a != b), min(len(text), len(want)))
    return f"no: differs from character {at} on (block_size {block_size})"


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--design", choices=DESIGNS, default="gpt2")
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--vllm-python", default=os.environ.get("KVGPT_VLLM_PYTHON", ""),
                        help="the python of a virtual environment where vLLM is installed")
    args = parser.parse_args()
    if args.vllm_python and not os.access(args.vllm_python, os.X_OK):
        raise UsageError(f"--vllm-python {args.vllm_python} is not a program; name the python of vLLM's environment")

    torch.manual_seed(0)
    config = model_config("classic", vocab_size=len(VOCAB))
    model = build_model(dataclasses.replace(config, **DESIGNS[args.design], dropout=0.0))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.eval()
    block_size = model.config.block_size
    n = NEW_TOKENS if args.design == "gpt2" else 2 * NEW_TOKENS
    want = VOCAB.decode(generate(model, torch.tensor([VOCAB.encode(PROMPT)]), n, sampling=GREEDY)[0].tolist())

    engines = {"transformers": ("transformers", "hf", transformers_engine),
               "onnxruntime": ("onnxruntime", "onnx",
                               lambda f, n, r: onnxruntime_engine(f, n, r, block_size)),
               "CTranslate2": ("ctranslate2", "hf", ctranslate2_engine),
               "llama.cpp (llama-cpp-python)": ("llama_cpp", "gguf", llama_cpp_engine),
               "llama.cpp, float32 cache": ("llama_cpp", "gguf", lambda f, n, r: llama_cpp_engine(f, n, r, True)),
               "vLLM": (None, "hf", lambda f, n, r: vllm_engine(f, n, r, args.vllm_python))}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_checkpoint(build_checkpoint(model, VOCAB), Path(tmp) / "best.pt")
        version, text, rate = sample_py(checkpoint, n, args.repeats)
        rows.append(("sample.py (kvgpt)", f"torch {version}", "yes", "--temperature 0",
                     compared(text, want, block_size), f"{rate:.1f}"))
        folders = {}
        for fmt in ("hf", "onnx", "gguf"):
            try:
                folders[fmt] = export(checkpoint, Path(tmp) / fmt, fmt)
            except RuntimeError as e:
                folders[fmt] = e
        for name, (module, fmt, engine) in engines.items():
            if (module and not installed(module)) or (module is None and not args.vllm_python):
                absent = "not installed" if module else "not installed: no --vllm-python or KVGPT_VLLM_PYTHON"
                rows.append((name, absent, "", "", "", ""))
                continue
            if isinstance(folders[fmt], Exception):
                rows.append((name, "", f"no: export.py --format {fmt}: {one_line(folders[fmt])}", "", "", ""))
                continue
            try:
                version, setting, text, seconds = engine(folders, n, args.repeats)
            except Exception as e:  # an engine that cannot load or run this design: its error is the finding
                rows.append((name, "", f"no: {textwrap.shorten(one_line(e), 120)}", "", "", ""))
                continue
            rows.append((name, version, "yes", setting, compared(text, want, block_size), f"{n / seconds:.1f}"))

    print(f"# engines: {host()}, {date.today()}, torch {torch.get_num_threads()} threads, classic shape as "
          f"{args.design}, block_size {block_size}, prompt {len(PROMPT)}, {n} new, greedy, batch 1, "
          f"best of {args.repeats}")
    print("| engine | version | loads | setting | kvgpt's greedy text | tok/s |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    run_tool(main)
