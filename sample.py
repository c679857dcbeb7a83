"""Sample text from a trained kvgpt checkpoint, decoding one token at a time with a KV cache.

    python sample.py                                   # newest run's best.pt, prompt "\\n"
    python sample.py --prompt "ROMEO:" --max-new-tokens 300 --temperature 0.7 --top-k 40
    python sample.py --checkpoint runs/2024-05-01_12-00-00 --num-samples 3 --seed 1
    python sample.py --temperature 0 --no-kv-cache     # greedy, recomputing everything at every step
    python sample.py --precision int8                  # int8 weights, quantized when loaded: fastest on CPU
    python sample.py --kv-cache int8                   # int8 keys and values: about a quarter of the cache
    python sample.py --temperature 0 --draft lookup    # speculative decoding: the same text, fewer model passes
    python sample.py --draft ngram --temperature 0.8   # ... drafts from the training text's character counts
    python sample.py --draft runs/<small run> --speculate-k 4   # ... with a smaller checkpoint as the draft
    python sample.py --interactive --temperature 0     # type a line, the model continues the text; Ctrl-D ends

First, stderr says which checkpoint is sampled: its step, best val loss and the text it was trained on. A lone
sample is written as it is generated (to a terminal token by token, elsewhere every CHUNK tokens); samples
generated side by side are written one after another at the end. Ctrl-C writes what was generated and exits
with status 130. A one-line summary (tokens, seconds, tokens/s, precision, the cache's size and dtype) ends
stderr (with speculative decoding also the draft's acceptance rate and the tokens per model pass).
--interactive reads lines instead (see interact). A mistake in the command line or its inputs is one line on
stderr with exit status 2; an output that cannot be written (a full disk) is one line with status 1; a reader
that stops early (`| head`) ends sampling quietly.
"""

import argparse
import contextlib
import itertools
import math
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from data import CharVocab, DataError, UnknownCharacterError, read_regular_file
from model import GPT, Sampling, generate_tokens, kv_cache_bytes
from model.labs.caches import BUDGETED, CACHES, EAGER, new_cache
from model.labs.cached_text import text_cache
from model.labs.conversation import Conversation
from model.labs.engine import Engine
from model.labs.generate import check_arguments
from model.labs.ngram_draft import NGramTable
from model.labs.speculative import PromptLookup, SpeculativeStats, speculative_generate
from model.labs.quantize import DECODING_PRECISIONS
from model.labs.ring_cache import kv_cache_dtype
from runtime.compiled_step import COMPILE_PAYS_AFTER, DEVICES as STEP_DEVICES, has_compiled_step, load_or_compile_step
from runtime.checkpoint import find_latest_checkpoint, load_model, resolve_checkpoint, trained_on, training_text
from runtime.devices import (DEFAULT_THREADS, choose_device, environment_threads, fastest_threads, memory_of,
                              thread_counts)
from runtime.session import SessionError, load_session, save_session
from runtime.errors import (CheckpointError, OneLineErrorParser, UsageError, check_standard_streams, fail, mistakes,
                            one_line, silence)

