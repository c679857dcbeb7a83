"""What sample.py sets up between loading the checkpoint and decoding: the draft that speculative decoding checks,
the CPU threads, the random generator and the compiled step (on CUDA, the step captured as a CUDA graph)."""

import sys
import time
from pathlib import Path

import torch

from data import CharVocab, DataError
from model import GPT, Sampling, generate_tokens
from model.caches.factory import EAGER
from model.decoding.cuda_graph import CapturedStep
from model.protocol import Step
from model.serving.ngram_draft import NGramTable
from model.serving.speculative import PromptLookup
from runtime.checkpoint import load_model, resolve_checkpoint, training_text
from runtime.devices import DEFAULT_THREADS, environment_threads, race_threads, thread_counts
from runtime.errors import CheckpointError, UsageError, one_line
from runtime.streams import waiting_on
from .compiled_step import (COMPILE_PAYS_AFTER, DEVICES as STEP_DEVICES, has_compiled_step, load_or_compile_step,
                            packs, prompt_tokens)

DECODE_TIMED = 16  # tokens decoded at each thread count to choose the fastest


def load_draft(args, model: GPT, vocab: CharVocab, contents: dict,
               device: torch.device) -> GPT | NGramTable | PromptLookup:
    """--draft: the prompt's own continuations (lookup), the training text's counts (ngram) or a checkpoint with
    the checkpoint's vocabulary."""
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


def choose_threads(args, model: GPT, prompt_ids: list[int], device: torch.device) -> None:
    """Set torch's CPU threads to --threads, or to the count whose cached decoding is fastest now: on a busy
    machine one thread can be several times faster than two (runtime/devices.py)."""
    fixed = args.threads or environment_threads()
    if fixed or device.type != "cpu" or len(thread_counts()) == 1:
        torch.set_num_threads(fixed or DEFAULT_THREADS)
        return
    idx = torch.tensor([prompt_ids[-DECODE_TIMED:]] * args.num_samples, device=device)

    def decode():  # greedy: the timing draws nothing from the samples' generator
        return generate_tokens(model, idx, DECODE_TIMED, sampling=Sampling(temperature=0))

    counts = thread_counts()
    with waiting_on(f"timing {', '.join(map(str, counts[:-1]))} and {counts[-1]} threads to decode with the "
                    f"fastest"):
        race_threads(decode, rounds=3)


def new_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """The samples' generator: seeded with --seed, else with a random seed."""
    generator = torch.Generator(device)
    if seed is None:
        generator.seed()  # a new generator starts from the same fixed seed every time; draw a random one
    else:
        generator.manual_seed(seed)
    return generator


def kept_or_compiled_step(args, model: GPT, cache, tokens: int = 1) -> Step | None:
    """The compiled pass of up to `tokens` tokens per row (one: the decoding step; more: speculative decoding's
    verification; on the CPU, up to block_size, so that prompts go through it too) that --compile asks for, or by
    default one kept before, or one worth compiling for a long generation; on CUDA, by default, the passes
    captured over `cache` itself (captured_step); None: decode eagerly. Says on stderr which, and why. A CPU step
    is built for torch's thread count; where no count was asked for and a step is kept for another count only,
    torch's count becomes that one."""
    if args.compile is False or cache is None or args.kv_cache in EAGER:
        return None
    what = "decoding step" if tokens == 1 else f"verification pass of up to {tokens} tokens"
    if cache.device.type == "cuda":
        return captured_step(model, cache, tokens, what)
    if cache.device.type not in STEP_DEVICES:
        return None
    tokens = prompt_tokens(model, tokens)
    what = f"{what}, with a pass of up to {tokens} tokens for prompts,"
    packed = packs(model)  # float32 weights: packed into the step; else a step for the shape reads them
    kept = has_compiled_step(model, cache, tokens, packed)
    if not kept and not (args.threads or environment_threads()):  # no count asked for: a kept step's count serves
        others = [n for n in reversed(thread_counts()) if n != torch.get_num_threads()]  # most threads first
        count = next((n for n in others if has_compiled_step(model, cache, tokens, packed, n)), None)
        if count:
            torch.set_num_threads(count)
            kept = True
    if not (args.compile or kept or args.max_new_tokens >= COMPILE_PAYS_AFTER):
        return None
    if not kept:
        made_for = "these weights" if packed else "this model's shape"
        print(f"compiling the {what} for {made_for}, once: a minute or two (--no-compile decodes eagerly)",
              file=sys.stderr)
    try:
        return load_or_compile_step(model, cache, tokens, say=lambda line: print(line, file=sys.stderr),
                                    packed=packed)
    except Exception as e:  # noqa: BLE001  no C++ compiler, or one that fails: the eager step still decodes
        print(f"compiling the {what} failed ({one_line(e)[:200]}); decoding eagerly", file=sys.stderr)
        return None


def captured_step(model: GPT, cache, tokens: int, what: str) -> CapturedStep | None:
    """The passes of up to `tokens` tokens per row captured as CUDA graphs over cache; None where capture fails,
    and the eager step decodes. Says on stderr how long capturing took: no token's time includes it."""
    start = time.perf_counter()
    try:
        step = CapturedStep(model, cache, tokens)
    except Exception as e:  # noqa: BLE001  a driver or kernel that cannot be captured: the eager step still decodes
        print(f"capturing the {what} failed ({one_line(e)[:200]}); decoding eagerly", file=sys.stderr)
        return None
    print(f"captured the {what} as a CUDA graph in {time.perf_counter() - start:.2f} s (--no-compile decodes "
          f"eagerly)", file=sys.stderr)
    return step
