"""lm-evaluation-harness's local-completions against serve.py: its perplexity of val windows, beside kvgpt's own.

    python bench/lm_eval_api.py --checkpoint runs/RUN --lm-eval-python VENV/bin/python
    python bench/lm_eval_api.py --checkpoint runs/RUN --lm-eval-python VENV/bin/python --chars 20000

lm-eval runs in a Python of its own (--lm-eval-python: a venv with `pip install "lm-eval[api]" transformers`), against a
serve.py on a free loopback port. Its local-completions scores a loglikelihood request with echo, logprobs and
max_tokens 1, so a prompt leaves room for one drawn token: the val split is cut into whole windows of block_size - 1
characters, each begun at a character that is not whitespace (lm-eval moves a context's trailing whitespace into its
continuation). Each window is one document of a task written to a temporary folder: its first character the context,
the rest (block_size - 2 characters) the continuation. lm-eval counts tokens with the tokenizer of this checkpoint's
export for transformers, and sends text. Its perplexity is exp(-mean log-likelihood of a continuation), so
ln(perplexity) / (block_size - 2) is the mean NLL per character, set beside kvgpt's own over the same windows.
"""

import json
import math
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import check_servable_model, host, run_tool  # noqa: E402
from bench.eval_api import CLIENTS, own_losses  # noqa: E402
from bench.other_python import check_module, export, run, version  # noqa: E402
from bench.serve_load import start_server  # noqa: E402
from runtime.checkpoint import existing_checkpoint, load_model, training_text  # noqa: E402
from runtime.errors import OneLineErrorParser, UsageError, positive_int  # noqa: E402

TASK = "kvgpt_val"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}  # the task and tokenizer are local files


def windows(val: list[int], width: int, blank: set[int]) -> list[list[int]]:
    """Disjoint windows of width tokens of val, each begun at a token not in blank."""
    found, i = [], 0
    while True:
        while i < len(val) and val[i] in blank:
            i += 1
        if i + width > len(val):
            return found
        found.append(val[i:i + width])
        i += width


def write_task(folder: Path, windows: list[str]) -> Path:
    """A task of one loglikelihood document per window, read from a local JSON-lines file: its folder."""
    tasks = folder / "tasks"
    tasks.mkdir()
    data = folder / "val.jsonl"
    data.write_text("".join(json.dumps({"context": w[:1], "continuation": w[1:]}) + "\n" for w in windows))
    (tasks / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: context\ndoc_to_target: continuation\n"
        'target_delimiter: ""\nmetric_list:\n  - metric: perplexity\n    aggregation: perplexity\n'
        "    higher_is_better: false\n")
    return tasks


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=existing_checkpoint, required=True, help="a run directory or .pt file")
    parser.add_argument("--lm-eval-python", required=True, help="a Python that can import lm_eval")
    parser.add_argument("--chars", type=positive_int, help="score only the val split's first CHARS characters")
    args = parser.parse_args()
    check_module("--lm-eval-python", args.lm_eval_python, "lm-evaluation-harness", '"lm-eval[api]" transformers',
                 "lm_eval", "transformers")  # transformers: the export's tokenizer counts the tokens
    torch.set_num_threads(1)
    model, vocab, contents = load_model(args.checkpoint, "cpu")
    check_servable_model(f"--checkpoint {args.checkpoint}", model)
    block = model.config.block_size
    val = training_text(contents).val.tolist()[:args.chars]
    ids = windows(val, block - 1, {i for i in range(model.config.vocab_size) if vocab.decode([i]).isspace()})
    if not ids:
        raise UsageError(f"--chars {args.chars}: a window is {block - 1} characters")
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        tokenizer = export(args.checkpoint, folder / "export")
        tasks = write_task(folder, [vocab.decode(w) for w in ids])
        server, url = start_server(args.checkpoint, "--threads", "1", "--max-batch", str(CLIENTS))
        try:
            served = json.load(urllib.request.urlopen(f"{url}/v1/models"))["data"][0]["id"]
            model_args = (f"model={served},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                          f"tokenizer={tokenizer},tokenized_requests=False,max_length={block},"
                          f"num_concurrent={CLIENTS},max_retries=1")
            command = [args.lm_eval_python, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
                       model_args, "--tasks", TASK, "--include_path", str(tasks), "--output_path",
                       str(folder / "out")]
            start = time.perf_counter()
            run(command, "lm_eval", env=os.environ | OFFLINE)
            seconds = time.perf_counter() - start
        finally:
            server.terminate()
            server.wait(30)
        results = json.loads(next((folder / "out").rglob("results_*.json")).read_text())
    lm_eval_version = version(args.lm_eval_python, "lm_eval")
    perplexity = results["results"][TASK]["perplexity,none"]
    lm_eval_nll = math.log(perplexity) / (block - 2)
    own = own_losses(model, ids)
    own_nll = sum(own) / len(own)
    print(f"# {args.checkpoint}: {len(own):,} val characters scored in {len(ids)} windows of {block - 1}; "
          f"lm-eval {lm_eval_version}, local-completions; {host()}, torch {torch.__version__}")
    print(f"lm-eval's perplexity of a continuation ({block - 2} characters): {perplexity:.6g}, "
          f"in {seconds:.0f} s with its start")
    print("| scored by | mean NLL (nats per character) | perplexity per character |")
    print("|---|---|---|")
    for scorer, nll in (("lm-eval local-completions through serve.py", lm_eval_nll),
                        ("kvgpt, one forward pass", own_nll)):
        print(f"| {scorer} | {nll:.6f} | {math.exp(nll):.4f} |")
    print(f"difference of the means: {abs(lm_eval_nll - own_nll):.2e}")


if __name__ == "__main__":
    run_tool(main)