SAMPLE_SEPARATOR = "---------------\n"
MAX_NEW_TOKENS = 500  # --max-new-tokens's default
MAX_GENERATOR_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
MEMORY_SHARE = 0.5  # the largest share of the device's memory that the samples' KV cache and tokens may take
EACH_LINE_BATCH, BLOCK_TOKENS = 16, 16  # --each-line: lines decoded at once, and tokens per block of the pool
CHUNK = 64  # tokens read back from the device at once when the output is no terminal: each read is a sync
SPECULATE_K = 4  # --speculate-k's default
DECODE_TIMED = 16  # tokens decoded at each thread count to choose the fastest
REPLY_STOP = "\n\n"  # --interactive: a reply ends with a blank line (a speech's end, in a play)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description="Sample text from a trained kvgpt checkpoint.")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT", help="text to continue (default: a newline)")
    prompt.add_argument("--prompt-file", metavar="PATH", type=Path, help="read the prompt from this UTF-8 file")
    parser.add_argument("--checkpoint", metavar="PATH", type=Path,
                        help="checkpoint file or run directory (default: the newest best.pt under ./runs)")
    parser.add_argument("--max-new-tokens", metavar="N", type=int,
                        help=f"characters to generate (default: {MAX_NEW_TOKENS}; with --each-line, half of the "
                             f"model's block_size)")
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
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--no-kv-cache", action="store_true",
                       help="recompute the whole context at every step (slow; for comparison)")
    parser.add_argument("--window", metavar="N", type=int,
                        help="context tokens kept when it grows past block_size, 1..block_size "
                             "(default: the model's, block_size // 2; block_size is the classic crop)")
    parser.add_argument("--threads", metavar="N", type=int,
                        help="CPU threads (default: the count whose decoding is fastest now, timed at start)")
    parser.add_argument("--precision", choices=DECODING_PRECISIONS, default="fp32",
                        help="decode with the weights as trained (fp32), in bf16, or with int8 weights "
                             "quantized when loaded (default: %(default)s)")
    cache.add_argument("--compile", action=argparse.BooleanOptionalAction,
                       help="decode through a one-token step compiled ahead of time for the model's shape "
                            "(model/labs/aot_step.py), kept under ~/.cache/kvgpt (runtime/compiled_step.py); "
                            "compiling takes a minute or less (default: when one is kept, or for "
                            f"--max-new-tokens of {COMPILE_PAYS_AFTER} or more)")
    parser.add_argument("--kv-cache", choices=CACHES, help="how keys and values are stored: in the dtype "
                        "attention computes in (float, the default), int8 with a scale per token and head, "
                        "int4 / int2 in groups, the most recent tokens in float too; or --kv-budget slots: the "
                        "last tokens (window), the first few and the last (sinks), or, for rotary models, those "
                        "each head attends most (h2o, tova). See model/labs/caches.py")
    parser.add_argument("--kv-budget", metavar="SLOTS", type=int,
                        help=f"--kv-cache {', '.join(BUDGETED)}: the tokens the cache keeps (default: half of "
                             "block_size)")
    parser.add_argument("--read-all-slots", action="store_true",
                        help="attend every slot of the cache through the ring's mask (model/labs/ring_cache.py), "
                             "as compiled and GPU steps do (eagerly on the CPU the filled slots are read)")
    parser.add_argument("--draft", metavar="PATH|ngram|lookup",
                        help="speculative decoding: a checkpoint with the same vocabulary (a smaller model), "
                             "ngram (what followed the last few characters in the training text, counted) or "
                             "lookup (the text's own continuation of its last few characters) proposes "
                             "--speculate-k characters, which the model checks in one pass; the same text when "
                             "greedy, the same distribution when sampling")
    parser.add_argument("--speculate-k", metavar="K", type=int,
                        help=f"characters the draft proposes per model pass (default: {SPECULATE_K})")
    parser.add_argument("--interactive", action="store_true",
                        help="read lines from the terminal: each is added to the text and the model continues "
                             "it, up to --max-new-tokens characters or a blank line; Ctrl-C ends a reply, "
                             "Ctrl-D ends the session")
    parser.add_argument("--each-line", action="store_true",
                        help="continue each line of --prompt-file, the lines decoded together over one pool of KV "
                             "blocks (model/labs/engine.py); each is written, with its line, in the file's order")
    parser.add_argument("--session", metavar="FILE", type=Path,
                        help="--interactive: take up the conversation saved in FILE, its KV cache included, and "
                             "save it there when the session ends")
    return parser


def cache_for(args, model: GPT, rows: int):
    """The KV cache --kv-cache asks for, for rows rows."""
    try:
        return new_cache(model, args.kv_cache or "float", rows, budget=args.kv_budget,
                         read_all_slots=args.read_all_slots)
    except ValueError as e:  # a cache for a model it cannot serve, or a budget it cannot keep
        raise UsageError(f"--kv-cache {args.kv_cache}: {e}") from None


