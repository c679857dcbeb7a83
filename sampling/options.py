"""sample.py's command line: its options and their defaults, and the checks that refuse, in one line, an option
that cannot apply, a value out of range, or samples whose cache would not fit in memory."""

import argparse
import errno
import sys
from pathlib import Path

import torch

from data import CharVocab, DataError, UnknownCharacterError, read_regular_file
from model import GPT, kv_cache_bytes
from model.caches.factory import BUDGETED, CACHES, EAGER, new_cache
from model.decoding.quantize import DECODING_PRECISIONS
from model.caches.factory import kv_cache_dtype
from model.serving.engine import check_servable
from .compiled_step import COMPILE_PAYS_AFTER, DEVICES as STEP_DEVICES
from runtime.devices import MEMORY_SHARE, environment_threads, gib, memory_of, threads_refused
from runtime.errors import OneLineErrorParser, UsageError, float_as_written, one_line
from runtime.files import cannot_write_atomically, link_loop, special_kind

MAX_NEW_TOKENS = 500  # --max-new-tokens's default
MAX_GENERATOR_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
SPECULATE_K = 4  # --speculate-k's default


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
    parser.add_argument("--temperature", metavar="T", type=float_as_written, default=0.8,
                        help="0 means greedy (default: %(default)s)")
    parser.add_argument("--top-k", metavar="K", type=int, help="sample only from the K likeliest characters")
    parser.add_argument("--top-p", metavar="P", type=float_as_written,
                        help="sample only from the fewest likeliest characters whose probabilities reach P")
    parser.add_argument("--num-samples", metavar="N", type=int, default=1,
                        help="samples, generated together as one batch (default: %(default)s)")
    parser.add_argument("--seed", metavar="S", type=int, help="random seed, for reproducible samples")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"), default="auto",
                        help="auto: cuda, else mps, else cpu (default: %(default)s)")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--no-kv-cache", action="store_true",
                       help="recompute the whole context at every step (slow; for comparison)")
    parser.add_argument("--keep", "--window", metavar="N", type=int,
                        help="learned positions: the context tokens kept when it jumps past block_size, "
                             "1..block_size (default: block_size // 2; block_size is the classic crop)")
    parser.add_argument("--threads", metavar="N", type=int,
                        help="CPU threads, at most the cores this process may run on (default: the count whose "
                             "decoding is fastest now, timed at start)")
    parser.add_argument("--precision", choices=DECODING_PRECISIONS, default="fp32",
                        help="decode with the weights as trained (fp32), in bf16, or with int8 weights "
                             "quantized when loaded (default: %(default)s)")
    cache.add_argument("--compile", action=argparse.BooleanOptionalAction,
                       help="decode through a one-token step compiled ahead of time with the checkpoint's "
                            "weights packed in (model/decoding/aot_step.py), kept under ~/.cache/kvgpt "
                            "(runtime/compiled.py); "
                            "compiling takes a minute or less (default: when one is kept, or for "
                            f"--max-new-tokens of {COMPILE_PAYS_AFTER} or more)")
    parser.add_argument("--kv-cache", choices=CACHES, help="how keys and values are stored: in the dtype "
                        "attention computes in (float, the default), int8 with a scale per token and head, "
                        "int4 / int2 in groups, the most recent tokens in float too; or --kv-budget slots: the "
                        "last tokens (window), the first few and the last (sinks), or, for rotary models, those "
                        "each head attends most (h2o, tova; merge folds what tova drops into the likest key it "
                        "keeps). See model/caches/factory.py")
    parser.add_argument("--kv-budget", metavar="SLOTS", type=int,
                        help=f"--kv-cache {', '.join(BUDGETED)}: the tokens the cache keeps (default: half of "
                             "block_size)")
    parser.add_argument("--read-all-slots", action="store_true",
                        help="attend every slot of the cache through the ring's mask (model/caches/ring.py), "
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
                             "blocks (model/serving/engine.py); each is written, with its line, in the file's order")
    parser.add_argument("--session", metavar="FILE", type=Path,
                        help="--interactive: take up the conversation saved in FILE, its KV cache included, and "
                             "save it there when the session ends")
    return parser


def drafts_per_pass(args) -> int:
    """--speculate-k, or its default."""
    return args.speculate_k or SPECULATE_K


