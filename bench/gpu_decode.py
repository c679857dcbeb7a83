"""Decoding speed on a GPU, every path in one process: the same shape, random weights, greedy, a 6-token prompt.

    python bench/gpu_decode.py                       # the classic shape on CUDA, batches 1 and 64, 250 new tokens
    python bench/gpu_decode.py --device cpu --shape small --new-tokens 40   # a rehearsal of the script on a CPU

Paths, each timed at each batch: kvgpt's eager cached step, its step captured as a CUDA graph (cuda only), no cache
(a full forward over the context at every step: the loop nanoGPT's generate runs), and, where transformers is
installed, Hugging Face's GPT-2 of the same shape with its own cache, eagerly and with a static cache and a
compiled forward. fp32, and kvgpt's paths in bf16 too. Each figure is the median (min-max) of --repeats runs after
a warm-up, which includes compiling and capturing: neither is counted in tokens/s. The greedy texts of kvgpt's fp32
paths are compared, token for token.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import MODEL_SHAPES, host, model_config, run_tool  # noqa: E402
from bench.decode import rates, timings  # noqa: E402
from model import GREEDY, build_model, generate, new_kv_cache  # noqa: E402
from model.decoding.cuda_graph import CapturedStep  # noqa: E402
from runtime.errors import OneLineErrorParser, positive_int  # noqa: E402

SHORT_PROMPT = 6  # tokens of prompt: a short one, so that the new tokens decide the speed


def kvgpt_paths(model, prompt, new_tokens: int, device) -> dict:
    """name -> a function that decodes greedily and returns the ids, for kvgpt's paths."""
    cache = new_kv_cache(model, prompt.size(0))
    paths = {"kvgpt, KV cache, eager": lambda: generate(model, prompt, new_tokens, sampling=GREEDY, cache=cache),
             "kvgpt, no cache": lambda: generate(model, prompt, new_tokens, sampling=GREEDY, use_cache=False)}
    if device.type == "cuda":
        captured_cache = new_kv_cache(model, prompt.size(0))
        step = CapturedStep(model, captured_cache)
        paths["kvgpt, KV cache, CUDA graph"] = lambda: generate(model, prompt, new_tokens, sampling=GREEDY,
                                                                 cache=captured_cache, step=step)
    return paths


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
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; --device cpu rehearses the script")
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    config = model_config(args.shape)
    name = torch.cuda.get_device_name() if device.type == "cuda" else host()
    print(f"# GPU decode: {name}, torch {torch.__version__}, {args.shape} shape, prompt {SHORT_PROMPT}, "
          f"{args.new_tokens} new, greedy, median (min-max) of {args.repeats}")
    print("| path | precision | batch | tokens/s |\n|---|---|---|---|", flush=True)
    for batch in args.batches:
        torch.manual_seed(0)
        prompt = torch.randint(0, config.vocab_size, (batch, SHORT_PROMPT), device=device)
        texts = {}
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            torch.manual_seed(0)
            model = build_model(config).to(device=device, dtype=dtype).eval()
            paths = kvgpt_paths(model, prompt, args.new_tokens, device)
            if precision == "fp32":
                paths.update(hf_paths(config, prompt, args.new_tokens))
            for path, decode in paths.items():
                try:
                    median, low, high = rates(batch * args.new_tokens, timings(decode, args.repeats, sync))
                except Exception as e:  # noqa: BLE001  one path that fails (an HF version, a compile) leaves the rest
                    print(f"| {path} | {precision} | {batch} | failed: {str(e).splitlines()[0][:120]} |", flush=True)
                    continue
                print(f"| {path} | {precision} | {batch} | {median:,.0f} ({low:,.0f}-{high:,.0f}) |", flush=True)
                if precision == "fp32" and path.startswith("kvgpt"):
                    texts[path] = decode()
        same = all(torch.equal(ids, next(iter(texts.values()))) for ids in texts.values())
        print(f"\nbatch {batch}, fp32: kvgpt's {len(texts)} paths give {'the same' if same else 'DIFFERENT'} greedy "
              f"text\n", flush=True)


if __name__ == "__main__":
    run_tool(main)