def check_memory(args, prompt_len: int, model, device: torch.device) -> None:
    """Refuse up front samples whose KV cache (as the decoder builds it) and tokens (the int64 sequence it fills)
    would not fit, rather than run out of memory midway. Without the cache, the forward passes hold at least as
    much."""
    kind = args.kv_cache or "float"
    block_size = model.config.block_size
    spare = (args.speculate_k or SPECULATE_K) if args.draft else 0  # slots for the drafts a pass verifies
    if spare > block_size:
        raise UsageError(f"--speculate-k must be at most the model's block_size, {block_size}: a pass verifies "
                         f"the drafts within one context; got {spare}")
    cache_bytes = cache_for(args, model, 1).nbytes if kind in EAGER else \
        kv_cache_bytes(model.config, kv_cache_dtype(model, torch.int8 if kind == "int8" else None), block_size + spare)
    per_sample = cache_bytes + (prompt_len + args.max_new_tokens) * torch.long.itemsize
    memory = memory_of(device)
    if args.num_samples * per_sample > MEMORY_SHARE * memory:
        most = int(MEMORY_SHARE * memory // per_sample)
        raise UsageError(f"--num-samples {args.num_samples} of --max-new-tokens {args.max_new_tokens} need "
                         f"{args.num_samples * per_sample / 2**30:.1f} GiB of KV cache and tokens, more than "
                         f"{MEMORY_SHARE:.0%} of the {memory / 2**30:.1f} GiB of {device.type} memory; "
                         + (f"use at most {most} samples" if most else "ask for fewer new tokens"))


def read_prompt(args) -> str:
    if args.prompt_file is None:
        if args.prompt == "":
            raise UsageError("--prompt is empty; give at least one character to continue from")
        return "\n" if args.prompt is None else args.prompt
    try:
        prompt = read_regular_file(args.prompt_file).decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--prompt-file {args.prompt_file} is not UTF-8 text") from None
    except DataError as e:
        raise UsageError(f"--prompt-file {e}") from None
    except OSError as e:
        raise UsageError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror or e}") from None
    if not prompt:
        raise UsageError(f"--prompt-file {args.prompt_file} is empty; give at least one character")
    return prompt


def encode_prompt(vocab: CharVocab, prompt: str, what: str = "the prompt") -> list[int]:
    try:
        return vocab.encode(prompt)
    except UnknownCharacterError as e:
        unknown = ", ".join(repr(c) for c in e.chars)
        raise UsageError(f"{what} has characters not in the checkpoint's vocabulary: {unknown}; "
                         f"the vocabulary is {vocab.chars!r}") from None


def check_combinations(args) -> None:
    """Refuse options that cannot apply together, naming them."""
    one_row = {"--draft": args.draft, "--interactive": args.interactive, "--each-line": args.each_line}
    plain_decoding = {"--no-kv-cache": args.no_kv_cache, "--kv-cache": args.kv_cache,
                      "--read-all-slots": args.read_all_slots, "--num-samples": args.num_samples != 1}
    if args.speculate_k is not None and not args.draft:
        raise UsageError("--speculate-k applies to speculative decoding: give --draft too")
    if args.speculate_k is not None and args.speculate_k < 1:
        raise UsageError(f"--speculate-k must be >= 1, got {args.speculate_k}")
    if args.compile and args.kv_cache in EAGER:
        raise UsageError(f"--kv-cache {args.kv_cache} decodes eagerly: drop --compile")
    if args.compile and args.device not in ("auto", *STEP_DEVICES):
        raise UsageError(f"--compile builds steps for {' or '.join(STEP_DEVICES)}, not --device {args.device}: "
                         f"drop --compile")
    if args.read_all_slots and args.kv_cache in BUDGETED:
        raise UsageError(f"--read-all-slots applies to the ring; --kv-cache {args.kv_cache} reads its own slots: "
                         f"drop one of them")
    if args.kv_budget is not None and args.kv_cache not in BUDGETED:
        raise UsageError(f"--kv-budget applies to --kv-cache {', '.join(BUDGETED)}: give one of them, or drop "
                         f"--kv-budget")
    if args.session and not args.interactive:
        raise UsageError("--session saves an --interactive conversation: give --interactive too")
    if args.session and not args.session.parent.is_dir():
        raise UsageError(f"--session {args.session}: no folder {args.session.parent} to save it in; make it first")
    if args.draft and args.interactive:
        raise UsageError("--draft applies to sampling, not to --interactive: drop one of them")
    if args.compile and args.each_line:
        raise UsageError("--compile applies to plain, --draft and --interactive decoding, not to --each-line: drop "
                         "one of them")
    if args.each_line and (args.prompt_file is None or args.draft or args.interactive):
        raise UsageError("--each-line continues the lines of --prompt-file, without --draft or --interactive")
    if args.each_line and args.window is not None:
        raise UsageError("--window moves a long generation's context; --each-line keeps each line and its "
                         "continuation within block_size: drop --window")
    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens: max_new_tokens must be an integer >= 0, got {args.max_new_tokens}")
    if args.interactive and sys.stdin is None:
        raise UsageError("--interactive reads lines from standard input, which is closed; give it a terminal or a "
                         "file")
    for mode, on in one_row.items():
        for option, given in plain_decoding.items():
            if on and given:
                raise UsageError(f"{option} applies to plain decoding, not to {mode}: drop one of them")


