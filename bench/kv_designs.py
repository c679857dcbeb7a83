"""The KV-cache designs side by side: what each costs in quality, memory and speed.

    python bench/kv_designs.py speed                      # classic shape, random weights: memory and decode speed
    python bench/kv_designs.py speed --compile            # the same, with each one-token step compiled
    python bench/kv_designs.py speed --designs smallest   # only these designs, beside MHA
    python bench/kv_designs.py train --seeds 1337 1 2     # each design trained with the cpu preset, then measured
    python bench/kv_designs.py train --runs-dir keep/     # keep the runs; one trained there is reused, one stopped
                                                          # part-way (Ctrl-C) goes on from its last.pt
    python bench/kv_designs.py train --designs mha int8   # only these designs
    python bench/kv_designs.py train --plot docs/images/designs.png   # the picture too, from the same run

speed: the classic shape (conf/model/classic.yaml: 6 layers, 6 heads, 384 wide, block 256), random weights, fp32,
for n_kv_head 6, 3, 2, 1 with kv_share 1 and 2, the int8 cache, local layers, a learned sink and latent attention
(CLASSIC).
Decoding with the context filled to block_size: a prefill of block_size - STEPS tokens, then STEPS one-token
steps timed, at batch 1 and 64. Designs take turns within each repeat, and each ratio to plain multi-head
attention (MHA, fp32 cache) is taken within its repeat: median (min-max) of --repeats. Eagerly, each design also
decodes at batch 64 after a one-token prompt, where its cache costs next to nothing: against MHA with a full
context, that is the most any cache could make it gain.

train: each design trained by `python train.py preset=cpu` (same steps, each seed), and its best.pt measured:
parameters, cache bytes per token, best val loss (median and spread over seeds), val loss through the decoder
(model/measuring/decoder_loss.py: the val split streamed through the real cache, 64 streams side by side) beside the
teacher-forced loss under the same context rule, training seconds, and decode tokens/s at batch 1 and 64 with
the context filled. The preset's own checkpoint is also decoded through the int8, int4 and int2 caches
(model/caches/factory.py), measured the same way. Every design stays in the table, whatever it scored. --plot draws
the loss through the decoder against cache bytes per token, one point per design and cache: the one loss that a
lossy cache changes.
"""

import dataclasses
import datetime
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import plots  # noqa: E402
from bench.configs import (REPO, check_cache, check_training, host, median_spread, model_config, run_tool,  # noqa: E402
                           shakespeare, training_failed, training_seed)
from bench.curve import read_curve  # noqa: E402
from model import GPT, build_model, kv_cache_bytes_per_token, new_cache, new_kv_cache  # noqa: E402
from model.measuring.decoder_loss import decoder_loss, teacher_forced_loss  # noqa: E402
from model.decoding.generate import prefill  # noqa: E402
from runtime.checkpoint import load_model  # noqa: E402
from runtime.errors import OneLineErrorParser, UsageError, positive_int  # noqa: E402

STEPS = 16  # one-token steps timed after the prefill, the context growing from block_size - STEPS to block_size
BATCHES = (1, 64)
STREAMS = 64  # rows of the val split decoded side by side for the loss through the decoder
# key: (name, model overrides, KV cache by name): the trained designs, on the cpu preset's 4 heads and 4 layers
# (kv_share=2 needs an even number of layers, so --train-overrides pins 4 wherever the preset's depth is)
TRAINED = {"mha": ("MHA (the preset)", [], "float"), "gqa": ("GQA, n_kv_head=2", ["model.n_kv_head=2"], "float"),
           "mqa": ("MQA, n_kv_head=1", ["model.n_kv_head=1"], "float"),
           "share2": ("kv_share=2", ["model.kv_share=2"], "float"),
           "share2-mqa": ("kv_share=2 + MQA", ["model.kv_share=2", "model.n_kv_head=1"], "float"),
           "local": ("LLLG, local_window=32", ["model.window_pattern=LLLG", "model.local_window=32"], "float"),
           "sink": ("learned sink", ["model.learned_sink=true"], "float"),
           "mla64": ("MLA, kv_latent=64 (MQA's cache)", ["model.kv_latent=64"], "float"),
           "mla128": ("MLA, kv_latent=128 (GQA 2's cache)", ["model.kv_latent=128"], "float"),
           "int8": ("MHA, int8 cache", [], "int8"), "int4": ("MHA, int4 cache", [], "int4"),
           "int2": ("MHA, int2 cache", [], "int2")}
