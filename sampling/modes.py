"""sample.py's four ways to decode, a function each: plain sampling, speculative decoding (--draft), a conversation
(--interactive) and the lines of a file continued side by side (--each-line). Each checks what only it needs,
decodes, writes and says its own summary line; what they share is here once: the line naming the checkpoint,
where the summary says it decoded, the summary's timing, and writing to standard output."""

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

from data import CharVocab
from model import GPT, Sampling, generate_tokens
from model.caches.factory import EAGER
from model.decoding.cached_text import text_cache
from model.decoding.cuda_graph import CapturedStep
from model.decoding.generate import check_arguments
from model.protocol import Step
from model.serving.conversation import Conversation
from model.serving.speculative import SpeculativeStats, speculative_generate
from runtime.checkpoint import trained_on
from runtime.errors import UsageError
from runtime.streams import silence
from .options import cache_for, drafts_per_pass
from .output import checked, continue_lines, held, interact, keep_session, take_up, write_samples
from .setup import kept_or_compiled_step

CHUNK = 64  # tokens read back from the device at once when the output is no terminal: each read is a sync


@dataclasses.dataclass
class Loaded:
    """What sample.py has loaded and checked before a mode decodes."""
    args: argparse.Namespace
    path: Path  # the checkpoint sampled
    contents: dict  # ... as saved
    model: GPT
    vocab: CharVocab
    prompt: str
    prompt_ids: list[int]
    device: torch.device
    sampling: Sampling
    generator: torch.Generator
    draft: object = None  # --draft's (sampling/setup.py: load_draft)


def plain(loaded: Loaded) -> None:
    """--num-samples samples decoded side by side, through the KV cache --kv-cache asks for, or none."""
    args, model = loaded.args, loaded.model
    idx = prompts(loaded)
    use_cache = not args.no_kv_cache
    cache = cache_for(args, model, args.num_samples) if use_cache else None
    check_decoding(loaded, idx, cache)
    announce(loaded)
    step = kept_or_compiled_step(args, model, cache)
    on, start = decoded_on(loaded, step), time.perf_counter()
    steps = checked(generate_tokens(model, idx, args.max_new_tokens, sampling=loaded.sampling,
                                    generator=loaded.generator, keep=args.keep, use_cache=use_cache, cache=cache,
                                    step=step))
    if not written(loaded.vocab, lambda: write_out(loaded, steps)):
        return
    seconds = time.perf_counter() - start
    # the cache's own dtype: float32 on the CPU also at bf16 and int8 (model/attention.py: attention_dtype)
    stored = args.kv_cache if args.kv_cache in EAGER else str(getattr(cache, "dtype", "")).removeprefix("torch.")
    summarize(loaded, seconds, f"KV cache {cache.nbytes / 2**20:.2f} MiB in {stored}" if cache is not None
              else "no cache", on)


def speculative(loaded: Loaded) -> None:
    """--draft: the draft proposes --speculate-k tokens and the model checks them in one pass; the same text as
    plain decoding when greedy, the same distribution when sampling."""
    args, model = loaded.args, loaded.model
    idx = prompts(loaded)
    check_decoding(loaded, idx, None)
    announce(loaded)
    k = drafts_per_pass(args)
    step = kept_or_compiled_step(args, model, text_cache(model, k), k + 1)  # verifies k drafts and one token more
    draft = loaded.draft
    draft_step = kept_or_compiled_step(args, draft, text_cache(draft, k)) if isinstance(draft, GPT) else None
    on, start = decoded_on(loaded, step), time.perf_counter()
    speculation = SpeculativeStats()
    steps = checked(speculative_generate(model, idx, args.max_new_tokens, draft=loaded.draft, k=k,
                                         sampling=loaded.sampling, generator=loaded.generator, keep=args.keep,
                                         stats=speculation, verify_pass=step, draft_step=draft_step))
    if not written(loaded.vocab, lambda: write_out(loaded, steps)):
        return
    seconds = time.perf_counter() - start
    summarize(loaded, seconds, f"KV caches {speculation.cache_bytes / 2**20:.2f} MiB", on,
              f", draft acceptance {speculation.acceptance_rate:.0%}, {speculation.tokens_per_pass:.2f} tokens per "
              f"model pass")


def interactive(loaded: Loaded) -> None:
    """--interactive: each line read is added to the text and the model continues it (sampling/output.py:
    interact); --session takes up the conversation saved there, and saves it there at the end."""
    args, model, vocab = loaded.args, loaded.model, loaded.vocab
    try:
        conversation = Conversation(model, sampling=loaded.sampling, generator=loaded.generator, keep=args.keep)
    except ValueError as e:  # its messages name the argument, as the options do
        raise UsageError(e) from None
    with held(args.session):  # one process at a time takes the session up and saves it
        if args.session is not None and args.session.exists():
            if args.prompt is not None or args.prompt_file is not None:
                raise UsageError(f"--session {args.session} goes on from its own text: drop --prompt")
            take_up(conversation, args.session, loaded.path, model)
        else:  # the prompt is the text from the start: a session ended before any line keeps it
            list(conversation.reply(loaded.prompt_ids, 0))
        announce(loaded)
        step = kept_or_compiled_step(args, model, conversation.text.cache)
        if step is not None:
            conversation.decode_through(step)

        def converse():
            sys.stdin.reconfigure(errors="surrogateescape")  # bytes that are not UTF-8 cost their line, no more
            interact(conversation, vocab, args.max_new_tokens, sys.stdout)

        try:
            ended = written(vocab, converse)
        except KeyboardInterrupt:  # between two replies: the turns so far are saved all the same
            if args.session is not None:
                keep_session(args.session, conversation, loaded.path, model)
            raise
        if ended and args.session is not None:
            keep_session(args.session, conversation, loaded.path, model)


