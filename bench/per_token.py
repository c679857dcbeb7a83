"""What the KV cache buys: the time each generated token takes against its position, cached and uncached.

    python bench/per_token.py                                     # the cpu preset's shape, to 2 x block_size
    python bench/per_token.py --plot docs/images/cache_buys.png   # the picture too, from the same run
    python bench/per_token.py --shape classic --repeats 5

A random-weight model of --shape (default small: the shape `python train.py` trains on a CPU; speed does not
depend on the weights) generates --positions tokens greedily at batch 1, from a one-token prompt, through
generate_tokens: with its KV cache, and with use_cache=False, a whole forward over the context at every step.
Each step is timed alone, the two ways taking turns within each repeat. Past block_size the context keeps its
last tokens: learned positions cannot slide, so the cached decoder refills its cache with one prefill of the last
block_size // 2 tokens whenever the context fills (model/decoding/generate.py).
The bound is bench/decode.py's weight-matmul bound: every Linear's matmul alone, for one token, what a step would
cost with no attention, norms or Python. Each table row is a bucket of --bucket positions: the median (min-max)
over --repeats of each repeat's median step there (and its slowest cached one, where the cache is refilled);
"uncached / cached" is taken within each repeat. The picture
draws every position's median over the repeats, shaded from the lowest to the highest.
"""

import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import plots  # noqa: E402
from bench.configs import MODEL_SHAPES, host, median_spread, model_config, run_tool  # noqa: E402
from bench.decode import matmul_bound  # noqa: E402
from model import GREEDY, build_model, generate_tokens  # noqa: E402
from model.decoding.generate import default_keep  # noqa: E402
from runtime.errors import OneLineErrorParser, positive_int  # noqa: E402


def past_block_size(config) -> str:
    """What decoding does once the context passes block_size, as the picture says it."""
    if config.pos_emb == "rope":
        return "from here the cache rolls on,\n each layer attending its last block_size tokens"
    return (f"from here the context keeps its last {default_keep(config.block_size)}\n tokens whenever it fills, "
            f"and the cache is filled again")


@torch.no_grad()
def step_seconds(model, positions: int, use_cache: bool) -> list[float]:
    """Seconds of each step that generates the tokens at positions 1 to `positions`, after a one-token prompt."""
    steps = generate_tokens(model, torch.zeros(1, 1, dtype=torch.long), positions, sampling=GREEDY,
                            use_cache=use_cache)
    seconds = []
    for _ in range(positions):
        start = time.perf_counter()
        next(steps)
        seconds.append(time.perf_counter() - start)
    return seconds


def bucket_row(first: int, last: int, cached: list[list[float]], uncached: list[list[float]]) -> str:
    """A table row for positions first to last, in ms: each repeat's median step there, cached and uncached, and
    its slowest cached step (a refill of the cache)."""
    def each_repeat(rows, of=statistics.median):
        return [of(row[first - 1:last]) * 1e3 for row in rows]
    fast, slow = each_repeat(cached), each_repeat(uncached)
    ratios = [s / f for s, f in zip(slow, fast)]
    return (f"| {first}-{last} | {median_spread(fast, 3)} | {median_spread(each_repeat(cached, max), 3)} | "
            f"{median_spread(slow, 3)} | {median_spread(ratios, 1)} |")


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=MODEL_SHAPES, default="small",
                        help="the model's shape, from conf/model/ (default: %(default)s, the cpu preset's)")
    parser.add_argument("--positions", type=positive_int, help="tokens to generate (default: 2 x block_size)")
    parser.add_argument("--repeats", type=positive_int, default=20)
    parser.add_argument("--bucket", type=positive_int, default=32, help="positions per table row")
    parser.add_argument("--plot", type=plots.plot_file, metavar="FILE.png", help="draw the picture into this file")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = model_config(args.shape)
    model = build_model(config).eval()
    positions = args.positions or 2 * config.block_size
    step_seconds(model, 8, True), step_seconds(model, 8, False)  # warm-up: allocations, kernel choice
    timed = {True: [], False: []}
    for _ in range(args.repeats):
        for use_cache in timed:
            timed[use_cache].append(step_seconds(model, positions, use_cache))
    bound = matmul_bound(model, 1, args.repeats, lambda: None)  # tokens/s: median, min, max
    shape = f"{args.shape} shape ({config.n_layer} layers, {config.n_embd} wide, block_size {config.block_size})"
    date = datetime.date.today().isoformat()
    threads = f"{torch.get_num_threads()} thread{'s' * (torch.get_num_threads() != 1)}"
    print(f"# milliseconds per generated token, {shape}, random weights, fp32, batch 1, greedy: {host()}, "
          f"torch {torch.__version__}, {threads}, {date}; median (min-max) of {args.repeats}")
    print("| positions | cached ms | cached, slowest step ms | uncached ms | uncached / cached |")
    print("|---|---|---|---|---|")
    for first in range(1, positions + 1, args.bucket):
        print(bucket_row(first, min(first + args.bucket - 1, positions), timed[True], timed[False]))
    print(f"\nweight-matmul bound: {1e3 / bound[0]:.3f} ms a token ({1e3 / bound[2]:.3f}-{1e3 / bound[1]:.3f})")
    if args.plot:
        plots.cache_buys(args.plot, list(range(1, positions + 1)), timed[True], timed[False], 1 / bound[0],
                         config.block_size, past_block_size(config),
                         f"What the KV cache buys: each token's time, {args.shape} shape, CPU",
                         f"{host()}, torch {torch.__version__}, {threads}, {date}, "
                         f"{args.repeats} repeats: python bench/per_token.py")
        print(f"picture: {args.plot}")


if __name__ == "__main__":
    run_tool(main)