def load_draft(args, model: GPT, vocab: CharVocab, contents: dict,
               device: torch.device) -> GPT | NGramTable | PromptLookup:
    if args.draft == "lookup":
        return PromptLookup()
    if args.draft == "ngram":
        try:
            data = training_text(contents)
        except DataError as e:
            raise UsageError(f"--draft ngram counts the text the checkpoint was trained on: {one_line(e)}; use "
                             f"--draft lookup or a draft checkpoint") from None
        return NGramTable(torch.from_numpy(data.train.astype("int64")), model.config.vocab_size)
    try:
        draft, draft_vocab, _ = load_model(resolve_checkpoint(Path(args.draft)), device, precision=args.precision)
    except CheckpointError as e:
        raise UsageError(f"--draft: {one_line(e)}") from None
    if draft_vocab != vocab:
        raise UsageError(f"--draft {args.draft} has another vocabulary ({len(draft_vocab)} characters) than the "
                         f"checkpoint ({len(vocab)}): draft with a checkpoint trained on the same text")
    return draft


def choose_threads(args, model: GPT, prompt_ids: list[int], device: torch.device) -> int:
    """Set torch's CPU threads to --threads, or to the count whose cached decoding is fastest now: on a busy
    machine one thread can be several times faster than two (runtime/devices.py)."""
    fixed = args.threads or environment_threads()
    if fixed or device.type != "cpu" or len(thread_counts()) == 1:
        torch.set_num_threads(fixed or DEFAULT_THREADS)
        return fixed or DEFAULT_THREADS
    idx = torch.tensor([prompt_ids[-DECODE_TIMED:]] * args.num_samples, device=device)

    def decode():  # greedy: the timing draws nothing from the samples' generator
        list(generate_tokens(model, idx, DECODE_TIMED, sampling=Sampling(temperature=0)))

    return fastest_threads(decode, rounds=3)[0]


@contextlib.contextmanager
def ctrl_c_sets_flag():
    """While inside, Ctrl-C sets the flag yielded instead of raising KeyboardInterrupt: a reply then ends between
    two tokens, with the conversation whole."""
    flag = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def interact(conversation: Conversation, vocab: CharVocab, prompt: str, max_new_tokens: int, out,
             resumed: bool = False) -> None:
    """Read lines from standard input to its end (Ctrl-D). Each line, with its newline (and, first, the prompt), is
    added to the text and the model continues it, written as it is drawn, up to max_new_tokens characters or
    through REPLY_STOP. Ctrl-C ends a reply (while typing: the line). A line with characters outside the
    vocabulary is one line on stderr, and the loop goes on. resumed: the prompt is the text so far, shown only."""
    newline = "\n" if "\n" in vocab.chars else ""
    stop = vocab.encode(REPLY_STOP) if set(REPLY_STOP) <= set(vocab.chars) else ()
    print(f"type a line and press Enter: the model continues the text for up to {max_new_tokens} characters"
          f"{' or to a blank line' if stop else ''}. Ctrl-C ends a reply, Ctrl-D the session.", file=sys.stderr)
    out.write(prompt)
    out.flush()
    before = "" if resumed else prompt  # the prompt goes in with the first line
    while True:
        try:
            line = input()
            line.encode()  # bytes that are not UTF-8 arrive as lone surrogates
        except UnicodeError:
            print("the line is not UTF-8 text; type another", file=sys.stderr)
            continue
        except EOFError:
            if not vocab.decode(conversation.tokens[-1:]).endswith("\n"):
                out.write("\n")  # leave the shell's prompt a line of its own
            return
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        try:
            new = encode_prompt(vocab, before + line + newline, "the line")
        except UsageError as e:
            print(f"{e}; type another", file=sys.stderr)
            continue
        before = ""
        with ctrl_c_sets_flag() as stopped:
            for token in conversation.reply(new, max_new_tokens, stop):
                out.write(vocab.decode([token]))
                out.flush()
                if stopped.is_set():
                    break


