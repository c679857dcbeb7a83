"""Speculative decoding against plain cached decoding, batch 1, in one run.

    python bench/speculative.py --checkpoint runs/<date>_<time>                      # prompt lookup and n-gram drafts
    python bench/speculative.py --checkpoint runs/<big> --draft runs/<small>         # also a draft checkpoint
    python bench/speculative.py --ceiling-only                                       # the verification pass alone
    python bench/speculative.py --checkpoint runs/<date>_<time> --compiled           # compiled steps and passes

Decoding: --new-tokens new tokens after "ROMEO:" from --checkpoint, plain cached decoding (model/decoding/generate.py) and
speculative decoding (model/serving/speculative.py) with prompt lookup, with the n-gram draft counted over the
checkpoint's training text (its train split: model/serving/ngram_draft.py) and with --draft, for each k, at
temperature 0 and 0.8. Each figure is the median of --repeats runs with their spread (min-max). Plain and
speculative decoding run in turns, and "x plain" is the median of the ratios of each pair: a host whose speed
drifts moves both alike.
Greedy speculative text is checked against plain greedy text; sampled text differs by design (the same
distribution, other draws), so at 0.8 the acceptance rate and the tokens per model pass are what to read.
--compiled: plain decoding takes its one-token steps, and speculative decoding verifies every draft, through
passes compiled ahead of time (model/decoding/aot_step.py), loaded or first compiled by sampling/compiled_step.py.

The ceiling: the classic shape (conf/model/classic.yaml), random weights, fp32, batch 1, a context of --context
tokens in a rotary model's cache with k spare slots: one cached pass over k + 1 = 9 tokens against a one-token step.
A draft that is always right, and free, would decode (k + 1) / that ratio times faster than one token per step.
With --compiled, the same for the checkpoint's own compiled pass at k = 4 and 8.
"""

import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import host, model_config, run_tool  # noqa: E402
from bench.decode import fmt, rates, timings  # noqa: E402
from model import GREEDY, Sampling, build_model, generate  # noqa: E402
from model.decoding.cached_text import text_cache  # noqa: E402
from model.serving.ngram_draft import NGramTable  # noqa: E402
from model.serving.speculative import PromptLookup, SpeculativeStats, speculative_generate  # noqa: E402
from runtime.checkpoint import existing_checkpoint, load_model, training_text  # noqa: E402
from sampling.compiled_step import load_or_compile_step  # noqa: E402
from runtime.errors import OneLineErrorParser, positive_int  # noqa: E402
from model.caches.factory import new_kv_cache

BENCH_PROMPT = "ROMEO:"
KS = (1, 2, 4, 8)
TEMPERATURES = (0.0, 0.8)


def speculative_run(model, prompt, n, draft, k, temperature, verify_pass=None):
    """(new tokens, stats) of one speculative generation, seeded."""
    stats = SpeculativeStats()
    steps = speculative_generate(model, prompt, n, draft=draft, k=k, sampling=sampling_at(temperature),
                                 generator=torch.Generator().manual_seed(0), stats=stats, verify_pass=verify_pass)
    return torch.cat(list(steps)).tolist(), stats


def sampling_at(temperature: float) -> Sampling:
    return GREEDY if temperature == 0 else Sampling(temperature=temperature)


def paired_ratios(plain, speculative, n: int, repeats: int):
    """tok/s of each, and their ratio per pair, each a (median, min, max): the two run in turns, so that a host
    whose speed drifts during the run moves both alike."""
    plain(), speculative()  # warm-up
    plain_s, spec_s = [], []
    for _ in range(repeats):
        for fn, seconds in ((plain, plain_s), (speculative, spec_s)):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
    ratios = sorted(p / s for p, s in zip(plain_s, spec_s))
    return rates(n, plain_s), rates(n, spec_s), (statistics.median(ratios), ratios[0], ratios[-1])


def decoding_table(model, vocab, drafts: dict, n: int, repeats: int, compiled: bool) -> dict:
    """Print the table; return the verifying passes by k (compiled, else None)."""
    prompt = torch.tensor([vocab.encode(BENCH_PROMPT)])
    cache = new_kv_cache(model, 1)
    step = load_or_compile_step(model, cache) if compiled else None
    verify_passes = {k: load_or_compile_step(model, text_cache(model, k), k + 1) if compiled else None for k in KS}
    print("| temperature | draft | k | acceptance | tokens per model pass | plain tok/s | speculative tok/s "
          "| x plain | identical text |")
    print("|---|---|---|---|---|---|---|---|---|")
    for temperature in TEMPERATURES:
        def plain():
            return generate(model, prompt, n, sampling=sampling_at(temperature),
                            generator=torch.Generator().manual_seed(0), cache=cache if compiled else None,
                            step=step)[0, prompt.size(1):].tolist()
        plain_text = plain()
        for name, draft in drafts.items():
            for k in KS:
                text, stats = speculative_run(model, prompt, n, draft, k, temperature, verify_passes[k])
                plain_rate, rate, ratio = paired_ratios(
                    plain, lambda: speculative_run(model, prompt, n, draft, k, temperature, verify_passes[k]), n,
                    repeats)
                same = ("yes" if text == plain_text else "NO") if temperature == 0 else "-"
                print(f"| {temperature} | {name} | {k} | {stats.acceptance_rate:.0%} | {stats.tokens_per_pass:.2f} "
                      f"| {fmt(plain_rate)} | {fmt(rate)} | {ratio[0]:.2f} ({ratio[1]:.2f}-{ratio[2]:.2f}) "
                      f"| {same} |", flush=True)
    return verify_passes


