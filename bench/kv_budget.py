"""The KV budget harness: one trained checkpoint, several caches, one table of what each costs.

    python bench/kv_budget.py --checkpoint runs/RUN/best.pt                # every cache
    python bench/kv_budget.py --checkpoint runs/RUN --caches float int4    # only these
    python bench/kv_budget.py --checkpoint runs/RUN --caches window sinks --budgets 0.5 0.25

The caches (model/caches/factory.py): float (the reference), int8, int4 and int2, and a budget of slots as a fraction
of block_size: window (the last tokens only), sinks (the first few tokens, then the last ones), and, for rotary
models, h2o and tova (each head keeps the tokens it attends most) and merge (tova's choice, merged into what stays).

Each cache decodes the val split of the checkpoint's text through the real decoding loop (generate_tokens, fed the
text's own tokens: model/measuring/decoder_loss.py), STREAMS streams side by side, a prompt of --prompt-len tokens and
then one token per step. Against the float cache, per cache:
- loss through the decoder, the KL divergence of each step's next-token distribution from the float cache's (mean
  and 99th percentile, in nats), and how often the most likely token is the same (top-1 agreement);
- loss by distance into a stream: its first block_size tokens, and the block_size tokens from 2, 4 and 8 x
  block_size on;
- recall: a random string of RECALL_LEN letters, placed early in a block_size-token stream and repeated at its
  end; the loss and top-1 accuracy of the repeat after its first RECALL_CUE letters. A cache that keeps what
  matters keeps the first copy; one that keeps only the recent tokens loses it;
- bytes the cache holds per row, and decode tokens/s at batch 1 and 64 with the context full.

Python API: stream_log_probs(model, tokens, cache, prompt_len) gives every step's log-probabilities,
compare(reference, log_probs, targets, ...) the figures above, and recall_text and recall the recall task's.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import host, run_tool  # noqa: E402
from bench.kv_designs import BATCHES, STEPS, STREAMS, decode_seconds, rate  # noqa: E402
from model.decoding.generate import generate_tokens  # noqa: E402
from model.caches.factory import BUDGETED, CACHES, LOWBIT, new_cache  # noqa: E402
from runtime.checkpoint import existing_checkpoint, load_model, training_text  # noqa: E402
from runtime.errors import OneLineErrorParser, UsageError, positive_int  # noqa: E402

DISTANCES = (0, 2, 4, 8)  # loss over the block_size tokens from each multiple of block_size into a stream
RECALL_LEN, RECALL_CUE, RECALL_AT = 12, 2, 16  # the random string, the letters of its repeat given, where it starts


class Recorder:
    """In place of a Sampling: feeds the text's own next tokens, and keeps each step's log-probabilities."""

    def __init__(self, targets: torch.Tensor):
        self.targets, self.steps = targets, []

    def next_token(self, logits, generator=None):
        self.steps.append(logits.float().log_softmax(dim=-1))
        return self.targets[:, len(self.steps) - 1]


@torch.no_grad()
def stream_log_probs(model, tokens: torch.Tensor, cache, prompt_len: int) -> torch.Tensor:
    """(B, N - prompt_len, vocab) log-probabilities of each next token of tokens (B, N) as cached decoding computes
    them through `cache`, after a prompt of prompt_len tokens."""
    recorder = Recorder(tokens[:, prompt_len:])
    for _ in generate_tokens(model, tokens[:, :prompt_len], tokens.size(1) - prompt_len, sampling=recorder,
                             cache=cache):
        pass
    return torch.stack(recorder.steps, dim=1)


def compare(reference: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor, prompt_len: int,
            block_size: int) -> dict:
    """What a cache's log-probabilities (B, S, vocab) cost against the reference's, for targets (B, S)."""
    kl = (reference.exp() * (reference - log_probs)).sum(dim=-1).flatten()  # KL(reference ‖ cache) per step
    loss = -log_probs.gather(-1, targets[..., None])[..., 0]  # (B, S)
    figures = {"loss": loss.mean().item(), "kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(),
               "top1": (reference.argmax(-1) == log_probs.argmax(-1)).float().mean().item()}
    for k in DISTANCES:  # step j predicts the token at position prompt_len + j
        first, last = max(k * block_size - prompt_len, 0), (k + 1) * block_size - prompt_len
        figures[f"loss@{k}x"] = loss[:, first:last].mean().item() if last <= loss.size(1) else None  # not reached
    return figures


def recall_text(val: torch.Tensor, letters: list[int], rows: int, block_size: int, seed: int = 0) -> torch.Tensor:
    """(rows, block_size) tokens: val text, with one random string of RECALL_LEN letters per row at RECALL_AT and
    again at the end, where every layer still sees the first copy."""
    g = torch.Generator().manual_seed(seed)
    letters = torch.tensor(letters)
    tokens = val[:rows * block_size].view(rows, block_size).clone()
    string = letters[torch.randint(0, len(letters), (rows, RECALL_LEN), generator=g)]
    tokens[:, RECALL_AT:RECALL_AT + RECALL_LEN] = string
    tokens[:, -RECALL_LEN:] = string
    return tokens


def recall(log_probs: torch.Tensor, tokens: torch.Tensor, prompt_len: int) -> tuple[float, float]:
    """The loss and top-1 accuracy of the repeat's letters after its first RECALL_CUE, from log-probabilities of
    tokens[:, prompt_len:]."""
    first = tokens.size(1) - RECALL_LEN + RECALL_CUE - prompt_len
    log_probs, targets = log_probs[:, first:], tokens[:, prompt_len + first:]
    loss = -log_probs.gather(-1, targets[..., None]).mean().item()
    return loss, (log_probs.argmax(-1) == targets).float().mean().item()


def fraction_of_block(text: str) -> float:
    """An argparse type: a budget as a fraction of block_size, above 0 and at most 1 (the full cache's slots)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction of block_size in (0, 1], got {text}")
    return value


def check_lengths(val_len: int, block: int, prompt_len: int, stream_len: int) -> None:
    """Refuse a prompt that leaves nothing to decode, and a text or context too short for the recall task."""
    streamed = min(val_len // STREAMS, stream_len)
    if prompt_len >= streamed:
        raise UsageError(f"--prompt-len {prompt_len} leaves nothing to decode in streams of {streamed} tokens "
                         f"(--stream-len {stream_len}, the val split's {val_len} tokens in {STREAMS} streams); "
                         f"give a --prompt-len below {streamed}")
    if block < RECALL_AT + 2 * RECALL_LEN or val_len < STREAMS * block:
        raise UsageError(f"the recall task needs block_size >= {RECALL_AT + 2 * RECALL_LEN} and a val split of "
                         f"{STREAMS} x block_size tokens; this checkpoint has block_size {block} and {val_len} "
                         "val tokens")


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=existing_checkpoint, required=True, help="a run directory or .pt file")
    parser.add_argument("--caches", nargs="+", choices=list(CACHES),
                        help="default: every one the model can use (h2o, tova and merge need rotary positions)")
    parser.add_argument("--prompt-len", type=positive_int, default=64)
    parser.add_argument("--stream-len", type=positive_int, default=1_000_000,
                        help="cut each stream to this many tokens")
    parser.add_argument("--group", type=positive_int, help="the int4 and int2 caches' group (default: theirs)")
    parser.add_argument("--residual", type=positive_int,
                        help="the int4 and int2 caches' recent tokens in full precision (default: theirs)")
    parser.add_argument("--budgets", type=fraction_of_block, nargs="+", default=[0.5, 0.25, 0.125],
                        help=f"{', '.join(BUDGETED)}: slots as fractions of block_size")
    parser.add_argument("--repeats", type=positive_int, default=5, help="decode speed: median (min-max) of these")
    args = parser.parse_args()
    model, vocab, contents = load_model(args.checkpoint, "cpu")
    lowbit = {key: value for key, value in (("group", args.group), ("residual", args.residual)) if value}
    block = model.config.block_size

    def cache(name, batch_size, budget=None):
        return new_cache(model, name, batch_size, budget=budget, **(lowbit if name in LOWBIT else {}))

    policies = [(name, budget) for name in args.caches or CACHES
                for budget in ([round(f * block) for f in args.budgets] if name in BUDGETED else [None])]
    usable = []
    for name, budget in policies:  # a cache named and refused stops the run before anything is measured
        try:
            cache(name, 1, budget)
            usable.append((name, budget))
        except ValueError as e:
            if args.caches:
                raise UsageError(f"--caches {name}{f' at a budget of {budget} slots' if budget else ''}: {e}") \
                    from None
    policies = usable
    val = training_text(contents).val
    check_lengths(len(val), block, args.prompt_len, args.stream_len)
    n = len(val) // STREAMS * STREAMS
    tokens = torch.from_numpy(val[:n].astype("int64")).view(STREAMS, -1)[:, :args.stream_len]
    targets = tokens[:, args.prompt_len:]
    reference = stream_log_probs(model, tokens, cache("float", STREAMS), args.prompt_len)
    letters = vocab.encode("".join(c for c in "abcdefghijklmnopqrstuvwxyz" if c in vocab.chars))
    recalled = recall_text(torch.from_numpy(val.astype("int64")), letters, STREAMS, block)
    print(f"# KV caches of {args.checkpoint} ({model.config.pos_emb} positions, block_size {block}): {host()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; {STREAMS} val streams of {tokens.size(1)} "
          f"tokens, prompt {args.prompt_len}; low-bit caches {lowbit or 'as default'}; KL from the float cache's "
          f"distribution; decode median (min-max) of {args.repeats}")
    print("| cache | bytes per row | loss through the decoder | KL mean | KL p99 | top-1 agreement | "
          + " | ".join(f"loss from {k} x block_size" for k in DISTANCES)
          + " | recall loss | recall top-1 | tok/s batch 1 | tok/s batch 64 |")
    print("|---" * (10 + len(DISTANCES)) + "|")
    for name, budget in policies:
        log_probs = reference if name == "float" else stream_log_probs(
            model, tokens, cache(name, STREAMS, budget), args.prompt_len)
        f = compare(reference, log_probs, targets, args.prompt_len, block)
        recall_loss, recall_top1 = recall(stream_log_probs(model, recalled, cache(name, STREAMS, budget),
                                                           RECALL_AT), recalled, RECALL_AT)
        speed = {b: [b * STEPS / decode_seconds(model, cache(name, b, budget)) for _ in range(args.repeats)]
                 for b in BATCHES}
        label = name if budget is None else f"{name}, {budget} slots"
        print(f"| {label} | {cache(name, 1, budget).nbytes:,} | {f['loss']:.4f} | {f['kl_mean']:.2e} | "
              f"{f['kl_p99']:.2e} | {f['top1']:.2%} | " + " | ".join(
                  "-" if f[f"loss@{k}x"] is None else f"{f[f'loss@{k}x']:.4f}" for k in DISTANCES)
              + f" | {recall_loss:.3f} | {recall_top1:.0%} | {rate(speed[1])} | {rate(speed[64])} |", flush=True)


if __name__ == "__main__":
    run_tool(main)
