"""Many requests at once: the engine (model/serving/engine.py) against decoding them one by one and in fixed batches.

    python bench/engine.py                          # the classic shape (block 256), random weights
    python bench/engine.py --checkpoint runs/RUN    # a trained model: its block_size bounds the texts

Two workloads of --requests requests, all arriving at once: shared, a common --preamble-character preamble (the val
split's first characters) and then one line of the play each; own, the lines alone. Each request draws --new
tokens greedily. Three ways to serve them: one by one with the contiguous cache (generate), in fixed batches of
--batch left-padded rows (generate), and the engine with at most --batch running at once over a pool of blocks.
Reported per way, median (min-max) of --repeats: new tokens per second over the wall time, the mean time to a
request's first token, the prefix cache's hit rate and the peak cache bytes; and whether every text is the
one-by-one text.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import (check_room, check_servable_model, host, model_config, run_tool,  # noqa: E402
                           shakespeare)
from model import GREEDY, build_model, generate_tokens, kv_cache_bytes  # noqa: E402
from model.serving.engine import Engine  # noqa: E402
from runtime.checkpoint import existing_checkpoint, load_model, training_text  # noqa: E402
from runtime.errors import OneLineErrorParser, UsageError, positive_int  # noqa: E402

BLOCK_TOKENS = 16


def workloads(val: str, vocab, n: int, preamble: int, longest: int) -> dict[str, list[list[int]]]:
    """shared and own: n prompts each, from the val text's lines of 10 characters or more."""
    lines = [line + "\n" for line in val.splitlines() if len(line) >= 10][:n]
    if len(lines) < n:
        raise UsageError(f"--requests {n}: the val split has {len(lines)} lines of 10 characters or more")
    common = val[:preamble]  # a prompt too long for the context loses its end, so that the preamble stays whole
    return {"shared": [vocab.encode(common + line)[:longest] for line in lines],
            "own": [vocab.encode(line)[:longest] for line in lines]}


def one_by_one(model, prompts, new):
    texts, first, start = [], [], time.perf_counter()
    for prompt in prompts:
        tokens = []
        for token in generate_tokens(model, torch.tensor([prompt]), new, sampling=GREEDY):
            if not tokens:
                first.append(time.perf_counter() - start)
            tokens.append(int(token))
        texts.append(prompt + tokens)
    return texts, first, time.perf_counter() - start, kv_cache_bytes(model.config, model.attention_dtype), None


def fixed_batches(model, prompts, new, batch):
    texts, first, start = [], [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(map(len, group))
        idx = torch.tensor([[0] * (width - len(p)) + p for p in group])
        drawn = []
        for step in generate_tokens(model, idx, new, sampling=GREEDY, n_pad=[width - len(p) for p in group]):
            if not drawn:
                first += [time.perf_counter() - start] * len(group)
            drawn.append(step.tolist())
        texts += [p + [row[b] for row in drawn] for b, p in enumerate(group)]
    bytes_ = batch * kv_cache_bytes(model.config, model.attention_dtype)
    return texts, first, time.perf_counter() - start, bytes_, None


def engine(model, prompts, new, batch, n_blocks):
    server = Engine(model, n_blocks=n_blocks, block_tokens=BLOCK_TOKENS, max_batch=batch)
    requests = [server.add(i, p, new) for i, p in enumerate(prompts)]
    first, start = {}, time.perf_counter()
    for name, _ in server.run():
        first.setdefault(name, time.perf_counter() - start)
    per_block = server.pool.nbytes // n_blocks
    return ([r.tokens for r in requests], [first[i] for i in range(len(prompts))], time.perf_counter() - start,
            server.stats.peak_blocks * per_block, server.stats.hit_rate)


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=existing_checkpoint, help="a run directory or .pt file")
    parser.add_argument("--requests", type=positive_int, default=64)
    parser.add_argument("--preamble", type=positive_int, default=200)
    parser.add_argument("--new", type=positive_int, default=32)
    parser.add_argument("--batch", type=positive_int, default=16)
    parser.add_argument("--repeats", type=positive_int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.checkpoint:
        model, vocab, contents = load_model(args.checkpoint, "cpu")
        val = training_text(contents).vocab.decode(training_text(contents).val.tolist())
    else:
        data = shakespeare()
        model, vocab, val = build_model(model_config("classic")).eval(), data.vocab, data.vocab.decode(data.val.tolist())
    check_servable_model(f"--checkpoint {args.checkpoint}", model)
    block = model.config.block_size
    check_room("--new", args.new, block)
    loads = workloads(val, vocab, args.requests, args.preamble, block - args.new)
    n_blocks = args.batch * -(-block // BLOCK_TOKENS)  # room for --batch texts of block_size, nothing shared
    print(f"# {args.requests} requests, {args.new} new tokens each, batch {args.batch}, blocks of {BLOCK_TOKENS}, "
          f"block_size {block}: {host()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"median (min-max) of {args.repeats}")
    print("| workload | way | tok/s | mean time to first token (s) | prefix hit rate | peak cache MiB | same text |")
    print("|---|---|---|---|---|---|---|")
    ways = {"one by one": lambda p: one_by_one(model, p, args.new),
            "fixed batches": lambda p: fixed_batches(model, p, args.new, args.batch),
            "engine": lambda p: engine(model, p, args.new, args.batch, n_blocks)}
    for load, prompts in loads.items():
        runs = {way: [] for way in ways}
        for _ in range(args.repeats):  # the ways alternate, so that a slower spell of the machine hits each
            for way, serve in ways.items():
                runs[way].append(serve(prompts))
        reference = runs["one by one"][0][0]
        for way, results in runs.items():
            rates = [args.requests * args.new / seconds for _, _, seconds, _, _ in results]
            ttft = [statistics.mean(first) for _, first, _, _, _ in results]
            texts, _, _, cache_bytes, hits = results[0]
            print(f"| {load} | {way} | {statistics.median(rates):.0f} ({min(rates):.0f}-{max(rates):.0f}) | "
                  f"{statistics.median(ttft):.2f} ({min(ttft):.2f}-{max(ttft):.2f}) | "
                  f"{'-' if hits is None else f'{hits:.0%}'} | {cache_bytes / 2**20:.1f} | "
                  f"{'yes' if texts == reference else 'NO'} |", flush=True)


if __name__ == "__main__":
    run_tool(main)
