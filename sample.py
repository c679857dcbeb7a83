"""Sample text from a trained kvgpt checkpoint, decoding one token at a time with a KV cache.

    python sample.py                                   # newest run's best.pt, prompt "\\n"
    python sample.py --prompt "ROMEO:" --max-new-tokens 300 --temperature 0.7 --top-k 40
    python sample.py --checkpoint runs/2024-05-01_12-00-00 --num-samples 3 --seed 1
    python sample.py --temperature 0 --no-kv-cache     # greedy, recomputing everything at every step
    python sample.py --precision int8                  # int8 weights, quantized when loaded: fastest on CPU

Text streams to the terminal as it is generated; piped or redirected, each sample is written whole at
the end. A one-line summary (tokens, seconds, tokens/s, cache size) goes to stderr. Every mistake in
the command line or its inputs is reported as one line on stderr with exit status 2, as is an output that
cannot be written (a full disk); a reader that stops early (`| head`) ends sampling quietly.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from data import CharVocab, UnknownCharacterError
from model import KVCache, Sampling, generate_tokens
from model.quantize import PRECISIONS
from training.checkpoint import CheckpointError, load_model, resolve_checkpoint
from training.devices import choose_device
from training.runs import find_latest_checkpoint

SAMPLE_SEPARATOR = "---------------\n"
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
MEMORY_SHARE = 0.5  # the largest share of the device's memory that the samples' KV cache may take


class UsageError(Exception):
    """A mistake in the command line or its inputs; main() reports it as one line, exit status 2."""


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message):
        # argparse would print the whole usage block first; one line reads the same as our own errors.
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description="Sample text from a trained kvgpt checkpoint.")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT", default="\n", help="text to continue (default: a newline)")
    prompt.add_argument("--prompt-file", metavar="PATH", type=Path, help="read the prompt from this UTF-8 file")
    parser.add_argument("--checkpoint", metavar="PATH", type=Path,
                        help="checkpoint file or run directory (default: the newest best.pt under ./runs)")
    parser.add_argument("--max-new-tokens", metavar="N", type=int, default=500,
                        help="characters to generate (default: %(default)s)")
    parser.add_argument("--temperature", metavar="T", type=float, default=0.8,
                        help="0 means greedy (default: %(default)s)")
    parser.add_argument("--top-k", metavar="K", type=int, help="sample only from the K likeliest characters")
    parser.add_argument("--top-p", metavar="P", type=float,
                        help="sample only from the fewest likeliest characters whose probabilities reach P")
    parser.add_argument("--num-samples", metavar="N", type=int, default=1,
                        help="samples, generated together as one batch (default: %(default)s)")
    parser.add_argument("--seed", metavar="S", type=int, help="random seed, for reproducible samples")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"), default="auto",
                        help="auto: cuda, else mps, else cpu (default: %(default)s)")
    parser.add_argument("--no-kv-cache", action="store_true",
                        help="recompute the whole context at every step (slow; for comparison)")
    parser.add_argument("--window", metavar="N", type=int,
                        help="context tokens kept when it grows past block_size, 1..block_size "
                             "(default: the model's, block_size // 2; block_size is the classic crop)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="decode with the weights as trained (fp32), in bf16, or with int8 weights "
                             "quantized when loaded (default: %(default)s)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the one-token decode step (the first steps pay for compiling)")
    return parser


def sampling_from(args) -> Sampling:
    """The model's own sampling rules, their errors named by option."""
    try:
        return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as e:
        option, _, rest = str(e).partition(" must ")
        raise UsageError(f"--{option.replace('_', '-')} must {rest}") from None


def check_args(args) -> None:
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.num_samples < 1:
        raise UsageError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed must be in [0, {MAX_SEED}], got {args.seed}")
    if args.compile and args.no_kv_cache:
        raise UsageError("--compile compiles the cached one-token step, which --no-kv-cache does not use; "
                         "drop one of them")


