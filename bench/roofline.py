"""What the machine allows one decoding step: the bytes a token reads and the arithmetic it does, against the read
bandwidth and the compute peak measured here, as STREAM and a large matmul measure them.

    python bench/roofline.py --checkpoint RUN      # the machine's figures for that model, per thread count
    python bench/roofline.py --shape classic

A batch-1 step reads every weight once, and the keys and values of its context: model_bytes says how many. It does
about two operations per weight and per cached value: model_flops. The bandwidth is a sum over a buffer of exactly
those bytes, the best of many passes, so that it is the speed of whichever cache or memory holds them. The peak is
a float32 matmul large enough to keep every core busy. A path's MBU is its tokens/s times the bytes a token reads,
over that bandwidth: the share of the machine's reads its step uses. MFU is the same for arithmetic.
"""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import MODEL_SHAPES, host, model_config, run_tool  # noqa: E402
from model import build_model  # noqa: E402
from runtime.checkpoint import load_model  # noqa: E402
from runtime.errors import OneLineErrorParser, positive_int  # noqa: E402


def model_bytes(model, context: int) -> int:
    """Bytes one batch-1 step reads: every weight once (a tied head counted once), and the keys and values of
    `context` earlier tokens in float32."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    c = model.config
    kv_heads, head_dim = c.kv_cache_heads
    return weights + 2 * c.n_kv_layer * kv_heads * head_dim * context * 4


def model_flops(model, context: int) -> int:
    """Operations of one batch-1 step: a multiply and an add per weight in a matrix, and per cached value read."""
    c = model.config
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2) - c.block_size * c.n_embd * (
        c.pos_emb == "learned")  # a position's embedding is read, not multiplied
    return 2 * matrices + 2 * 2 * c.n_layer * c.n_embd * context


def best_seconds(work, seconds: float) -> float:
    """The fastest of as many calls of work() as fill `seconds`, after one untimed call (which brings its data into
    the caches that can hold it)."""
    work()
    best, spent = float("inf"), 0.0
    while spent < seconds:
        start = time.perf_counter()
        work()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return best


def read_bandwidth(nbytes: int, threads: int, seconds: float = 0.2) -> float:
    """Bytes/s of a float32 sum over a buffer of nbytes: its best pass."""
    torch.set_num_threads(threads)
    buffer = torch.ones(max(nbytes // 4, 1024))
    return buffer.numel() * 4 / best_seconds(buffer.sum, seconds)


def compute_peak(threads: int, size: int = 1024, seconds: float = 0.5) -> float:
    """float32 operations/s of a size x size matmul, its best run."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size ** 3 / best_seconds(lambda: a @ b, seconds)


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a trained checkpoint (file or run folder)")
    parser.add_argument("--shape", choices=MODEL_SHAPES, default="small", help="a random model of this shape")
    parser.add_argument("--context", type=positive_int, default=64, help="cached tokens a step reads")
    args = parser.parse_args()
    model = load_model(args.checkpoint)[0] if args.checkpoint else build_model(model_config(args.shape))
    nbytes, flops = model_bytes(model, args.context), model_flops(model, args.context)
    print(f"# roofline: {host()}; a step at context {args.context} reads {nbytes / 2**20:.2f} MiB and does "
          f"{flops / 1e6:.2f} MFLOP")
    print("| threads | read bandwidth, GB/s | tok/s it allows | compute peak, GFLOP/s | tok/s it allows |")
    print("|---|---|---|---|---|")
    for threads in range(1, (os.cpu_count() or 1) + 1):
        bandwidth, peak = read_bandwidth(nbytes, threads), compute_peak(threads)
        print(f"| {threads} | {bandwidth / 1e9:.1f} | {bandwidth / nbytes:,.0f} | {peak / 1e9:.1f} | "
              f"{peak / flops:,.0f} |")


if __name__ == "__main__":
    run_tool(main)
