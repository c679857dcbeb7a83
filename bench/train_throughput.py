"""Training throughput in tokens/s, eager and with torch.compile, for each shape, in one run.

    python bench/train_throughput.py            # the cpu preset (learned, then rotary positions), a small shape, the classic one
    python bench/train_throughput.py --device cuda
    python bench/train_throughput.py --shapes "cpu preset" --precisions fp32 bf16   # the step in each precision

Each step is train.py's own (training/loop.py's Trainer.train_step: forward, backward, gradient clipping,
the optimisers and their schedules) with the cpu preset's settings, on batches of tiny_shakespeare. Warm-up
steps (which include compilation) are not timed; the time to compile is printed on its own, since on a
short CPU run it decides which mode wins.
"""

import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import count, host, present_device, run_tool, settings, shakespeare  # noqa: E402
from data import PreparedData  # noqa: E402
from model import build_model  # noqa: E402
from training.config import TRAINING_PRECISIONS, Settings  # noqa: E402
from runtime.devices import keep_freed_memory  # noqa: E402
from training.loop import Trainer  # noqa: E402
from runtime.errors import OneLineErrorParser, positive_int  # noqa: E402

SHAPES = {  # name: (overrides of the cpu preset, as on train.py's command line)
    "cpu preset": [],
    "cpu preset, rope": ["model.pos_emb=rope"],
    "small (4L 4H 128w, block 64)": ["model.n_layer=4", "model.block_size=64", "train.batch_size=12"],
    "classic (6L 6H 384w, block 256)": ["model=classic", "train.batch_size=64"],
}


def measure(shape: Settings, data: PreparedData, device: torch.device, warmup: int, steps: int):
    """tokens/s of `steps` training steps after `warmup` untimed ones (compiling, with train.compile), the
    seconds the warm-up took, and what train.precision resolved to (bf16 or fp32)."""
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(shape.model, vocab_size=len(data.vocab))).to(device)
    trainer = Trainer(shape, model, data, device, run_dir=None, summaries=None)  # nothing is saved
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    for _ in range(warmup):
        trainer.train_step()
    sync()
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    sync()
    return steps * trainer.tokens_per_step / (time.perf_counter() - start), warmup_s, trainer.precision


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=present_device, default="cpu")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per shape and mode")
    parser.add_argument("--warmup", type=count, default=3, help="untimed steps first (compilation included)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--precisions", nargs="+", default=["auto"], choices=TRAINING_PRECISIONS,
                        help="train.precision for each shape (auto: what train.py picks on this machine)")
    args = parser.parse_args()

    keep_freed_memory()  # as train.py does
    device = torch.device(args.device)
    data = shakespeare()
    print(f"# training throughput: {host()}, torch {torch.__version__}, device {device}, "
          f"{torch.get_num_threads()} threads, {args.steps} timed steps after {args.warmup} warm-up steps")
    print("| shape | precision | optimiser | batch | eager tok/s | compiled tok/s | compiled / eager | "
          "compile warm-up s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        for precision in args.precisions:
            eager, compiled = (settings("preset=cpu", *SHAPES[name], f"train.compile={mode}",
                                        f"train.precision={precision}") for mode in (False, True))
            eager_tok_s, _, resolved = measure(eager, data, device, args.warmup, args.steps)
            compiled_tok_s, warmup_s, _ = measure(compiled, data, device, args.warmup, args.steps)
            print(f"| {name} | {resolved} | {eager.optim.name} | {eager.train.batch_size} | {eager_tok_s:,.0f} | "
                  f"{compiled_tok_s:,.0f} | {compiled_tok_s / eager_tok_s:.2f}x | {warmup_s:.0f} |", flush=True)


if __name__ == "__main__":
    run_tool(main)