def check_memory(num_samples: int, model, device: torch.device) -> None:
    """Refuse up front a batch whose KV cache alone would not fit, rather than run out of memory midway. Without
    the cache, the forward passes hold at least as much."""
    c = model.config
    per_sample = KVCache(c.n_layer, 1, c.n_head, c.block_size, c.n_embd // c.n_head, dtype=model.wte.weight.dtype,
                         device="meta").nbytes  # sizes only, nothing allocated
    if device.type == "cuda":
        memory = torch.cuda.mem_get_info(device)[1]
    else:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if num_samples * per_sample > MEMORY_SHARE * memory:
        most = max(1, int(MEMORY_SHARE * memory // per_sample))
        raise UsageError(f"--num-samples {num_samples} needs {num_samples * per_sample / 2**30:.1f} GiB of KV cache, "
                         f"more than {MEMORY_SHARE:.0%} of the {memory / 2**30:.1f} GiB of {device.type} memory; "
                         f"use at most {most}")


def read_prompt(args) -> str:
    if args.prompt_file is None:
        if not args.prompt:
            raise UsageError("--prompt is empty; give at least one character to continue from")
        return args.prompt
    try:
        prompt = args.prompt_file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--prompt-file {args.prompt_file} is not UTF-8 text") from None
    except OSError as e:
        raise UsageError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror or e}") from None
    if not prompt:
        raise UsageError(f"--prompt-file {args.prompt_file} is empty; give at least one character")
    return prompt


def encode_prompt(vocab: CharVocab, prompt: str) -> list[int]:
    try:
        return vocab.encode(prompt)
    except UnknownCharacterError as e:
        unknown = ", ".join(repr(c) for c in e.chars)
        raise UsageError(f"the prompt has characters not in the checkpoint's vocabulary: {unknown}; "
                         f"the vocabulary is {vocab.chars!r}") from None


def stream_sample(steps, prompt: str, vocab: CharVocab, out) -> None:
    """Write one sample as it is generated; reading each token back is the one sync that printing needs."""
    out.write(prompt)
    out.flush()
    for next_ids in steps:
        out.write(vocab.decode([next_ids.item()]))
        out.flush()
    out.write("\n")


def collect_samples(steps, prompt: str, vocab: CharVocab, num_samples: int) -> list[str]:
    """Every sample's text; the tokens stay on the device until the end, so no step waits for a sync."""
    new_ids = list(steps)
    rows = torch.stack(new_ids, dim=1).tolist() if new_ids else [[]] * num_samples
    return [prompt + vocab.decode(row) for row in rows]


def prepare(args):
    """Everything the sampling needs, checked: (sampling, device, prompt, its ids, checkpoint path, model, vocab).
    Every mistake is a UsageError or a CheckpointError."""
    check_args(args)
    sampling = sampling_from(args)
    try:
        device = choose_device(args.device)
    except ValueError as e:
        raise UsageError(f"--device {e}") from None
    prompt = read_prompt(args)
    # without --checkpoint: the newest under the working directory, where train.py writes
    checkpoint_path = resolve_checkpoint(args.checkpoint) if args.checkpoint else find_latest_checkpoint("runs")
    model, vocab, _ = load_model(checkpoint_path, device, precision=args.precision)
    prompt_ids = encode_prompt(vocab, prompt)
    block_size = model.config.block_size
    if args.window is not None and not 1 <= args.window <= block_size:
        raise UsageError(f"--window must be in [1, {block_size}] (the model's block_size), got {args.window}")
    check_memory(args.num_samples, model, device)
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        raise UsageError("standard output is closed; send it to a file or a pipe")
    return sampling, device, prompt, prompt_ids, checkpoint_path, model, vocab


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        sampling, device, prompt, prompt_ids, checkpoint_path, model, vocab = prepare(args)
    except (UsageError, CheckpointError) as e:
        parser.error(str(e))

    generator = torch.Generator(device)
    if args.seed is None:
        generator.seed()  # a new generator starts from the same fixed seed every time; draw a random one
    else:
        generator.manual_seed(args.seed)
    use_cache = not args.no_kv_cache
    cache = model.new_kv_cache(args.num_samples) if use_cache else None
    idx = torch.tensor([prompt_ids] * args.num_samples, dtype=torch.long, device=device)
    steps = generate_tokens(model, idx, args.max_new_tokens, sampling=sampling, generator=generator,
                            window=args.window, use_cache=use_cache, cache=cache, compile=args.compile)

    # The samples of a batch grow side by side, so only a lone sample can stream legibly.
    stream = args.num_samples == 1 and sys.stdout.isatty()
    start = time.perf_counter()
    try:
        if stream:
            stream_sample(steps, prompt, vocab, sys.stdout)
        else:
            samples = collect_samples(steps, prompt, vocab, args.num_samples)
        seconds = time.perf_counter() - start
        if not stream:
            sys.stdout.write(SAMPLE_SEPARATOR.join(sample + "\n" for sample in samples))
        sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C ends a long sample early, without a traceback
        if stream:
            print()
        return 130
    except BrokenPipeError:  # the reader stopped early (`| head`): nothing more is wanted
        silence_stdout()
        return 0
    except OSError as e:  # a full disk, ...
        silence_stdout()
        print(f"{parser.prog}: error: cannot write the samples to standard output ({e.strerror or e})",
              file=sys.stderr)
        return 2

    tokens = args.num_samples * args.max_new_tokens
    cache_size = f"KV cache {cache.nbytes / 2**20:.2f} MiB" if use_cache else "no cache"
    print(f"{tokens} tokens in {seconds:.2f} s, {tokens / max(seconds, 1e-9):.1f} tokens/s, {cache_size} "
          f"({device.type}, {checkpoint_path})", file=sys.stderr)
    return 0


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that the flush at exit does not fail a second time on what is left unwritten."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
