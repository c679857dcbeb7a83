"""Decoding past the context: a rotary model's rolling KV cache against a learned-position model's refills.

    python bench/rolling.py                                   # speed, the classic shape, batch 1, 1,024 new tokens
    python bench/rolling.py --checkpoint runs/<rope run>      # also the val loss through the rolling cache

Speed. Random weights of the classic shape (conf/model/classic.yaml), fp32 unless --precision, greedy, a 16-token
prompt and 1,024 new tokens, so that 240 come inside the first block_size (256) and 784 past it. Each token's
time is taken as it is yielded. Per repeat, in this order: the rotary model (its cache rolls), the learned model
with its default keep (a refill of block_size // 2 tokens every 129 tokens, so it sees 128-256 tokens), and
the learned model with keep = block_size (a refill at every token: the classic crop, every token sees 256).
Ratios are taken within each repeat; the table gives the median (min-max) over --repeats.

Quality (--checkpoint, a rope checkpoint): training sees windows of block_size tokens, while the rolling cache
sees every token's last block_size tokens through keys that themselves saw further back. On the val split
of the text it was trained on, over the same tokens, all past the first block_size of their stretch:
the loss through the rolling cache, and the loss of a full forward over exactly the block_size tokens ending at
each one (the crop). A third figure is the loss as training measures it: every position of block_size windows.
"""

import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import median_spread, model_config, run_tool  # noqa: E402
from bench.decode import PROMPT_LEN  # noqa: E402
from model import GREEDY, build_model, generate_tokens  # noqa: E402
from model.decoding.quantize import DECODING_PRECISIONS, to_precision  # noqa: E402
from runtime.checkpoint import existing_checkpoint, load_model, training_text  # noqa: E402
from runtime.errors import OneLineErrorParser, UsageError, positive_int  # noqa: E402
from model.caches.factory import new_kv_cache

ROLLING_NEW_TOKENS = 1024  # 240 inside the first block_size, 784 past it
PAST = 512  # the quality figures: tokens scored past the first block_size of each stretch


def token_times(model, prompt, keep=None) -> list[float]:
    """The perf_counter time at which each new token was yielded (greedy), the prompt's start first."""
    times = [time.perf_counter()]
    for _ in generate_tokens(model, prompt, ROLLING_NEW_TOKENS, sampling=GREEDY, keep=keep):
        times.append(time.perf_counter())
    return times


def rate(times: list[float], first: int, last: int) -> float:
    """tokens/s of new tokens first..last-1 (0-based)."""
    return (last - first) / (times[last] - times[first])


def speed(precision: str, repeats: int) -> None:
    torch.manual_seed(0)
    learned_config = model_config("classic")
    rope_config = dataclasses.replace(learned_config, pos_emb="rope")
    models = {name: to_precision(build_model(config), precision) for name, config in
              (("rope", rope_config), ("learned", learned_config))}
    block = learned_config.block_size
    inside = block - PROMPT_LEN  # new tokens that fit in the first block_size
    prompt = torch.randint(0, learned_config.vocab_size, (1, PROMPT_LEN))
    for model in models.values():  # warm-up: allocations and kernel choice
        list(generate_tokens(model, prompt, 8, sampling=GREEDY))
    print(f"# rolling-cache benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads, classic shape, "
          f"{precision}, batch 1, prompt {PROMPT_LEN}, {ROLLING_NEW_TOKENS} new ({inside} inside block_size {block}, "
          f"{ROLLING_NEW_TOKENS - inside} past it), greedy, median (min-max) of {repeats}")
    rows = {key: [] for key in ("rope inside", "rope past", "learned default past", "learned crop past")}
    for _ in range(repeats):
        rope = token_times(models["rope"], prompt)
        default = token_times(models["learned"], prompt)
        crop = token_times(models["learned"], prompt, keep=block)
        rows["rope inside"].append(rate(rope, 1, inside))
        rows["rope past"].append(rate(rope, inside, ROLLING_NEW_TOKENS))
        rows["learned default past"].append(rate(default, inside, ROLLING_NEW_TOKENS))
        rows["learned crop past"].append(rate(crop, inside, ROLLING_NEW_TOKENS))
    ratios = {
        "rope past / rope inside (target >= 0.95)": ("rope past", "rope inside"),
        "rope past / learned crop past (target >= 3)": ("rope past", "learned crop past"),
        "rope past / learned default past (target >= 1)": ("rope past", "learned default past"),
    }
    print("| decoding | tok/s |\n|---|---|")
    for key, values in rows.items():
        print(f"| {key} | {median_spread(values, 1)} |")
    print("\n| ratio, within each repeat | median (min-max) |\n|---|---|")
    for name, (a, b) in ratios.items():
        print(f"| {name} | {median_spread([x / y for x, y in zip(rows[a], rows[b])], 2)} |")


