"""The val loss through serve.py's API, as an evaluation harness measures it, against kvgpt's own.

    python bench/eval_api.py --checkpoint runs/RUN                 # the whole val split
    python bench/eval_api.py --checkpoint runs/RUN --chars 20000   # its first 20,000 characters

The val split is cut into windows of block_size characters. Each is sent to a serve.py on a free loopback port with
echo, logprobs 0 and max_tokens 0, which scores the text: every token's log-probability but the first's. The mean
negative log-likelihood over those tokens is set beside kvgpt's own: the cross-entropy of one forward pass over the
same windows, in this process. lm-evaluation-harness's `local-completions` scores the same way, from a Python of its
own: bench/lm_eval_api.py runs it against serve.py.
"""

import asyncio
import math
import sys
import time
import urllib.parse
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import check_servable_model, host, run_tool  # noqa: E402
from bench.serve_load import post_completion, start_server  # noqa: E402
from runtime.checkpoint import existing_checkpoint, load_model, training_text  # noqa: E402
from runtime.errors import OneLineErrorParser, positive_int  # noqa: E402

CLIENTS = 8  # windows scored at once


async def scored(port: int, text: str) -> list[float]:
    """The log-probabilities serve.py gives each token of text but the first (null: nothing predicts it)."""
    answer = await post_completion(port, {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0})
    return answer["choices"][0]["logprobs"]["token_logprobs"][1:]


async def score_all(port: int, windows: list[str]) -> list[list[float]]:
    results = [None] * len(windows)
    queue = list(enumerate(windows))

    async def client():
        while queue:
            i, text = queue.pop()
            results[i] = await scored(port, text)

    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return results


@torch.no_grad()
def own_losses(model, ids: list[list[int]]) -> list[float]:
    """kvgpt's cross-entropy of every token of each window but the first, by one forward pass of the window."""
    losses = []
    for window in ids:
        idx = torch.tensor([window])
        logits, _ = model(idx[:, :-1])  # (1, T - 1, vocab_size)
        losses += F.cross_entropy(logits[0].float(), idx[0, 1:], reduction="none").tolist()
    return losses


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=existing_checkpoint, required=True, help="a run directory or .pt file")
    parser.add_argument("--chars", type=positive_int, help="score only the val split's first CHARS characters")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, vocab, contents = load_model(args.checkpoint, "cpu")
    check_servable_model(f"--checkpoint {args.checkpoint}", model)
    val = training_text(contents).val.tolist()[:args.chars]
    block = model.config.block_size
    ids = [val[i:i + block] for i in range(0, len(val) - 1, block) if len(val[i:i + block]) > 1]
    server, url = start_server(args.checkpoint, "--threads", "1", "--max-batch", str(CLIENTS))
    try:
        start = time.perf_counter()
        through_api = asyncio.run(score_all(urllib.parse.urlsplit(url).port, [vocab.decode(w) for w in ids]))
        seconds = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(30)
    api = [-logprob for window in through_api for logprob in window]
    own = own_losses(model, ids)
    worst = max(abs(a - b) for a, b in zip(api, own))
    print(f"# {args.checkpoint}: {len(api):,} val tokens in {len(ids)} windows of {block}; {host()}, "
          f"torch {torch.__version__}")
    print("| scored by | mean NLL (nats) | perplexity |")
    print("|---|---|---|")
    for name, losses in (("serve.py, echo + logprobs", api), ("kvgpt, one forward pass", own)):
        mean = sum(losses) / len(losses)
        print(f"| {name} | {mean:.6f} | {math.exp(mean):.4f} |")
    print(f"largest difference of one token's NLL: {worst:.2e}; the API scored {len(api) / seconds:,.0f} tokens/s")
    print(f"lm-evaluation-harness, from a Python of its own: python bench/lm_eval_api.py --checkpoint "
          f"{args.checkpoint} --lm-eval-python PYTHON")


if __name__ == "__main__":
    run_tool(main)