LOCAL = dict(window_pattern="LLLLLG", local_window=64)  # the classic shape's 6 layers, one of them global
SMALLEST = dict(window_pattern="LLLLGG", local_window=64, n_kv_head=1, kv_share=2)  # shared layers pair L or G
# key: (name, model overrides, KV cache dtype): the classic shape's designs
CLASSIC = {"mha": ("MHA", {}, None), "gqa3": ("GQA 3", dict(n_kv_head=3), None),
           "gqa2": ("GQA 2", dict(n_kv_head=2), None), "mqa": ("MQA", dict(n_kv_head=1), None),
           "int8": ("MHA, int8 cache", {}, torch.int8), "mqa-int8": ("MQA, int8 cache", dict(n_kv_head=1), torch.int8),
           "share2": ("MHA, kv_share=2", dict(kv_share=2), None),
           "share2-mqa": ("MQA, kv_share=2", dict(n_kv_head=1, kv_share=2), None),
           "local": ("LLLLLG, local_window=64", LOCAL, None),
           "local-mqa": ("LLLLLG + MQA", dict(LOCAL, n_kv_head=1), None),
           "smallest": ("LLLLGG + MQA, kv_share=2", SMALLEST, None),
           "smallest-int8": ("LLLLGG + MQA, kv_share=2, int8 cache", SMALLEST, torch.int8),
           "sink": ("learned sink", dict(learned_sink=True), None),
           "mla128": ("MLA, kv_latent=128", dict(kv_latent=128), None),
           "mla256": ("MLA, kv_latent=256", dict(kv_latent=256), None),
           "mla128-local": ("MLA 128 + LLLLLG", dict(LOCAL, kv_latent=128), None)}


@torch.no_grad()
def decode_seconds(model: GPT, cache, step=None, prompt_len: int | None = None) -> float:
    """Seconds for STEPS one-token steps through an empty cache, after an eager prefill of prompt_len tokens (default
    block_size - STEPS: the context fills up to block_size); `step`: the one-token step (default model.decode_step;
    a compiled one for --compile)."""
    step = step or model.decode_step
    prompt_len = prompt_len or model.config.block_size - STEPS
    prompt = torch.randint(0, model.config.vocab_size, (cache.batch_size, prompt_len))
    logits = prefill(model, prompt, cache)
    start = time.perf_counter()
    for _ in range(STEPS):
        logits = step(logits.argmax(dim=-1, keepdim=True), cache)
    return time.perf_counter() - start


def bytes_per_token(model: GPT, cache: str) -> float:
    """What the cache of that name (model/caches/factory.py) holds per token of a full context, as made."""
    return new_cache(model, cache, 1).nbytes / model.config.block_size


def rate(values) -> str:
    return median_spread(values, 0)


