"""sample.py's own speed against the model's cached decode, in one run on the same machine.

    python bench/sample_speed.py

Both decode the classic shakespeare-char shape (random weights, saved as a checkpoint in a temporary
folder) greedily, batch 1, 16-character prompt, 240 new characters, with the KV cache, at --precision (int8
by default: the fastest, where a per-token overhead of the command line would show most). sample.py runs
as the real command, twice: with its output piped (tokens stay on the device until the end) and on a
pseudo-terminal (streaming, one read-back per character). Its tokens/s comes from its own summary line.
The figure to compare is the best of --repeats for each.
"""

import copy
import os
import pty
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import REPO, model_config, run_tool  # noqa: E402
from bench.decode import NEW_TOKENS, PROMPT_LEN, best_seconds  # noqa: E402
from data import CharVocab  # noqa: E402
from model import GREEDY, build_model, generate  # noqa: E402
from model.decoding.quantize import DECODING_PRECISIONS, to_precision  # noqa: E402
from runtime.checkpoint import build_checkpoint, save_checkpoint  # noqa: E402
from runtime.errors import OneLineErrorParser, positive_int  # noqa: E402

VOCAB = CharVocab("\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")  # tiny_shakespeare's 65
PROMPT = "First Citizen:\nB"
SUMMARY = re.compile(r"([\d.]+) tokens/s")


def sample_py_tokens_per_s(checkpoint: Path, on_terminal: bool, precision: str) -> float:
    command = [sys.executable, str(REPO / "sample.py"), "--checkpoint", str(checkpoint), "--prompt", PROMPT,
               "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu", "--precision", precision]
    if on_terminal:
        leader, follower = pty.openpty()
        process = subprocess.Popen(command, stdout=follower, stderr=subprocess.PIPE, text=True)
        os.close(follower)
        while True:  # drain the terminal so that sample.py never blocks on a full buffer
            try:
                if not os.read(leader, 4096):
                    break
            except OSError:  # the terminal closes when sample.py exits
                break
        stderr = process.stderr.read()
        process.wait()
        os.close(leader)
    else:
        process = subprocess.run(command, capture_output=True, text=True)
        stderr = process.stderr
    if process.returncode != 0:
        raise SystemExit(f"sample.py failed: {stderr.strip()}")
    return float(SUMMARY.search(stderr).group(1))


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--precision", choices=DECODING_PRECISIONS, default="int8")
    args = parser.parse_args()
    assert len(PROMPT) == PROMPT_LEN

    torch.manual_seed(0)
    model = build_model(model_config("classic", vocab_size=len(VOCAB))).eval()
    prompt = torch.tensor([VOCAB.encode(PROMPT)])
    decoded = to_precision(copy.deepcopy(model), args.precision)  # as sample.py converts what it loads
    run = lambda: generate(decoded, prompt, NEW_TOKENS, sampling=GREEDY)  # noqa: E731
    model_tokens_per_s = NEW_TOKENS / best_seconds(run, args.repeats, lambda: None)

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_checkpoint(build_checkpoint(model, VOCAB), Path(tmp) / "best.pt")
        piped = max(sample_py_tokens_per_s(checkpoint, False, args.precision) for _ in range(args.repeats))
        streamed = max(sample_py_tokens_per_s(checkpoint, True, args.precision) for _ in range(args.repeats))

    print(f"# sample.py speed: {torch.__version__}, cpu, {torch.get_num_threads()} threads, classic shape, "
          f"prompt {PROMPT_LEN}, {NEW_TOKENS} new, greedy, {args.precision}, best of {args.repeats}")
    print("| decoder | tok/s | / model.decoding.generate |")
    print("|---|---|---|")
    print(f"| model.decoding.generate (cached) | {model_tokens_per_s:.1f} | 1.00 |")
    print(f"| sample.py, piped | {piped:.1f} | {piped / model_tokens_per_s:.2f} |")
    print(f"| sample.py, streaming to a terminal | {streamed:.1f} | {streamed / model_tokens_per_s:.2f} |")


if __name__ == "__main__":
    run_tool(main)
