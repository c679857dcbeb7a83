"""Decoding speed on a GPU, every path in one process: the same shape, random weights, greedy, a 6-token prompt.

    python bench/gpu_decode.py                       # the classic shape on CUDA, batches 1 and 64, 250 new tokens
    python bench/gpu_decode.py --device cpu --shape small --new-tokens 40   # a rehearsal of the script on a CPU

Paths, each timed at each batch: kvgpt's eager cached step; its step captured by hand as a CUDA graph
(model/decoding/cuda_graph.py) and, to choose between the two, compiled by torch.compile(mode="reduce-overhead"),
which captures graphs of its own (cuda only); the engine, its steps padded to a batch bucket and captured; no cache
(a full forward over the context at every step: the loop nanoGPT's generate runs); and, where transformers is
installed, Hugging Face's GPT-2 of the same shape with its own cache, eagerly and with a static cache and a
compiled forward. fp32, and kvgpt's paths in bf16 and int8 weights too (int8 on CUDA both through torch's fused
int8 matmul, where the build has one, and dequantized). Each figure is the median (min-max) of --repeats runs
after a warm-up, which includes compiling and capturing: neither is counted in tokens/s. The greedy texts of
kvgpt's fp32 paths are compared, token for token. Last, a profile of the uncached step in each precision says
where its time goes.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import MODEL_SHAPES, host, model_config, run_tool  # noqa: E402
from bench.decode import rates, timings  # noqa: E402
import model.decoding.quantize as quantize  # noqa: E402
from model import GREEDY, build_model, generate, new_kv_cache  # noqa: E402
from model.decoding.cuda_graph import CapturedStep  # noqa: E402
from model.serving.engine import Engine  # noqa: E402
from runtime.errors import OneLineErrorParser, positive_int  # noqa: E402

SHORT_PROMPT = 6  # tokens of prompt: a short one, so that the new tokens decide the speed


class ReduceOverheadStep:
    """The one-token step compiled by torch.compile(mode="reduce-overhead"), as generate takes a step: the way to
    capture that CapturedStep is measured against."""

    def __init__(self, model, cache):
        self.cache, self.tokens = cache, 1
        self.run = torch.compile(model.decode_step, mode="reduce-overhead", fullgraph=True)

    def fits(self, cache, tokens: int = 1) -> bool:
        return cache is self.cache and tokens == 1

    def decode_step(self, idx, cache):
        return self.run(idx.clone(), cache)


def kvgpt_paths(model, prompt, new_tokens: int, device) -> dict:
    """name -> a function that decodes greedily and returns the ids, for kvgpt's paths."""
    cache = new_kv_cache(model, prompt.size(0))
    paths = {"kvgpt, KV cache, eager": lambda: generate(model, prompt, new_tokens, sampling=GREEDY, cache=cache),
             "kvgpt, no cache": lambda: generate(model, prompt, new_tokens, sampling=GREEDY, use_cache=False)}
    if device.type == "cuda":
        paths["kvgpt, KV cache, CUDA graph"] = through_step(model, prompt, new_tokens, CapturedStep)
        paths["kvgpt, KV cache, reduce-overhead"] = through_step(model, prompt, new_tokens, ReduceOverheadStep)
        paths["kvgpt, engine, a CUDA graph per bucket"] = lambda: engine_decode(model, prompt, new_tokens)
    return paths


def through_step(model, prompt, new_tokens: int, make):
    """Greedy decoding through the step that make(model, cache) builds over a cache of its own, at the first
    call: the warm-up, which is not timed."""
    cache, made = new_kv_cache(model, prompt.size(0)), []

    def decode():
        made.append(made[0] if made else make(model, cache))
        return generate(model, prompt, new_tokens, sampling=GREEDY, cache=cache, step=made[0])
    return decode