def speed(args) -> None:
    # every design's decode_step is one function to torch.compile: allow a compiled version per design and batch
    torch._dynamo.config.recompile_limit = 4 * len(CLASSIC) * len(BATCHES)
    models = {}
    for name, overrides, dtype in (CLASSIC[key] for key in dict.fromkeys(["mha", *args.designs])):
        torch.manual_seed(0)
        config = dataclasses.replace(model_config("classic"), **overrides)
        model = build_model(config).eval()
        # static shapes: a step compiled for each batch size, as sample.py --compile compiles one for its batch
        step = torch.compile(model.decode_step, fullgraph=True, dynamic=False) if args.compile else None
        models[name] = (model, dtype, step)
    tok_s = {(name, b): [] for name in models for b in (*BATCHES, "bare")}
    for name, (model, dtype, step) in models.items():  # warm-up: allocations, kernel choice, compiling
        for b in BATCHES if args.compile else BATCHES[:1]:
            decode_seconds(model, new_kv_cache(model, b, dtype=dtype), step)
    for _ in range(args.repeats):
        for b in BATCHES:
            for name, (model, dtype, step) in models.items():
                tok_s[name, b].append(b * STEPS / decode_seconds(model, new_kv_cache(model, b, dtype=dtype), step))
        for name, (model, dtype, step) in models.items():  # eagerly, a context of 1-17 tokens costs next to nothing
            if not args.compile:
                b = BATCHES[-1]
                tok_s[name, "bare"].append(b * STEPS / decode_seconds(model, new_kv_cache(model, b, dtype=dtype),
                                                                      prompt_len=1))
    print(f"# KV-cache designs, classic shape, random weights, fp32 weights, one-token steps "
          f"{'compiled (torch.compile)' if args.compile else 'eager'}: {host()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; context filled to block_size; median (min-max) of {args.repeats}")
    bare = "" if args.compile else " x MHA batch 64, its cache free |"
    print("| design | cache bytes/token | cache MiB at batch 64 | weights MiB | tok/s batch 1 | tok/s batch 64 | "
          "x MHA batch 1 | x MHA batch 64 |" + bare)
    print("|---" * (8 if args.compile else 9) + "|")
    for name, (model, dtype, _) in models.items():
        c = model.config
        per_token = kv_cache_bytes_per_token(c, dtype or torch.float32)
        ratios = {b: [t / m for t, m in zip(tok_s[name, b], tok_s["MHA", 64 if b == "bare" else b])]
                  for b in (*BATCHES, "bare")}
        print(f"| {name} | {per_token:,.0f} | {64 * c.block_size * per_token / 2**20:.1f} | "
              f"{model.num_params() * 4 / 2**20:.1f} | {rate(tok_s[name, 1])} | {rate(tok_s[name, 64])} | "
              f"{median_spread(ratios[1])} | {median_spread(ratios[64])} |"
              + ("" if args.compile else f" {median_spread(ratios['bare'])} |"))
    if "MHA, int8 cache" in models:
        int8 = [t / m for t, m in zip(tok_s["MHA, int8 cache", 64], tok_s["MHA", 64])]
        print(f"\nint8 cache / fp32 cache at batch 64: {median_spread(int8)}")


def finished(run_dir: Path) -> bool:
    """Whether the run in run_dir trained to its end: its last.pt at train.max_iters, or ended by train.patience."""
    if not (run_dir / "best.pt").is_file() or not (run_dir / "last.pt").is_file():
        return False
    state = torch.load(run_dir / "last.pt", map_location="cpu", weights_only=True)["training"]
    tc = state["config"]["train"]
    patience = tc.get("patience")
    return state["step"] == tc["max_iters"] or (patience is not None and state["since_best"] >= patience)


def train_run(overrides: list[str], seed: int, runs_dir: Path, extra: list[str]) -> tuple[Path, float | None]:
    """The run directory of `train.py preset=cpu` with these overrides and seed, trained unless already there (one
    stopped part-way goes on from its last.pt); the wall seconds of a whole run trained here (None otherwise)."""
    name = "-".join(o.split(".")[-1].replace("=", "") for o in overrides) or "preset"
    run_dir = (runs_dir / f"{name}-seed{seed}").resolve()
    if finished(run_dir):
        return run_dir, None
    resume = [f"train.resume={run_dir}"] if (run_dir / "last.pt").is_file() else []
    start = time.time()
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "preset=cpu", *overrides, *extra,
                             f"train.seed={seed}", f"hydra.run.dir={run_dir}", *resume], cwd=REPO, capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise training_failed(f"training {overrides}", result)
    return run_dir, None if resume else time.time() - start