@torch.no_grad()
def ceiling(context: int, k: int, repeats: int) -> None:
    """The classic shape, eager: one cached pass over k + 1 tokens against a one-token step."""
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(model_config("classic"), pos_emb="rope")).eval()
    print_ceiling(f"the classic shape, rotary, random weights, fp32, eager, after {context} tokens", model,
                  lambda ids, cache: model(ids, cache=cache), context, k, repeats)


@torch.no_grad()
def compiled_ceiling(model, verify_pass, k: int, repeats: int) -> None:
    """The checkpoint's compiled pass over k + 1 tokens against the same pass over one token, after half a
    context: what a free draft that is always right would buy against compiled one-token passes."""
    context = model.config.block_size // 2
    print_ceiling(f"the checkpoint, compiled, after {context} tokens", model, verify_pass, context, k, repeats)


def print_ceiling(label: str, model, run_pass, context: int, k: int, repeats: int) -> None:
    """Passes/s of run_pass(ids, cache) over k + 1 tokens and over one, after `context` tokens in a cache with k
    spare slots, and what a draft that is always right, and free, would buy: (k + 1) / their time ratio."""
    cache = text_cache(model, k)
    model(torch.randint(0, model.config.vocab_size, (1, context)), cache=cache)
    chunk = torch.randint(0, model.config.vocab_size, (1, k + 1))

    def pass_of(tokens):
        def run():
            for _ in range(20):  # 20 passes per timing, so that timer resolution does not matter
                run_pass(tokens, cache)
                cache.rollback(tokens.size(1))
        return run

    verify = rates(20, timings(pass_of(chunk), repeats, sync=lambda: None))
    step = rates(20, timings(pass_of(chunk[:, :1]), repeats, sync=lambda: None))
    ratio = step[0] / verify[0]
    print(f"\nceiling: {label}, batch 1 (passes/s, median (min-max) of {repeats})")
    print("| pass | passes/s | time / one-token step |")
    print("|---|---|---|")
    print(f"| one token | {fmt(step)} | 1.00 |")
    print(f"| {k + 1} tokens (k = {k}) | {fmt(verify)} | {ratio:.2f} |")
    print(f"a free draft that is always right: {(k + 1) / ratio:.2f}x one token per step")


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=existing_checkpoint,
                        help="the model decoded (a run directory or checkpoint file)")
    parser.add_argument("--draft", type=existing_checkpoint, help="a draft checkpoint with the same vocabulary")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--new-tokens", type=positive_int, default=500)
    parser.add_argument("--context", type=positive_int, default=200, help="the ceiling's context")
    parser.add_argument("--ceiling-only", action="store_true")
    parser.add_argument("--compiled", action="store_true", help="plain and speculative decoding through compiled "
                        "steps and passes (the ceiling stays eager)")
    args = parser.parse_args()
    if not args.ceiling_only and args.checkpoint is None:
        parser.error("--checkpoint is needed for the decoding table (or --ceiling-only)")
    if args.ceiling_only and (args.draft or args.compiled):
        parser.error(f"--{'draft' if args.draft else 'compiled'} is for the decoding table: drop it or --ceiling-only")
    if args.context > (block := model_config("classic").block_size):
        parser.error(f"--context {args.context} is past the classic shape's block_size {block}")
    if not args.ceiling_only:  # every checkpoint loaded, and refused, before any output
        model, vocab, contents = load_model(args.checkpoint, torch.device("cpu"))
        text = training_text(contents).train
        draft = load_model(args.draft, torch.device("cpu")) if args.draft else None
        if draft and draft[1] != vocab:
            parser.error(f"--draft {args.draft} has another vocabulary than --checkpoint")
    print(f"# speculative decoding benchmark: {host()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, cpu, batch 1, median (min-max) of {args.repeats}{', compiled' if args.compiled else ''}")
    if not args.ceiling_only:
        drafts = {"prompt lookup": PromptLookup()}
        start = time.perf_counter()
        table = NGramTable(torch.from_numpy(text.astype("int64")), model.config.vocab_size)
        print(f"\nthe n-gram draft's table: order {table.order}, min_count {table.min_count}, "
              f"{table.nbytes / 2**20:.1f} MiB, counted in {time.perf_counter() - start:.2f} s")
        drafts[f"n-gram, order {table.order}"] = table
        if draft:
            drafts[f"draft {args.draft}"] = draft[0]
        print(f"\ndecoding: {args.checkpoint}, {args.new_tokens} new tokens after {BENCH_PROMPT!r}")
        verify_passes = decoding_table(model, vocab, drafts, args.new_tokens, args.repeats, args.compiled)
        if args.compiled:
            for k in (4, KS[-1]):
                compiled_ceiling(model, verify_passes[k], k, args.repeats)
    ceiling(args.context, KS[-1], args.repeats)


if __name__ == "__main__":
    run_tool(main)