def engine_decode(model, prompt, new_tokens: int) -> torch.Tensor:
    """Every row of prompt a request of the engine at once, its steps padded to a bucket and captured."""
    B, T = prompt.shape
    tokens = T + new_tokens
    engine = Engine(model, n_blocks=B * -(-tokens // 16), block_tokens=16, max_batch=B, chunk=T)
    requests = [engine.add(b, row, new_tokens) for b, row in enumerate(prompt.tolist())]
    for _ in engine.run():
        pass
    return torch.tensor([r.tokens for r in requests], device=prompt.device)


def capped_timings(decode, repeats: int, sync, cap_s: float) -> list[float]:
    """Seconds of up to `repeats` runs after a warm-up: fewer where one more would take the runs past cap_s."""
    times = timings(decode, 1, sync)
    while len(times) < repeats and sum(times) * (len(times) + 1) / len(times) <= cap_s:
        times += timings(decode, 1, sync, warm_up=lambda: None)
    return times


def profile_uncached(config, device, new_tokens: int = 20) -> None:
    """The uncached decoding's busiest operators in each precision, at batch 1: where its time goes."""
    from torch.profiler import ProfilerActivity, profile
    prompt = torch.zeros(1, SHORT_PROMPT, dtype=torch.long, device=device)
    for precision in quantize.DECODING_PRECISIONS:
        torch.manual_seed(0)
        model = quantize.to_precision(build_model(config).to(device), precision)
        generate(model, prompt, new_tokens, sampling=GREEDY, use_cache=False)  # warm-up
        with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] * (device.type == "cuda"))]) as p:
            generate(model, prompt, new_tokens, sampling=GREEDY, use_cache=False)
        print(f"\n## where an uncached {precision} decoding of {new_tokens} tokens spends its time\n```")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=40))
        print("```", flush=True)


def hf_paths(config, prompt, new_tokens: int) -> dict:
    """Hugging Face GPT-2 of config's shape: its dynamic cache eagerly, and a static cache with a compiled forward."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return {}
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.n_embd,
                                    n_layer=config.n_layer, n_head=config.n_head)).to(prompt.device).eval()
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    compiled = GPT2LMHeadModel(hf.config).to(prompt.device).eval()
    compiled.forward = torch.compile(compiled.forward, mode="reduce-overhead", fullgraph=True)
    return {"HF GPT-2, its cache, eager": lambda: hf.generate(prompt, **kwargs),
            "HF GPT-2, static cache, compiled": lambda: compiled.generate(prompt, cache_implementation="static",
                                                                          **kwargs)}


@torch.no_grad()
def main():
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=MODEL_SHAPES, default="classic")
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 64])
    parser.add_argument("--new-tokens", type=positive_int, default=250)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--path-seconds", type=positive_int, default=15,
                        help="fewer timed runs of a path whose runs would take longer than this in all")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; --device cpu rehearses the script")
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    config = model_config(args.shape)
    fused_int8 = quantize.CUDA_INT8_KERNEL  # whether this build has the fused int8 matmul on CUDA
    name = torch.cuda.get_device_name() if device.type == "cuda" else host()
    print(f"# GPU decode: {name}, torch {torch.__version__}, {args.shape} shape, prompt {SHORT_PROMPT}, "
          f"{args.new_tokens} new, greedy, median (min-max) of {args.repeats}")
    print("| path | precision | batch | tokens/s |\n|---|---|---|---|", flush=True)
    for batch in args.batches:
        torch.manual_seed(0)
        prompt = torch.randint(0, config.vocab_size, (batch, SHORT_PROMPT), device=device)
        texts = {}
        kernels = [True, False] if fused_int8 and device.type == "cuda" else [None]
        for precision, fused in [("fp32", None), ("bf16", None), *(("int8", k) for k in kernels)]:
            torch.manual_seed(0)
            model = quantize.to_precision(build_model(config).to(device), precision)
            paths = kvgpt_paths(model, prompt, args.new_tokens, device)
            if precision == "fp32":
                paths.update(hf_paths(config, prompt, args.new_tokens))
            else:  # compiling costs half a minute a path: the choice of capture is made in fp32
                paths.pop("kvgpt, KV cache, reduce-overhead", None)
            if fused is not None:
                quantize.CUDA_INT8_KERNEL = fused
                precision += ", fused matmul" if fused else ", dequantized"
            for path, decode in paths.items():
                try:
                    seconds = capped_timings(decode, args.repeats, sync, args.path_seconds)
                except Exception as e:  # noqa: BLE001  one path that fails (an HF version, a compile) leaves the rest
                    print(f"| {path} | {precision} | {batch} | failed: {str(e).splitlines()[0][:120]} |", flush=True)
                    continue
                median, low, high = rates(batch * args.new_tokens, seconds)
                runs = "" if len(seconds) == args.repeats else f", {len(seconds)} run{'s' * (len(seconds) > 1)}"
                print(f"| {path} | {precision} | {batch} | {median:,.0f} ({low:,.0f}-{high:,.0f}){runs} |", flush=True)
                if precision == "fp32" and path.startswith("kvgpt"):
                    texts[path] = decode()
        same = all(torch.equal(ids, next(iter(texts.values()))) for ids in texts.values())
        print(f"\nbatch {batch}, fp32: kvgpt's {len(texts)} paths give {'the same' if same else 'DIFFERENT'} greedy "
              f"text\n", flush=True)
    quantize.CUDA_INT8_KERNEL = fused_int8
    profile_uncached(config, device)


if __name__ == "__main__":
    run_tool(main)
