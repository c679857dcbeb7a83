"""Each engine that runs kvgpt's exports, in one run on the same machine: does it load, is its greedy text
kvgpt's, and how fast is it at batch 1, beside sample.py, or at a larger batch.

    python bench/engines.py --design gpt2
    python bench/engines.py --design starcoder2 --vllm-python ~/vllm-venv/bin/python
    python bench/engines.py --checkpoint runs/my-run --prompts 200
    python bench/engines.py --checkpoint runs/my-run --batch 64

By default a random model of the classic shape, its weights drawn wide so that its text depends on its context,
is saved as a checkpoint; --checkpoint names a trained one instead. export.py exports it to each format. Every
engine decodes each prompt greedily, batch 1: up to block_size characters, twice as many where the export rolls
past block_size as kvgpt's window does (rotary grouped queries). An engine's texts are compared with kvgpt's own
greedy texts. The first prompt is PROMPT; --prompts N adds N - 1 slices of the validation text (the
checkpoint's own, else tiny_shakespeare), so that one near-tie does not decide the verdict.
sample.py runs as the real command, at fp32, on the first prompt, eagerly and through its packed compiled step
(compiled before the first timed run); its tokens/s is its own summary line's, in a new process each time.
kvgpt's generate through that packed step and the other engines are timed on the first prompt around their own
generate call, after loading and one warm-up, the best of --repeats. --batch B decodes B slices of the validation
text, each as long as PROMPT, in one call instead, and times that call; sample.py, which decodes one prompt, sits
out. Each runs with
the setting docs/export.md names for kvgpt's text, shown in the table, at every thread count from 1 to the cores'
count; its row is its fastest, and says which. MBU is bench/roofline.py's. An engine that is not installed is
listed as such. vLLM runs from the python that --vllm-python or KVGPT_VLLM_PYTHON
names, in a process of its own."""

import dataclasses
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import REPO, check_program, host, model_config, run_tool, shakespeare  # noqa: E402
from bench.roofline import model_bytes, read_bandwidth  # noqa: E402
from bench.sample_speed import PROMPT, SUMMARY, VOCAB  # noqa: E402
from model import GREEDY, build_model, generate  # noqa: E402
from runtime.checkpoint import (build_checkpoint, existing_checkpoint, load_model, save_checkpoint,  # noqa: E402
                                training_text)
from runtime.errors import OneLineErrorParser, UsageError, one_line, positive_int  # noqa: E402
from runtime.hf import GGUF_FILE, ONNX_FILE, rolls  # noqa: E402

DESIGNS = {"gpt2": {}, "starcoder2": {"pos_emb": "rope", "n_kv_head": 2}}  # the classic shape's fields changed
MAX_PROMPT = 32  # the validation slices' longest


def export(checkpoint: Path, out: Path, fmt: str) -> Path:
    done = subprocess.run([sys.executable, str(REPO / "export.py"), "--checkpoint", str(checkpoint), str(out),
                           "--format", fmt], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip())
    return out


def sample_py(checkpoint: Path, prompt: str, n: int, repeats: int, threads: int, compile: bool,
              steps: Path) -> tuple[str, str, float]:
    """(torch's version, sample.py's text, its best tokens/s from its summary line), decoding eagerly or through
    the packed compiled step, kept in `steps` (compiled in the first run, whose summary times decoding alone)."""
    command = [sys.executable, str(REPO / "sample.py"), "--checkpoint", str(checkpoint), "--prompt", prompt,
               "--temperature", "0", "--max-new-tokens", str(n), "--device", "cpu", "--precision", "fp32",
               "--threads", str(threads), "--compile" if compile else "--no-compile"]
    best, text = 0.0, ""
    for _ in range(repeats):
        done = subprocess.run(command, capture_output=True, text=True,
                              env={**os.environ, "KVGPT_CACHE_DIR": str(steps)})
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip())
        text, best = done.stdout.removesuffix("\n"), max(best, float(SUMMARY.search(done.stderr).group(1)))
    return torch.__version__, text, best


def run_engine(python: str, runner: str, spec: dict) -> tuple[str, str, list[str], float]:
    """(version, setting, texts, best seconds) from bench/engine_runners.py run as a process of its own."""
    done = subprocess.run([python, str(REPO / "bench" / "engine_runners.py"), runner, json.dumps(spec)],
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("KVGPT ")]
    if not lines:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output")
    got = json.loads(lines[-1][len("KVGPT "):])
    if "error" in got:
        raise RuntimeError(got["error"])
    return got["version"], got["setting"], got["texts"], got["seconds"]


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def compared(texts: list[str], wants: list[str], block_size: int) -> str:
    """"yes" when every text is kvgpt's, else where the first prompt's text differs, or how many are equal."""
    past = ", past block_size" if len(wants[0]) > block_size else ""
    if len(wants) > 1:
        return f"{sum(t == w for t, w in zip(texts, wants))} of {len(wants)} equal{past}"
    if texts[0] == wants[0]:
        return "yes" + past
    at = next((i for i, (a, b) in enumerate(zip(texts[0], wants[0])) if a != b), min(len(texts[0]), len(wants[0])))
    return f"no: differs from character {at} on (block_size {block_size})"


