"""Decode speed: KV cache vs full recomputation vs the weight-matmul lower bound, in one run.

    python bench/decode.py                 # the classic shakespeare-char shape, on CPU
    python bench/decode.py --device cuda --compile

Greedy generation from a random-weight model of the classic shape (conf/model/classic.yaml: 6 layers,
6 heads, 384 wide, block 256; vocab 65): speed does not depend on the weights. Tokens/s counts new tokens of every
row. The bound times only the matmuls of every Linear for one token per row, back to back: what
a step would cost with no attention, norms, activations or Python at all. Each figure is the best
of --repeats runs.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import model_config  # noqa: E402
from model import GPT, GREEDY, generate  # noqa: E402

PROMPT_LEN = 16


def best_seconds(fn, repeats: int, sync, warm_up=None) -> float:
    (warm_up or fn)()  # allocations, kernel selection, compilation
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_bound_tokens_per_s(model, batch_size, repeats, sync) -> float:
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(batch_size, m.in_features, device=m.weight.device, dtype=m.weight.dtype) for m in linears]

    def one_token():
        for _ in range(20):  # 20 tokens per timing, so timer resolution does not matter
            for m, x in zip(linears, inputs):
                F.linear(x, m.weight, m.bias)

    return 20 * batch_size / best_seconds(one_token, repeats, sync)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the one-token step")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    classic = model_config("classic")
    model = GPT(classic).to(device).eval()

    def tokens_per_s(batch_size, new_tokens, use_cache):
        prompt = torch.randint(0, classic.vocab_size, (batch_size, PROMPT_LEN), device=device)

        def run(n=new_tokens):
            generate(model, prompt, n, sampling=GREEDY, use_cache=use_cache, compile=args.compile and use_cache)

        return batch_size * new_tokens / best_seconds(run, args.repeats, sync, warm_up=lambda: run(8))

    print(f"# decode benchmark: {torch.__version__}, device {device}, {torch.get_num_threads()} threads, "
          f"classic shape ({model.num_params() / 1e6:.1f}M params), prompt {PROMPT_LEN}, greedy, "
          f"best of {args.repeats}{', compiled step' if args.compile else ''}")
    print("| batch | new tokens | cached tok/s | uncached tok/s | cached / uncached |")
    print("|---|---|---|---|---|")
    cached_b1 = None
    for batch_size, new_tokens in ((1, 240), (1, 1000), (8, 240)):
        cached = tokens_per_s(batch_size, new_tokens, use_cache=True)
        uncached = tokens_per_s(batch_size, new_tokens, use_cache=False)
        cached_b1 = cached_b1 or cached
        print(f"| {batch_size} | {new_tokens} | {cached:.1f} | {uncached:.1f} | {cached / uncached:.1f}x |",
              flush=True)
    bound = matmul_bound_tokens_per_s(model, 1, args.repeats, sync)
    print(f"\nweight-matmul bound, batch 1: {bound:.1f} tok/s; cached (240 new) / bound = {cached_b1 / bound:.2f}")


if __name__ == "__main__":
    main()
