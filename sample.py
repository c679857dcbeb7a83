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
--interactive reads lines instead (sampling/output.py: interact). A mistake in the command line or its
inputs is one line on stderr with exit status 2 (sampling/options.py checks them); an output that cannot
be written (a full disk) is one line with status 1; a reader that stops early (`| head`) ends sampling quietly.
"""

import math
import sys
import time

import torch

from model import Sampling, generate_tokens
from model.caches.factory import EAGER
from model.decoding.cached_text import text_cache
from model.decoding.generate import check_arguments
from model.serving.conversation import Conversation
from model.serving.speculative import SpeculativeStats, speculative_generate
from runtime.checkpoint import find_latest_checkpoint, load_model, resolve_checkpoint, trained_on
from runtime.devices import choose_device
from runtime.errors import UsageError, check_standard_streams, fail, mistakes, silence
from sampling.options import (MAX_NEW_TOKENS, build_parser, cache_for, check_each_line, check_options,
                              check_samples_fit_memory, drafts_per_pass, encode_prompt, read_prompt)
from sampling.output import checked, continue_lines, interact, keep_session, take_up, write_samples
from sampling.setup import choose_threads, kept_or_compiled_step, load_draft

CHUNK = 64  # tokens read back from the device at once when the output is no terminal: each read is a sync


def sample(args) -> None:
    check_options(args)
    try:
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as e:  # its messages name the argument, as the options do
        raise UsageError(e) from None
    try:
        device = choose_device(args.device)
    except ValueError as e:
        raise UsageError(f"--device {e}") from None
    prompt = read_prompt(args)
    # without --checkpoint: the newest under the working directory, where train.py writes
    path = resolve_checkpoint(args.checkpoint) if args.checkpoint else find_latest_checkpoint("runs")
    model, vocab, contents = load_model(path, device, precision=args.precision)
    prompt_ids = encode_prompt(vocab, prompt)
    if args.max_new_tokens is None:
        args.max_new_tokens = model.config.block_size // 2 if args.each_line else MAX_NEW_TOKENS
    if args.each_line:
        check_each_line(args, model, prompt)
    check_samples_fit_memory(args, len(prompt_ids), model, device)
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
    use_cache = not args.no_kv_cache
    cache = cache_for(args, model, args.num_samples) if use_cache and not (draft or args.each_line) else None
    if not (args.interactive or args.each_line):
        try:  # the decoding loop's own checks, before a step is compiled
            check_arguments(model, idx, args.max_new_tokens, args.window, use_cache=use_cache, cache=cache)
        except ValueError as e:  # its messages name the argument, as the options do
            raise UsageError(e) from None
    state = contents.get("training")
    evaluated = f"best val loss {state['best_val_loss']:.4f}" if state and math.isfinite(state["best_val_loss"]) \
        else "not yet evaluated"
    progress = f"step {state['step']}, {evaluated}" if state else "weights only"
    print(f"sampling {path} ({progress}), trained on {trained_on(contents)}", file=sys.stderr)
    k = drafts_per_pass(args)
    # a compiled one-token step, or for --draft the compiled pass that verifies k drafts and one token after them
    step = kept_or_compiled_step(args, model, text_cache(model, k), k + 1) if draft else \
        kept_or_compiled_step(args, model, text_cache(model)) if args.interactive else \
        kept_or_compiled_step(args, model, cache)
    if args.interactive and step is not None:
        conversation.decode_through(step)
    on = f"{device.type}, {threads} thread{'s' if threads > 1 else ''}" if device.type == "cpu" else device.type
    on += ", compiled step" if step is not None else ""  # where the summary line says it decoded
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
        elif args.each_line:
            engine, n_lines = continue_lines(model, vocab, prompt, args.max_new_tokens, sampling, generator,
                                             sys.stdout)
            seconds, pool, stats = time.perf_counter() - start, engine.pool, engine.stats
            tokens = n_lines * args.max_new_tokens
            print(f"{tokens} tokens for {n_lines} lines in {seconds:.2f} s, {tokens / max(seconds, 1e-9):.1f} "
                  f"tokens/s at {args.precision}, a pool of {pool.n_blocks} blocks of {pool.block_tokens} tokens "
                  f"({pool.nbytes / 2**20:.2f} MiB, at most {stats.peak_blocks} in use), prefix cache hit rate "
                  f"{stats.hit_rate:.0%} ({on})", file=sys.stderr)
            return
        else:
            write_samples(steps, prompt, vocab, args.num_samples, sys.stdout,
                          every=1 if sys.stdout.isatty() else CHUNK)
    except BrokenPipeError:  # the reader stopped early (`| head`): nothing more is wanted
        silence(sys.stdout)
        return
    except OSError as e:  # a full disk, ...
        silence(sys.stdout)
        raise OSError(f"cannot write the samples to standard output ({e.strerror or e})") from None
    if args.interactive:
        if args.session is not None:
            keep_session(args.session, conversation, path, model)
        return
    seconds = time.perf_counter() - start

    tokens = args.num_samples * args.max_new_tokens
    # the cache's own dtype: float32 on the CPU also at bf16 and int8 (model/attention.py: attention_dtype)
    stored = args.kv_cache if args.kv_cache in EAGER else str(
        getattr(cache, "dtype", "")).removeprefix("torch.")
    cache_size = f"KV cache {cache.nbytes / 2**20:.2f} MiB in {stored}" \
        if cache is not None else f"KV caches {speculation.cache_bytes / 2**20:.2f} MiB" if draft else "no cache"
    speculated = f", draft acceptance {speculation.acceptance_rate:.0%}, {speculation.tokens_per_pass:.2f} " \
        f"tokens per model pass" if draft else ""
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
