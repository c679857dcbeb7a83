"""Training throughput in tokens/s, eager and with torch.compile, for three shapes, in one run.

    python bench/train_throughput.py            # on CPU: the cpu preset's shape, a small one, the classic one
    python bench/train_throughput.py --device cuda

Each step is train.py's: forward, backward, gradient clipping, the optimiser (training/optim.py), on
batches of tiny_shakespeare. Warm-up steps (which include compilation) are not timed; the time to
compile is printed on its own, since on a short CPU run it decides which mode wins.
"""

import argparse
import dataclasses
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import settings  # noqa: E402
from data import SHAKESPEARE, Batches, prepare_shakespeare  # noqa: E402
from model import GPT  # noqa: E402
from training.optim import make_optimizers  # noqa: E402

SHAPES = {  # name: (overrides of the cpu preset, as on train.py's command line)
    "cpu preset": [],
    "small (4L 4H 128w, block 64)": ["model.block_size=64", "train.batch_size=12"],
    "classic (6L 6H 384w, block 256)": ["model=classic", "train.batch_size=64"],
}


def measure(model_config, batch_size, data, optim_cfg, device, compiled, warmup, steps):
    torch.manual_seed(0)
    raw_model = GPT(model_config).to(device)
    model = torch.compile(raw_model) if compiled else raw_model
    optimizers = make_optimizers(raw_model, optim_cfg, fused=device.type == "cuda")
    batches = Batches(data.train, model_config.block_size, batch_size, device, seed=0)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        x, y = batches.next()
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), optim_cfg.grad_clip)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = time.perf_counter() - start
    return steps * batch_size * model_config.block_size / seconds, warmup_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per shape and mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation included)")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()

    device = torch.device(args.device)
    preset = settings("preset=cpu")
    data = prepare_shakespeare(Path(preset.data.root) / SHAKESPEARE)
    print(f"# training throughput: {torch.__version__}, device {device}, {torch.get_num_threads()} threads, "
          f"{args.steps} timed steps after {args.warmup} warm-up steps")
    print("| shape | batch | eager tok/s | compiled tok/s | compiled / eager | compile warm-up s |")
    print("|---|---|---|---|---|---|")
    for name in args.shapes:
        shape = settings("preset=cpu", *SHAPES[name])
        model_config = dataclasses.replace(shape.model, vocab_size=len(data.vocab))
        batch_size = shape.train.batch_size
        eager, _ = measure(model_config, batch_size, data, shape.optim, device, False, args.warmup, args.steps)
        compiled, warmup_s = measure(model_config, batch_size, data, shape.optim, device, True, args.warmup,
                                     args.steps)
        print(f"| {name} | {batch_size} | {eager:,.0f} | {compiled:,.0f} | {compiled / eager:.2f}x | "
              f"{warmup_s:.0f} |", flush=True)


if __name__ == "__main__":
    main()