def each_line(loaded: Loaded) -> None:
    """--each-line: every line of --prompt-file continued, the lines decoded together over one pool of KV blocks
    (sampling/output.py: continue_lines)."""
    args = loaded.args
    announce(loaded)
    on, start = decoded_on(loaded, None), time.perf_counter()

    def continue_them():  # the summary too is said within the writing's guard
        engine, n_lines = continue_lines(loaded.model, loaded.vocab, loaded.prompt, args.max_new_tokens,
                                         loaded.sampling, loaded.generator, sys.stdout,
                                         buckets=False if args.compile is False else None)
        seconds, pool, stats = time.perf_counter() - start, engine.pool, engine.stats
        graphs = engine.buckets.graphs if engine.buckets is not None else ()
        if graphs:  # captured when the engine started: no token's time
            seconds -= engine.buckets.capture_seconds
            print(f"captured the decoding step as {len(graphs)} CUDA graphs, one per batch bucket, in "
                  f"{engine.buckets.capture_seconds:.2f} s (--no-compile decodes eagerly)", file=sys.stderr)
        tokens = n_lines * args.max_new_tokens
        print(f"{tokens} tokens for {n_lines} lines {timed(tokens, seconds, args.precision)}, a pool of "
              f"{pool.n_blocks} blocks of {pool.block_tokens} tokens ({pool.nbytes / 2**20:.2f} MiB, at most "
              f"{stats.peak_blocks} in use), prefix cache hit rate {stats.hit_rate:.0%} ({on})", file=sys.stderr)

    written(loaded.vocab, continue_them)


def prompts(loaded: Loaded) -> torch.Tensor:
    """The prompt's tokens, a row for each sample."""
    return torch.tensor([loaded.prompt_ids] * loaded.args.num_samples, dtype=torch.long, device=loaded.device)


def check_decoding(loaded: Loaded, idx: torch.Tensor, cache) -> None:
    """The decoding loop's own checks, before a step is compiled."""
    args = loaded.args
    try:
        check_arguments(loaded.model, idx, args.max_new_tokens, args.keep, use_cache=not args.no_kv_cache,
                        cache=cache)
    except ValueError as e:  # its messages name the argument, as the options do
        raise UsageError(e) from None


def announce(loaded: Loaded) -> None:
    """Say on stderr which checkpoint is sampled: its step, best val loss and the text it was trained on."""
    state = loaded.contents.get("training")
    evaluated = f"best val loss {state['best_val_loss']:.4f}" if state and math.isfinite(state["best_val_loss"]) \
        else "not yet evaluated"
    progress = f"step {state['step']}, {evaluated}" if state else "weights only"
    print(f"sampling {loaded.path} ({progress}), trained on {trained_on(loaded.contents)}", file=sys.stderr)


def decoded_on(loaded: Loaded, step: Step | None) -> str:
    """Where the summary line says it decoded: the device, the CPU's threads, a compiled step."""
    device, threads = loaded.device, torch.get_num_threads()
    on = f"{device.type}, {threads} thread{'s' if threads > 1 else ''}" if device.type == "cpu" else device.type
    return on + ("" if step is None else ", captured step" if isinstance(step, CapturedStep) else ", compiled step")


def timed(tokens: int, seconds: float, precision: str) -> str:
    """The summary line's timing of tokens."""
    return f"in {seconds:.2f} s, {tokens / max(seconds, 1e-9):.1f} tokens/s at {precision}"


def summarize(loaded: Loaded, seconds: float, cache_size: str, on: str, speculated: str = "") -> None:
    """The summary line of samples: tokens, seconds, tokens/s, precision, the cache and where it decoded."""
    tokens = loaded.args.num_samples * loaded.args.max_new_tokens
    print(f"{tokens} tokens {timed(tokens, seconds, loaded.args.precision)}, {cache_size} ({on}){speculated}",
          file=sys.stderr)


def write_out(loaded: Loaded, steps) -> None:
    """Write the samples as they are generated: to a terminal token by token, elsewhere every CHUNK tokens."""
    write_samples(steps, loaded.prompt, loaded.vocab, loaded.args.num_samples, sys.stdout,
                  every=1 if sys.stdout.isatty() else CHUNK)


def written(vocab: CharVocab, write) -> bool:
    """Call write(), which writes to standard output, once standard output can show the vocabulary (else '?' for
    what it cannot, said on stderr). False: the reader stopped early (`| head`), and nothing more is wanted. A
    write that fails (a full disk) is one line."""
    try:
        vocab.chars.encode(sys.stdout.encoding)
    except UnicodeEncodeError:  # an ASCII-only locale, PYTHONIOENCODING=ascii, ...
        sys.stdout.reconfigure(errors="replace")
        print(f"standard output is {sys.stdout.encoding}: characters it cannot show are written as '?' "
              f"(PYTHONIOENCODING=utf-8 writes them all)", file=sys.stderr)
    try:
        write()
    except BrokenPipeError:  # the reader stopped early: nothing more is wanted
        silence(sys.stdout)
        return False
    except OSError as e:  # a full disk, ...
        silence(sys.stdout)
        raise OSError(f"cannot write the samples to standard output ({e.strerror or e})") from None
    return True