def train(args) -> None:
    if args.runs_dir is not None and args.runs_dir.exists() and not args.runs_dir.is_dir():
        raise UsageError(f"--runs-dir {args.runs_dir} is a file; give a folder")
    for key in args.designs:  # what train.py, or the cache, would refuse, refused before any run and any output
        check_training(f"--train-overrides, for design {key}", *TRAINED[key][1], *args.train_overrides)
        check_cache(f"--designs {key}", TRAINED[key][2], *TRAINED[key][1], *args.train_overrides)
    runs_dir = args.runs_dir or Path(tempfile.mkdtemp(prefix="kv_designs-"))
    val = shakespeare().val
    n = len(val) // STREAMS * STREAMS
    streams = torch.from_numpy(val[:n].astype("int64")).view(STREAMS, -1)[:, :args.stream_len]
    print(f"# KV-cache designs trained with the cpu preset {args.train_overrides}: {host()}, torch {torch.__version__},"
          f" {torch.get_num_threads()} threads; seeds {args.seeds}; decoder loss over {STREAMS} x "
          f"{streams.size(1)} val tokens (prefill {args.prompt_len}); decode median (min-max) of {args.repeats}")
    print("| design | parameters | cache bytes/token | best val (median, min-max) | val through the decoder | "
          "teacher-forced, same contexts | training s | tok/s batch 1 | tok/s batch 64 |")
    print("|---|---|---|---|---|---|---|---|---|")
    points = []  # the picture's: one per design and cache
    for key in args.designs:
        name, overrides, cache_name = TRAINED[key]
        best, through, forced, seconds, models = [], [], [], [], []
        for seed in args.seeds:
            run_dir, took = train_run(overrides, seed, runs_dir, args.train_overrides)
            best.append(min(row["val"] for row in read_curve(run_dir)))
            seconds.append(took)
            model, _, _ = load_model(run_dir / "best.pt", "cpu")
            models.append(model)
            cache = new_cache(model, cache_name, STREAMS)
            through.append(decoder_loss(model, streams, prompt_len=args.prompt_len, cache=cache))
            forced.append(teacher_forced_loss(model, streams, prompt_len=args.prompt_len))
        model = models[0]
        tok_s = {b: [b * STEPS / decode_seconds(model, new_cache(model, cache_name, b))
                     for _ in range(args.repeats)] for b in BATCHES}
        timed = [s for s in seconds if s is not None]
        per_token = bytes_per_token(model, cache_name)
        points.append(dict(label=key, bytes=per_token, loss=statistics.median(through), low=min(through),
                           high=max(through), cache=cache_name != "float"))
        print(f"| {name} | {model.num_params():,} | {per_token:,.0f} | "
              f"{median_spread(best, 4)} | {median_spread(through, 4)} | {median_spread(forced, 4)} | "
              f"{median_spread(timed, 0) if timed else 'reused'} | {rate(tok_s[1])} | {rate(tok_s[64])} |", flush=True)
        if cache_name == "float":
            gaps = [abs(a - b) for a, b in zip(through, forced)]
            print(f"|  | decoder - teacher-forced, largest over seeds: {max(gaps):.2e} | | | | | | | |")
    print(f"\nruns in {runs_dir}")
    if args.plot:
        plots.designs(args.plot, points, len(args.seeds),
                      "What a design costs and saves: KV-cache bytes against loss",
                      f"python train.py preset=cpu {' '.join(args.train_overrides)}, seeds "
                      f"{' '.join(map(str, args.seeds))}: {host()}, {datetime.date.today().isoformat()}")
        print(f"picture: {args.plot}")


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="part", required=True)
    s = sub.add_parser("speed", help="classic shape, random weights")
    s.add_argument("--repeats", type=positive_int, default=5)
    s.add_argument("--compile", action="store_true", help="torch.compile each design's one-token step")
    s.add_argument("--designs", nargs="+", choices=list(CLASSIC), default=list(CLASSIC),
                   help="the designs to time (default: all; MHA always, for the ratios)")
    t = sub.add_parser("train", help="each design trained with the cpu preset")
    t.add_argument("--seeds", type=training_seed, nargs="+", default=[1337])
    t.add_argument("--runs-dir", type=Path, help="keep the runs here; reuse those already trained")
    t.add_argument("--repeats", type=positive_int, default=5)
    t.add_argument("--designs", nargs="+", choices=list(TRAINED), default=list(TRAINED),
                   help="the designs to train and measure (default: all; int8, int4 and int2 decode the preset's "
                        "runs)")
    t.add_argument("--plot", type=plots.plot_file, metavar="FILE.png", help="draw the picture into this file")
    t.add_argument("--prompt-len", type=positive_int, default=64, help="tokens prefilled before one-token decoding")
    t.add_argument("--stream-len", type=positive_int, default=1_000_000, help="cut each stream to this many tokens")
    t.add_argument("--train-overrides", nargs="*",
                   default=["train.max_iters=1000", "optim.decay_frac=1", "model.n_layer=4"],
                   help="train.py overrides for every design (default: the same 1,000 steps for each, rather than "
                        "the steps the preset's time budget buys, decaying from the warm-up's end, on 4 layers)")
    args = parser.parse_args()
    speed(args) if args.part == "speed" else train(args)


if __name__ == "__main__":
    run_tool(main)
