"""Decode speed of the one-token step's three paths, against the weight-matmul bound, in one run.

    python bench/step_paths.py                      # the cpu preset's shape and the classic one, fp32
    python bench/step_paths.py --shape small --repeats 5

- eager: model.decode_step as written (model/gpt.py);
- torch.compile: generate(..., compile=True), which checks its guards and runs a Python wrapper at each call;
- ahead of time: the step exported and built by AOTInductor (model/decoding/aot_step.py), loaded from
  runtime/compiled.py's folder or compiled into it first (its compile time is printed).
Greedy, random weights, a 16-token prompt and 240 new tokens, batch 1 and 8; the bound is bench/decode.py's.
Each repeat times every path in turn, so that the ratios compare paths under the same load: "x eager" is the
median of the repeats' ratios. Median (min-max) of --repeats.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import MODEL_SHAPES, host, model_config, run_tool  # noqa: E402
from bench.decode import NEW_TOKENS, PROMPT_LEN, fmt, matmul_bound  # noqa: E402
from model import GREEDY, build_model, generate  # noqa: E402
from sampling.compiled_step import load_or_compile_step  # noqa: E402
from runtime.errors import OneLineErrorParser, positive_int  # noqa: E402
from model.caches.factory import new_kv_cache

PATHS = ("eager", "torch.compile", "ahead of time")


def runners(model, batch_size: int) -> dict:
    """Each path's generation of NEW_TOKENS tokens, warmed up (compiled) once."""
    prompt = torch.randint(0, model.config.vocab_size, (batch_size, PROMPT_LEN))
    cache = new_kv_cache(model, batch_size)
    start = time.perf_counter()
    step = load_or_compile_step(model, cache)
    print(f"  ahead of time, batch {batch_size}: loaded or compiled in {time.perf_counter() - start:.1f} s",
          flush=True)
    run = {"eager": lambda: generate(model, prompt, NEW_TOKENS, sampling=GREEDY),
           "torch.compile": lambda: generate(model, prompt, NEW_TOKENS, sampling=GREEDY, compile=True),
           "ahead of time": lambda: generate(model, prompt, NEW_TOKENS, sampling=GREEDY, cache=cache, step=step)}
    texts = {path: fn() for path, fn in run.items()}  # the warm-up, and the proof that each path gives one text
    if not all(torch.equal(text, texts["eager"]) for text in texts.values()):
        raise SystemExit("the paths' greedy texts differ: a step is wrong")
    return run


def interleaved(model, run: dict, batch_size: int, repeats: int) -> dict:
    """tokens/s of each path per repeat, and at batch 1 the bound's in the same repeat."""
    rates = {path: [] for path in [*run, "bound"]}
    for _ in range(repeats):
        for path, fn in run.items():
            start = time.perf_counter()
            fn()
            rates[path].append(batch_size * NEW_TOKENS / (time.perf_counter() - start))
        if batch_size == 1:
            rates["bound"].append(matmul_bound(model, 1, 1, lambda: None)[0])
    return rates


def summary(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=MODEL_SHAPES, action="append",
                        help="a model shape from conf/model/ (repeatable; default: small and classic)")
    parser.add_argument("--repeats", type=positive_int, default=5)
    args = parser.parse_args()
    print(f"# step paths: {host()}, torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, prompt "
          f"{PROMPT_LEN}, {NEW_TOKENS} new, greedy, median (min-max) of {args.repeats}", flush=True)
    for shape in args.shape or ["small", "classic"]:
        torch.manual_seed(0)
        model = build_model(model_config(shape)).eval()
        print(f"\n## {shape}: {model.num_params() / 1e6:.1f}M parameters", flush=True)
        rows, bound = {path: {} for path in PATHS}, None
        for batch_size in (1, 8):
            rates = interleaved(model, runners(model, batch_size), batch_size, args.repeats)
            for path in PATHS:
                ratios = [r / e for r, e in zip(rates[path], rates["eager"])]
                of_bound = [r / b for r, b in zip(rates[path], rates["bound"])]
                rows[path][batch_size] = (summary(rates[path]), statistics.median(ratios),
                                          statistics.median(of_bound) if of_bound else None)
            bound = bound or summary(rates["bound"])
        print("| path | tok/s, batch 1 | x eager | / bound | tok/s, batch 8 | x eager |")
        print("|---|---|---|---|---|---|")
        for path, row in rows.items():
            (b1, x1, of1), (b8, x8, _) = row[1], row[8]
            print(f"| {path} | {fmt(b1)} | {x1:.2f} | {of1:.2f} | {fmt(b8)} | {x8:.2f} |")
        print(f"weight-matmul bound, batch 1: {fmt(bound)} tok/s (\"/ bound\": the median of each repeat's ratio)",
              flush=True)


if __name__ == "__main__":
    run_tool(main)