def check_options(args) -> None:
    """Refuse option values out of range, and options that cannot apply together, naming them."""
    if args.num_samples < 1:
        raise UsageError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.seed is not None and not 0 <= args.seed <= MAX_GENERATOR_SEED:
        raise UsageError(f"--seed must be in [0, {MAX_GENERATOR_SEED}], got {args.seed}")
    if args.temperature == 0 and args.seed is not None:
        raise UsageError("--seed applies to sampled text: temperature 0 takes the likeliest token, drawing nothing; "
                         "drop --seed, or give a temperature")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.threads is not None and (why := threads_refused(args.threads)):
        raise UsageError(f"--threads {why}")
    if args.threads is None:  # the count OMP_NUM_THREADS names is obeyed then: refused before the model loads
        environment_threads()
    if args.no_kv_cache and (args.kv_cache or args.read_all_slots):
        raise UsageError(f"{'--kv-cache' if args.kv_cache else '--read-all-slots'} applies to the KV cache: "
                         f"drop it, or --no-kv-cache")
    one_row = {"--draft": args.draft, "--interactive": args.interactive, "--each-line": args.each_line}
    plain_decoding = {"--no-kv-cache": args.no_kv_cache, "--kv-cache": args.kv_cache,
                      "--read-all-slots": args.read_all_slots, "--num-samples": args.num_samples != 1}
    if args.speculate_k is not None and not args.draft:
        raise UsageError("--speculate-k applies to speculative decoding: give --draft too")
    if args.speculate_k is not None and args.speculate_k < 1:
        raise UsageError(f"--speculate-k must be >= 1, got {args.speculate_k}")
    if args.compile and args.kv_cache in EAGER:
        raise UsageError(f"--kv-cache {args.kv_cache} decodes eagerly: drop --compile")
    if args.compile and args.device not in ("auto", *STEP_DEVICES, "cuda"):
        raise UsageError(f"--compile builds steps for {' or '.join((*STEP_DEVICES, 'cuda'))}, not --device "
                         f"{args.device}: drop --compile")
    if args.read_all_slots and args.kv_cache in BUDGETED:
        raise UsageError(f"--read-all-slots applies to the ring; --kv-cache {args.kv_cache} reads its own slots: "
                         f"drop one of them")
    if args.kv_budget is not None and args.kv_cache not in BUDGETED:
        raise UsageError(f"--kv-budget applies to --kv-cache {', '.join(BUDGETED)}: give one of them, or drop "
                         f"--kv-budget")
    if args.session and not args.interactive:
        raise UsageError("--session saves an --interactive conversation: give --interactive too")
    if args.session:
        check_session(args.session)
    if args.draft and args.interactive:
        raise UsageError("--draft applies to sampling, not to --interactive: drop one of them")
    if args.compile and args.each_line:
        raise UsageError("--compile applies to plain, --draft and --interactive decoding, not to --each-line: drop "
                         "one of them")
    if args.each_line and (args.prompt_file is None or args.draft or args.interactive):
        raise UsageError("--each-line continues the lines of --prompt-file, without --draft or --interactive")
    if args.each_line and args.keep is not None:
        raise UsageError("--keep moves a long generation's context; --each-line keeps each line and its "
                         "continuation within block_size: drop --keep")
    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens: max_new_tokens must be an integer >= 0, got {args.max_new_tokens}")
    if args.interactive and sys.stdin is None:
        raise UsageError("--interactive reads lines from standard input, which is closed; give it a terminal or a "
                         "file")
    for mode, on in one_row.items():
        for option, given in plain_decoding.items():
            if on and given:
                raise UsageError(f"{option} applies to plain decoding, not to {mode}: drop one of them")


def check_session(session: Path) -> None:
    """Refuse, before the first line is read, a --session that could not be taken up or saved at the end: no
    regular file (a pipe would wait for a writer), or where no file can be written."""
    if loop := link_loop(session):
        raise UsageError(f"--session {session}: cannot follow its links ({one_line(loop)}); give a file")
    target = session.resolve()  # a link: the file it names is taken up and written
    if kind := special_kind(target):
        raise UsageError(f"--session {session} is {kind}, not a session file: give a file (a new name starts a "
                         f"new session)")
    folder = target.parent if session.is_symlink() else session.parent
    if not target.parent.is_dir():
        raise UsageError(f"--session {session}: no folder {folder} to save it in; make it first")
    if error := cannot_write_atomically(target):
        advice = "choose a shorter name" if error.errno == errno.ENAMETOOLONG else "choose another folder"
        raise UsageError(f"--session {session}: cannot make a file in {folder} ({error.strerror or error}); "
                         f"{advice}")


def check_each_line(args, model, prompt: str) -> None:
    """Refuse --each-line where the engine cannot continue the lines: too many tokens for the context, a model its
    pool cannot serve, no line to continue."""
    if not 1 <= args.max_new_tokens < model.config.block_size:
        raise UsageError(f"--each-line draws 1 to block_size - 1 = {model.config.block_size - 1} tokens per line, "
                         f"within the model's context; got --max-new-tokens {args.max_new_tokens}")
    try:
        check_servable(model)
    except ValueError as e:
        raise UsageError(f"--each-line: {e}; continue each line on its own, without --each-line") from None
    if not prompt.strip():
        raise UsageError("--each-line: --prompt-file has no line with characters in it to continue")


def cache_for(args, model: GPT, rows: int):
    """The KV cache --kv-cache asks for, for rows rows."""
    try:
        return new_cache(model, args.kv_cache or "float", rows, budget=args.kv_budget,
                         read_all_slots=args.read_all_slots)
    except ValueError as e:  # a cache for a model it cannot serve, or a budget it cannot keep
        raise UsageError(f"--kv-cache {args.kv_cache}: {e}") from None



def check_samples_fit_memory(args, prompt_len: int, model, device: torch.device) -> None:
    """Refuse up front samples whose KV cache (as the decoder builds it) and tokens (the int64 sequence it fills)
    would not fit, rather than run out of memory midway. Without the cache, the forward passes hold at least as
    much."""
    kind = args.kv_cache or "float"
    block_size = model.config.block_size
    spare = drafts_per_pass(args) if args.draft else 0  # slots for the drafts a pass verifies
    if spare > block_size:
        raise UsageError(f"--speculate-k must be at most the model's block_size, {block_size}: a pass verifies "
                         f"the drafts within one context; got {spare}")
    cache_bytes = cache_for(args, model, 1).nbytes if kind in EAGER else \
        kv_cache_bytes(model.config, kv_cache_dtype(model, torch.int8 if kind == "int8" else None), block_size + spare)
    per_sample = cache_bytes + (prompt_len + args.max_new_tokens) * torch.long.itemsize
    memory, need = memory_of(device), args.num_samples * per_sample
    if need > MEMORY_SHARE * memory:
        most = int(MEMORY_SHARE * memory) // per_sample  # in integers: a float overflows past 1e308
        raise UsageError(f"--num-samples {args.num_samples} of --max-new-tokens {args.max_new_tokens} need "
                         f"{gib(need)} GiB of KV cache and tokens, more than "
                         f"{MEMORY_SHARE:.0%} of the {gib(memory)} GiB of {device.type} memory; "
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