def the_model(args) -> tuple:
    """(model, vocab, a function that prepares its validation text as ids, what it is): the checkpoint's model, or a
    random classic one. The text is prepared only where prompts are drawn from it."""
    if args.checkpoint:
        model, vocab, contents = load_model(args.checkpoint)
        return model, vocab, (lambda: training_text(contents).val), f"{args.checkpoint}'s model"
    torch.manual_seed(0)
    config = model_config("classic", vocab_size=len(VOCAB))
    model = build_model(dataclasses.replace(config, **DESIGNS[args.design], dropout=0.0))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return model.eval(), VOCAB, (lambda: shakespeare().val), f"classic shape as {args.design}"


def the_prompts(vocab, val, count: int) -> list[str]:
    """PROMPT (or the validation text's first characters, where the vocabulary lacks one of it), then count - 1
    slices of the validation text, 1 to MAX_PROMPT characters long, at seeded places."""
    covered = set(PROMPT) <= set(vocab.chars)
    if covered and count == 1:
        return [PROMPT]
    ids, rng = val(), random.Random(0)
    prompts = [PROMPT if covered else vocab.decode(ids[:len(PROMPT)].tolist())]
    for _ in range(count - 1):
        start = rng.randrange(len(ids) - MAX_PROMPT)
        prompts.append(vocab.decode(ids[start:start + rng.randint(1, MAX_PROMPT)].tolist()))
    return prompts