def rope_model(checkpoint: Path) -> tuple:
    """The checkpoint's model and its text's val split; a UsageError where the rolling cache cannot measure them."""
    model, _, contents = load_model(checkpoint)
    if model.config.pos_emb != "rope":
        raise UsageError(f"--checkpoint {checkpoint} has learned positions; the rolling cache needs model.pos_emb=rope")
    val = torch.from_numpy(training_text(contents).val.astype("int64"))
    if len(val) <= model.config.block_size + PAST:
        raise UsageError(f"--checkpoint {checkpoint}: its val split of {len(val)} tokens is too short for block_size "
                         f"+ {PAST} tokens")
    return model, val


@torch.no_grad()
def rolling_quality(checkpoint: Path, model, val: torch.Tensor, stretches: int = 8, past: int = PAST) -> None:
    block = model.config.block_size
    length = block + past
    starts = torch.linspace(0, len(val) - length - 1, stretches).long()
    seq = torch.stack([val[s:s + length + 1] for s in starts])  # (stretches, length + 1): inputs and targets
    targets = seq[:, block:length + 1]  # the next token after each of the last `past` positions

    cache = new_kv_cache(model, stretches)
    logits = [model.decode_step(seq[:, :block], cache)]
    logits += [model.decode_step(seq[:, t:t + 1], cache) for t in range(block, length)]
    rolling = F.cross_entropy(torch.stack(logits, dim=1).flatten(0, 1), targets.flatten()).item()

    windows = seq[:, :length].unfold(1, block, 1)[:, :past + 1]  # (stretches, past + 1, block): the crop
    crop_logits = torch.cat([model(w)[0][:, -1] for w in windows.flatten(0, 1).split(256)])
    crop = F.cross_entropy(crop_logits, targets.flatten()).item()

    chunks = seq[:, :block * (length // block) + 1]
    x, y = chunks[:, :-1].reshape(-1, block), chunks[:, 1:].reshape(-1, block)
    trained = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()).item()
    print(f"\nval loss of {checkpoint}: {stretches} stretches of the val split, the last {past} tokens of each")
    print("| how each token is predicted | val loss |\n|---|---|")
    print(f"| rolling cache (each token sees its last {block}, earlier layers further) | {rolling:.4f} |")
    print(f"| crop: a forward over exactly its last {block} tokens | {crop:.4f} |")
    print(f"| as in training: every position of {block}-token windows (1 to {block} tokens of context) | {trained:.4f} |")


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--precision", choices=DECODING_PRECISIONS, help="the speed's weights (default: fp32)")
    parser.add_argument("--checkpoint", type=existing_checkpoint,
                        help="a rope checkpoint: val loss through the rolling cache")
    parser.add_argument("--no-speed", action="store_true", help="only the --checkpoint quality figures")
    args = parser.parse_args()
    if args.no_speed and not args.checkpoint:
        parser.error("--no-speed leaves nothing to measure without --checkpoint")
    if args.no_speed and args.precision:
        parser.error("--precision sets the speed's weights, and --no-speed measures no speed: drop one")
    checked = rope_model(args.checkpoint) if args.checkpoint else None  # refused before any output
    if not args.no_speed:
        speed(args.precision or "fp32", args.repeats)
    if checked:
        rolling_quality(args.checkpoint, *checked)


if __name__ == "__main__":
    run_tool(main)