def take_up(conversation: Conversation, session: Path, checkpoint: Path, model: GPT) -> None:
    """Restore the conversation saved in session, or refuse it in one line."""
    try:
        contents = load_session(session, checkpoint, model)
        conversation.restore(contents)
    except SessionError as e:
        raise UsageError(f"--session {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise UsageError(f"--session {session} is damaged ({e}): start a new one under another name") from None
    fed = conversation.text.fed
    print(f"took up {session}: {len(conversation.tokens)} tokens, {fed} of them cached; the next line is all the "
          f"model reads", file=sys.stderr)


def checked(steps):
    """generate_tokens checks its arguments when asked for its first token: ask now, so that a mistake is
    reported before anything is written. Its messages name the argument, as the options do."""
    try:
        first = next(steps, None)
    except ValueError as e:
        raise UsageError(e) from None
    return steps if first is None else itertools.chain([first], steps)


def continue_lines(model: GPT, vocab: CharVocab, text: str, max_new_tokens: int, sampling: Sampling,
                   generator: torch.Generator, out) -> tuple[Engine, int]:
    """--each-line: each line of text with characters in it, with its newline, continued by max_new_tokens tokens
    (its last block_size - max_new_tokens are read), the lines decoded together. Each is written as soon as it and
    those before it are done."""
    block = model.config.block_size
    lines = [line + "\n" for line in text.splitlines() if line.strip()]
    engine = Engine(model, n_blocks=EACH_LINE_BATCH * -(-block // BLOCK_TOKENS), block_tokens=BLOCK_TOKENS,
                    max_batch=EACH_LINE_BATCH, sampling=sampling, generator=generator)
    requests = [engine.add(i, vocab.encode(line)[-(block - max_new_tokens):], max_new_tokens)
                for i, line in enumerate(lines)]
    written = 0
    for _ in engine.run():
        while written < len(lines) and requests[written].drawn == max_new_tokens:
            continuation = vocab.decode(requests[written].tokens[requests[written].prompt_len:])
            out.write((SAMPLE_SEPARATOR if written else "") + lines[written] + continuation + "\n")
            out.flush()
            written += 1
    return engine, len(lines)


def write_samples(steps, prompt: str, vocab: CharVocab, num_samples: int, out, every: int) -> None:
    """Write the samples as they are generated: a lone one as it grows, its tokens read back from the device
    every `every` steps; samples generated side by side, one after another at the end. Ctrl-C stops the
    generation; what it had generated is written before the KeyboardInterrupt goes on."""
    texts, pending = [prompt] * num_samples, []  # text not yet written; the newest tokens, still on the device

    def read_back():
        rows = torch.stack(pending, dim=1).tolist() if pending else [[]] * num_samples
        pending.clear()
        return [text + vocab.decode(row) for text, row in zip(texts, rows)]

    interrupted = False
    try:
        for next_ids in steps:
            pending.append(next_ids)
            if num_samples == 1 and len(pending) == every:
                out.write(read_back()[0])
                out.flush()
                texts = [""]
    except KeyboardInterrupt:
        interrupted = True
    out.write(SAMPLE_SEPARATOR.join(text + "\n" for text in read_back()))
    out.flush()
    if interrupted:
        raise KeyboardInterrupt


def kept_or_compiled_step(args, model: GPT, cache, tokens: int = 1):
    """The compiled pass of `tokens` tokens per row (one: the decoding step; more: speculative decoding's
    verification) that --compile asks for, or by default one kept before, or one worth compiling for a long
    generation; None: decode eagerly. Says on stderr which, and why."""
    if args.compile is False or cache is None or args.kv_cache in EAGER or cache.device.type not in STEP_DEVICES:
        return None
    kept = has_compiled_step(model, cache, tokens)
    if not (args.compile or kept or args.max_new_tokens >= COMPILE_PAYS_AFTER):
        return None
    what = "decoding step" if tokens == 1 else f"verification pass of {tokens} tokens"
    if not kept:
        print(f"compiling the {what} for this model's shape, once: a minute or less (--no-compile decodes "
              f"eagerly)", file=sys.stderr)
    try:
        return load_or_compile_step(model, cache, tokens, say=lambda line: print(line, file=sys.stderr))
    except Exception as e:  # noqa: BLE001  no C++ compiler, or one that fails: the eager step still decodes
        print(f"compiling the {what} failed ({one_line(e)[:200]}); decoding eagerly", file=sys.stderr)
        return None


def sample(args) -> None:
    if args.num_samples < 1:
        raise UsageError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.seed is not None and not 0 <= args.seed <= MAX_GENERATOR_SEED:
        raise UsageError(f"--seed must be in [0, {MAX_GENERATOR_SEED}], got {args.seed}")
    if args.no_kv_cache and (args.kv_cache or args.read_all_slots):
        raise UsageError(f"{'--kv-cache' if args.kv_cache else '--read-all-slots'} applies to the KV cache: "
                         f"drop it, or --no-kv-cache")
    check_combinations(args)
    try:
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as e:  # its messages name the argument, as the options do
        raise UsageError(e) from None
    try:
        device = choose_device(args.device)
    except ValueError as e:
        raise UsageError(f"--device {e}") from None
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    prompt = read_prompt(args)
    # without --checkpoint: the newest under the working directory, where train.py writes
    path = resolve_checkpoint(args.checkpoint) if args.checkpoint else find_latest_checkpoint("runs")
    model, vocab, contents = load_model(path, device, precision=args.precision)
    prompt_ids = encode_prompt(vocab, prompt)
    if args.max_new_tokens is None:
        args.max_new_tokens = model.config.block_size // 2 if args.each_line else MAX_NEW_TOKENS
    if args.each_line and not 1 <= args.max_new_tokens < model.config.block_size:
        raise UsageError(f"--each-line draws 1 to block_size - 1 = {model.config.block_size - 1} tokens per line, "
                         f"within the model's context; got --max-new-tokens {args.max_new_tokens}")
    if args.each_line and not prompt.strip():
        raise UsageError("--each-line: --prompt-file has no line with characters in it to continue")
    check_memory(args, len(prompt_ids), model, device)
    draft = load_draft(args, model, vocab, contents, device) if args.draft else None
    threads = choose_threads(args, model, prompt_ids, device)  # before anything is timed or sampled

    generator = torch.Generator(device)
    if args.seed is None:
        generator.seed()  # a new generator starts from the same fixed seed every time; draw a random one
    else:
        generator.manual_seed(args.seed)
    if args.interactive:
        try:
            conversation = Conversation(model, sampling=sampling, generator=generator, window=args.window)
        except ValueError as e:  # its messages name the argument, as the options do
            raise UsageError(e) from None
        resumed = args.session is not None and args.session.exists()
        if resumed:
            if args.prompt is not None or args.prompt_file is not None:
                raise UsageError(f"--session {args.session} goes on from its own text: drop --prompt")
            take_up(conversation, args.session, path, model)
    idx = torch.tensor([prompt_ids] * args.num_samples, dtype=torch.long, device=device)
    if not (args.interactive or args.each_line):
        try:  # the decoding loop's own checks, before a step is compiled
            check_arguments(model, idx, args.max_new_tokens, args.window)
        except ValueError as e:  # its messages name the argument, as the options do
            raise UsageError(e) from None
    state = contents.get("training")
    evaluated = f"best val loss {state['best_val_loss']:.4f}" if state and math.isfinite(state["best_val_loss"]) \
        else "not yet evaluated"
    progress = f"step {state['step']}, {evaluated}" if state else "weights only"
    print(f"sampling {path} ({progress}), trained on {trained_on(contents)}", file=sys.stderr)
    use_cache = not args.no_kv_cache
    cache = cache_for(args, model, args.num_samples) if use_cache and not (draft or args.each_line) else None
    k = args.speculate_k or SPECULATE_K
    # a compiled one-token step, or for --draft the compiled pass that verifies k drafts and one token after them
    step = kept_or_compiled_step(args, model, text_cache(model, k), k + 1) if draft else \
        kept_or_compiled_step(args, model, text_cache(model)) if args.interactive else \
        kept_or_compiled_step(args, model, cache)
    if args.interactive and step is not None:
        conversation.decode_through(step)
    start = time.perf_counter()
    speculation = SpeculativeStats()
    if args.interactive or args.each_line:
        steps = None
    elif draft:
        steps = checked(speculative_generate(model, idx, args.max_new_tokens, draft=draft,
                                             k=k, sampling=sampling,
                                             generator=generator, window=args.window, stats=speculation,
                                             verify_pass=step))
    else:
        steps = checked(generate_tokens(model, idx, args.max_new_tokens, sampling=sampling, generator=generator,
                                        window=args.window, use_cache=use_cache, cache=cache, step=step))

    try:
        vocab.chars.encode(sys.stdout.encoding)
    except UnicodeEncodeError:  # an ASCII-only locale, PYTHONIOENCODING=ascii, ...
        sys.stdout.reconfigure(errors="replace")
        print(f"standard output is {sys.stdout.encoding}: characters it cannot show are written as '?' "
              f"(PYTHONIOENCODING=utf-8 writes them all)", file=sys.stderr)
    try:
        if args.interactive:
            sys.stdin.reconfigure(errors="surrogateescape")  # bytes that are not UTF-8 cost their line, no more
            interact(conversation, vocab, vocab.decode(conversation.tokens) if resumed else prompt,
                     args.max_new_tokens, sys.stdout, resumed)
            if args.session is not None:
                save_session(args.session, conversation.state(), path, model)
                print(f"saved the session, {len(conversation.tokens)} tokens and their cache, to {args.session}",
                      file=sys.stderr)
            return
        if args.each_line:
            engine, n_lines = continue_lines(model, vocab, prompt, args.max_new_tokens, sampling, generator,
                                             sys.stdout)
            seconds, pool, stats = time.perf_counter() - start, engine.pool, engine.stats
            tokens = n_lines * args.max_new_tokens
            print(f"{tokens} tokens for {n_lines} lines in {seconds:.2f} s, {tokens / max(seconds, 1e-9):.1f} "
                  f"tokens/s at {args.precision}, a pool of {pool.n_blocks} blocks of {pool.block_tokens} tokens "
                  f"({pool.nbytes / 2**20:.2f} MiB, at most {stats.peak_blocks} in use), prefix cache hit rate "
                  f"{stats.hit_rate:.0%} ({device.type}, {threads} thread{'s' if threads > 1 else ''})",
                  file=sys.stderr)
            return
        write_samples(steps, prompt, vocab, args.num_samples, sys.stdout, every=1 if sys.stdout.isatty() else CHUNK)
    except BrokenPipeError:  # the reader stopped early (`| head`): nothing more is wanted
        silence(sys.stdout)
        return
    except OSError as e:  # a full disk, ...
        silence(sys.stdout)
        raise OSError(f"cannot write the samples to standard output ({e.strerror or e})") from None
    seconds = time.perf_counter() - start

    tokens = args.num_samples * args.max_new_tokens
    # the cache's own dtype: float32 on the CPU also at bf16 and int8 (model/attention.py: attention_dtype)
    stored = args.kv_cache if args.kv_cache in EAGER else str(
        getattr(cache, "dtype", "")).removeprefix("torch.")
    cache_size = f"KV cache {cache.nbytes / 2**20:.2f} MiB in {stored}" \
        if cache is not None else f"KV caches {speculation.cache_bytes / 2**20:.2f} MiB" if draft else "no cache"
    speculated = f", draft acceptance {speculation.acceptance_rate:.0%}, {speculation.tokens_per_pass:.2f} " \
        f"tokens per model pass" if draft else ""
    on = f"{device.type}, {threads} thread{'s' if threads > 1 else ''}" if device.type == "cpu" else device.type
    on += ", compiled step" if step is not None else ""
    print(f"{tokens} tokens in {seconds:.2f} s, {tokens / max(seconds, 1e-9):.1f} tokens/s at {args.precision}, "
          f"{cache_size} ({on}){speculated}", file=sys.stderr)


def main(argv=None) -> None:
    parser = build_parser()
    try:
        check_standard_streams()
        sample(parser.parse_args(argv))
    except (*mistakes(), OSError, KeyboardInterrupt) as e:
        fail(parser.prog, e)


if __name__ == "__main__":
    main()
