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
generated side by side are written one after another at the end. Ctrl-C, SIGTERM or SIGHUP writes what was
generated and exits with 128 + the signal's number (130 for Ctrl-C). A one-line summary (tokens, seconds, tokens/s, precision, the cache's size and dtype) ends
stderr (with speculative decoding also the draft's acceptance rate and the tokens per model pass).
--interactive reads lines instead (sampling/output.py: interact). A mistake in the command line or its
inputs is one line on stderr with exit status 2 (sampling/options.py checks them); an output that cannot
be written (a full disk) is one line with status 1; a reader that stops early (`| head`) ends sampling quietly.
"""

import signal
import sys

from runtime.installed import DECODING, require_installed
from runtime.stop_signals import ignoring_stop_signals_after, record_stop_signals

EARLY_SIGNALS = []  # a stop signal that came while the modules below loaded
if __name__ == "__main__":
    require_installed("sample.py", DECODING)
    if sys.stderr is not None and sys.stderr.isatty():  # the modules take seconds: say so, cleared in main()
        sys.stderr.write("loading torch…")
        sys.stderr.flush()
    EARLY_SIGNALS = record_stop_signals()

from model import Sampling  # noqa: E402
from runtime.checkpoint import find_latest_checkpoint, load_model, resolve_checkpoint  # noqa: E402
from runtime.devices import choose_device  # noqa: E402
from runtime.command import run_command  # noqa: E402
from runtime.errors import Interrupted, UsageError  # noqa: E402
from runtime.signals import StopSignals, interrupt_naming_the_signal  # noqa: E402
from runtime.streams import show_status, waiting_on  # noqa: E402
from sampling.modes import Loaded, each_line, interactive, plain, speculative  # noqa: E402
from sampling.options import (MAX_NEW_TOKENS, build_parser, check_each_line, check_options,  # noqa: E402
                              check_samples_fit_memory, encode_prompt, read_prompt)
from sampling.setup import choose_threads, load_draft, new_generator  # noqa: E402


def sample(args) -> None:
    """Load what the options ask for, refusing in one line what cannot be sampled, then decode in their mode:
    plain, speculative (--draft), interactive or each line (sampling/modes.py)."""
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
    with waiting_on(f"loading {path}"):
        model, vocab, contents = load_model(path, device, precision=args.precision)
    prompt_ids = encode_prompt(vocab, prompt, "the prompt" if args.prompt or args.prompt_file else
                               "the default prompt (give --prompt)")
    if args.max_new_tokens is None:
        args.max_new_tokens = model.config.block_size // 2 if args.each_line else MAX_NEW_TOKENS
    if args.each_line:
        check_each_line(args, model, prompt)
    check_samples_fit_memory(args, len(prompt_ids), model, device)
    draft = load_draft(args, model, vocab, contents, device) if args.draft else None
    choose_threads(args, model, prompt_ids, device)  # before anything is timed or sampled
    loaded = Loaded(args, path, contents, model, vocab, prompt, prompt_ids, device, sampling,
                    new_generator(device, args.seed), draft)
    mode = speculative if args.draft else interactive if args.interactive else each_line if args.each_line else plain
    mode(loaded)


def main(argv=None) -> None:
    show_status("")  # the modules are loaded
    parser = build_parser()
    for stop_signal in StopSignals.SIGNALS:  # at once, until the text begins: then after the token being drawn
        signal.signal(stop_signal, interrupt_naming_the_signal)

    def command():
        args = parser.parse_args(argv)
        if EARLY_SIGNALS:
            raise Interrupted(EARLY_SIGNALS[0])
        sample(args)

    run_command(parser.prog, command)


if __name__ == "__main__":
    with ignoring_stop_signals_after():
        main()