def batch_prompts(vocab, val, count: int) -> list[str]:
    """count slices of the validation text at seeded places, each as long as PROMPT: a batch with no padding."""
    ids, rng = val(), random.Random(0)
    return [vocab.decode(ids[start:start + len(PROMPT)].tolist())
            for start in (rng.randrange(len(ids) - len(PROMPT)) for _ in range(count))]


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--design", choices=DESIGNS, help="the random model's design (default gpt2)")
    parser.add_argument("--checkpoint", type=existing_checkpoint,
                        help="a trained checkpoint (file or run folder) in place of a random model")
    parser.add_argument("--prompts", type=positive_int, help="prompts each engine decodes one at a time (default 1)")
    parser.add_argument("--batch", type=positive_int, default=1,
                        help="prompts each engine decodes at once, in one call (default 1)")
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--vllm-python", default=os.environ.get("KVGPT_VLLM_PYTHON", ""),
                        help="the python of a virtual environment where vLLM is installed")
    args = parser.parse_args()
    if args.vllm_python:
        named = any(a.partition("=")[0] == "--vllm-python" for a in sys.argv[1:])
        check_program("--vllm-python" if named else "KVGPT_VLLM_PYTHON", args.vllm_python)
    if args.checkpoint and args.design:
        raise UsageError("--design chooses the random model's design; a --checkpoint has its own: give one of them")
    args.design = args.design or "gpt2"
    if args.batch > 1 and args.prompts:
        raise UsageError("--batch decodes its own prompts at once, and --prompts that many one at a time: give one of "
                         "them")

    model, vocab, val, what = the_model(args)
    block_size = model.config.block_size
    length = 2 * block_size if rolls(model.config) else block_size  # each text's, prompt included
    if args.batch == 1:  # each prompt a job of its own
        prompts = the_prompts(vocab, val, args.prompts or 1)
        jobs = [([prompt], length - len(prompt)) for prompt in prompts]
    else:  # one job of every prompt, all of PROMPT's length
        prompts = batch_prompts(vocab, val, args.batch)
        jobs = [(prompts, length - len(PROMPT))]
    wants = [vocab.decode(generate(model, torch.tensor([vocab.encode(prompt)]), n, sampling=GREEDY)[0].tolist())
             for batch, n in jobs for prompt in batch]
    tokens = len(jobs[0][0]) * jobs[0][1]  # the timed job's new tokens

    # name -> (the module it needs here, or None for vLLM's own python; the export it reads; its runner)
    engines = {"transformers": ("transformers", "hf", "transformers"),
               "onnxruntime": ("onnxruntime", "onnx", "onnxruntime"),
               "CTranslate2": ("ctranslate2", "hf", "ctranslate2"),
               "llama.cpp (llama-cpp-python)": ("llama_cpp", "gguf", "llama.cpp"),
               "llama.cpp, float32 cache": ("llama_cpp", "gguf", "llama.cpp-f32"),
               "vLLM": (None, "hf", "vllm")}
    rows = []
    thread_counts = range(1, (os.cpu_count() or 1) + 1)
    context = (len(prompts[0]) + length) // 2  # a token's context, on average over the first prompt's text
    weights = model_bytes(model, 0)
    nbytes = weights + args.batch * (model_bytes(model, context) - weights)  # a step reads each row's cache
    bandwidth = {threads: read_bandwidth(nbytes, threads) for threads in thread_counts}

    def row(name, version, setting, texts, rates: dict) -> tuple:
        """The engine's row at its fastest thread count, with its MBU there; texts: of the first prompts."""
        threads = max(rates, key=rates.get)
        return (name, version, "yes", f"{setting}, {threads} thread{'s' * (threads > 1)}",
                compared(texts, wants[:len(texts)], block_size), f"{rates[threads]:,.0f}",
                f"{rates[threads] / args.batch * nbytes / bandwidth[threads]:.0%}")

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, steps = save_checkpoint(build_checkpoint(model, vocab), Path(tmp) / "best.pt"), Path(tmp) / "steps"
        for compile in (False, True) if args.batch == 1 else ():
            runs = {threads: sample_py(checkpoint, prompts[0], jobs[0][1], args.repeats, threads, compile, steps)
                    for threads in thread_counts}
            version, text, _ = runs[1]
            rows.append(row("sample.py (kvgpt)" + (", packed compiled step" if compile else ""), f"torch {version}",
                            "--temperature 0" + (" --compile" if compile else ""), [text],
                            {threads: rate for threads, (_, _, rate) in runs.items()}))
        spec = {"checkpoint": str(checkpoint), "steps": str(steps), "jobs": jobs, "repeats": args.repeats,
                "chars": vocab.chars, "block_size": block_size}
        runs = {threads: run_engine(sys.executable, "kvgpt", {**spec, "threads": threads}) for threads in thread_counts}
        version, setting, texts, _ = runs[1]
        rows.append(row("kvgpt's generate, in process", f"torch {version}", setting, texts,
                        {threads: tokens / seconds for threads, (_, _, _, seconds) in runs.items()}))
        folders = {}
        for fmt in ("hf", "onnx", "gguf"):
            try:
                folders[fmt] = export(checkpoint, Path(tmp) / fmt, fmt)
            except RuntimeError as e:
                folders[fmt] = e
        files = {"hf": "", "onnx": ONNX_FILE, "gguf": GGUF_FILE}  # what each runner opens: a folder or a file in it
        spec.update({fmt: str(folder / files[fmt]) for fmt, folder in folders.items() if isinstance(folder, Path)})
        for name, (module, fmt, runner) in engines.items():
            if (module and not installed(module)) or (module is None and not args.vllm_python):
                absent = "not installed" if module else "not installed: no --vllm-python or KVGPT_VLLM_PYTHON"
                rows.append((name, absent, "", "", "", "", ""))
                continue
            if isinstance(folders[fmt], Exception):
                rows.append((name, "", f"no: export.py --format {fmt}: {one_line(folders[fmt])}", "", "", "", ""))
                continue
            try:
                runs = {threads: run_engine(sys.executable if module else args.vllm_python, runner,
                                            {**spec, "threads": threads}) for threads in thread_counts}
            except RuntimeError as e:  # an engine that cannot load or run this design: its error is the finding
                rows.append((name, "", f"no: {textwrap.shorten(one_line(e), 120)}", "", "", "", ""))
                continue
            version, setting, texts, _ = runs[1]
            rows.append(row(name, version, setting, texts,
                            {threads: tokens / seconds for threads, (_, _, _, seconds) in runs.items()}))

    timed = f"the first prompt ({len(prompts[0])} characters)" if args.batch == 1 else "all of them at once"
    print(f"# engines: {host()}, {date.today()}, {what}, block_size {block_size}, {len(prompts)} prompt(s), each text "
          f"{length} characters, greedy, batch {args.batch}; tok/s on {timed}, best of {args.repeats}, at the thread "
          f"count where each is fastest (of {', '.join(map(str, thread_counts))}; no binding); MBU: steps/s x "
          f"{nbytes / 2**20:.2f} MiB a step reads (bench/roofline.py) / the read bandwidth at that thread count "
          f"({', '.join(f'{b / 1e9:.0f}' for b in bandwidth.values())} GB/s)")
    print("| engine | version | loads | setting | kvgpt's greedy text | tok/s | MBU |")
    print("|---|---|---|---|---|---|---|")
    for line in rows:
        print("| " + " | ".join(line) + " |")


if __name__ == "__main__":
    run_tool(main)
