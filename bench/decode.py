"""Decode speed at fp32, bf16 and int8: the KV cache against each precision's weight-matmul bound, in one run.

    python bench/decode.py                                    # the classic shakespeare-char shape, on CPU
    python bench/decode.py --shape small                      # the cpu preset's shape (conf/model/small.yaml)
    python bench/decode.py --checkpoint runs/<date>_<time>    # also the val-loss change of bf16 and int8
    python bench/decode.py --profile                          # also where one-token steps spend their time

Greedy generation from a random-weight model of the classic shape (conf/model/classic.yaml: 6 layers,
6 heads, 384 wide, block 256; vocab 65), or of --shape small: speed does not depend on the weights. Tokens/s counts new tokens of
every row (16-token prompt, 240 new). The bound times only the matmuls of every Linear, as that precision
computes them (model/decoding/quantize.py), for one token per row, back to back: what a step would cost with no
attention, norms, activations or Python at all. Each figure is the median of --repeats runs, with their
spread (min-max); every ratio is taken within this run. --checkpoint: the mean loss on the val split of
the text the checkpoint's model was trained on, at each precision, in float32 from logits.
"""

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import MODEL_SHAPES, host, model_config, present_device, run_tool  # noqa: E402
from data import Batches  # noqa: E402
from model import GREEDY, build_model, generate  # noqa: E402
from model.decoding.quantize import DECODING_PRECISIONS, Int8Linear, to_precision  # noqa: E402
from runtime.checkpoint import existing_checkpoint, load_model, training_text  # noqa: E402
from runtime.errors import OneLineErrorParser, positive_int  # noqa: E402

PROMPT_LEN = 16
NEW_TOKENS = 240


def timings(fn, repeats: int, sync, warm_up=None) -> list[float]:
    """Seconds of each of `repeats` runs of fn, after one warm-up (allocations, kernel selection, compiling)."""
    (warm_up or fn)()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def best_seconds(fn, repeats: int, sync, warm_up=None) -> float:
    return min(timings(fn, repeats, sync, warm_up))


def rates(work: float, seconds: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of work / seconds."""
    per_s = sorted(work / s for s in seconds)
    return statistics.median(per_s), per_s[0], per_s[-1]


def matmul_bound(model, batch_size, repeats, sync) -> tuple[float, float, float]:
    """tokens/s of every Linear's matmul alone, as the model computes it, one token per row."""
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Int8Linear))]
    dtype = model.wte.weight.dtype
    inputs = [torch.randn(batch_size, m.in_features, device=model.wte.weight.device, dtype=dtype) for m in linears]

    def twenty_tokens():  # 20 tokens per timing, so that timer resolution does not matter
        for _ in range(20):
            for m, x in zip(linears, inputs):
                m(x)

    return rates(20 * batch_size, timings(twenty_tokens, repeats, sync))


def decode_rates(model, batch_size, repeats, sync, compile) -> tuple[float, float, float]:
    device = model.wte.weight.device
    prompt = torch.randint(0, model.config.vocab_size, (batch_size, PROMPT_LEN), device=device)
    run = lambda n=NEW_TOKENS: generate(model, prompt, n, sampling=GREEDY, compile=compile)  # noqa: E731
    return rates(batch_size * NEW_TOKENS, timings(run, repeats, sync, warm_up=lambda: run(8)))


@torch.no_grad()
def val_loss(model, val_tokens, batches: int = 20, batch_size: int = 16) -> float:
    """Mean loss over fixed val batches, in float32 from the logits (a bf16 loss would be rounded)."""
    data = Batches(val_tokens, model.config.block_size, batch_size, model.wte.weight.device, seed=0)
    losses = []
    for _ in range(batches):
        x, y = data.next()
        logits = model(x)[0].float()
        losses.append(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    return sum(losses) / len(losses)


def print_profile(model, sync) -> None:
    from torch.profiler import profile
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN), device=model.wte.weight.device)
    generate(model, prompt, 8, sampling=GREEDY)
    with profile() as prof:
        generate(model, prompt, NEW_TOKENS, sampling=GREEDY)
        sync()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def fmt(r) -> str:
    return f"{r[0]:.1f} ({r[1]:.0f}-{r[2]:.0f})"


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=present_device, default="cpu")
    parser.add_argument("--shape", choices=MODEL_SHAPES, default="classic",
                        help="the model's shape, from conf/model/ (default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile the one-token step")
    parser.add_argument("--checkpoint", type=existing_checkpoint,
                        help="a trained checkpoint: val loss at each precision")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler summary per precision")
    args = parser.parse_args()

    device = torch.device(args.device)
    if args.checkpoint:  # loaded, and refused, before any output
        val = training_text(load_model(args.checkpoint, device)[2]).val
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    fp32_state = build_model(model_config(args.shape)).state_dict()
    print(f"# decode benchmark: {host()}, torch {torch.__version__}, device {device}, {torch.get_num_threads()} "
          f"threads, {args.shape} "
          f"shape, prompt {PROMPT_LEN}, {NEW_TOKENS} new, greedy, median (min-max) of {args.repeats}"
          f"{', compiled step' if args.compile else ''}")
    print("| precision | cached tok/s, batch 1 | cached tok/s, batch 8 | weight-matmul bound tok/s, batch 1 "
          "| cached / bound | cached / fp32 cached |")
    print("|---|---|---|---|---|---|")
    fp32_b1, profiles = None, []
    for precision in DECODING_PRECISIONS:
        model = build_model(model_config(args.shape))
        model.load_state_dict(fp32_state)
        model = to_precision(model.to(device), precision)
        b1 = decode_rates(model, 1, args.repeats, sync, args.compile)
        b8 = decode_rates(model, 8, args.repeats, sync, args.compile)
        bound = matmul_bound(model, 1, args.repeats, sync)
        fp32_b1 = fp32_b1 or b1[0]
        print(f"| {precision} | {fmt(b1)} | {fmt(b8)} | {fmt(bound)} | {b1[0] / bound[0]:.2f} "
              f"| {b1[0] / fp32_b1:.2f}x |", flush=True)
        if args.profile:
            profiles.append((precision, model))
    for precision, model in profiles:
        print(f"\n## {precision}: one 240-token generation, batch 1, by self time")
        print_profile(model, sync)

    if args.checkpoint:
        losses = {p: val_loss(load_model(args.checkpoint, device, precision=p)[0], val) for p in DECODING_PRECISIONS}
        print(f"\nval loss of {args.checkpoint} (its text's val split, 20 fixed batches of 16):")
        print("| precision | val loss | change from fp32 |")
        print("|---|---|---|")
        for p, loss in losses.items():
            print(f"| {p} | {loss:.4f} | {loss - losses['fp32']:+.4f} |")


if __name__ == "__main__":
    run_tool(main)
