"""serve.py's command line, and what it sets up from it: the engine over a pool of KV blocks, and the socket."""

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path

import torch

from model.caches.factory import CACHES
from model.decoding.quantize import DECODING_PRECISIONS
from model.serving.engine import Engine, check_servable, pass_rows
from model.serving.paged import POOLED, BlockPool
from runtime.devices import (DEFAULT_THREADS, MEMORY_SHARE, environment_threads, gib, memory_of, threads_refused,
                             usable_cores)
from runtime.errors import OneLineErrorParser, UsageError, one_line
from runtime.compiled import has_engine_pass, load_or_compile_engine_pass

BLOCK_TOKENS = 16  # --block-tokens's default, as vLLM's
MAX_BATCH = 16
MAX_WAITING = 256  # --max-waiting's default: room for a load test's clients
KEY_VARIABLE = "KVGPT_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description="Serve a kvgpt checkpoint: OpenAI's completions API and a page that "
                                            "shows the KV pool at work (docs/serving.md).")
    parser.add_argument("--checkpoint", metavar="PATH", type=Path,
                        help="checkpoint file, run directory or exported folder (default: the newest best.pt "
                             "under ./runs)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address to listen on (default: %(default)s, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: %(default)s)")
    parser.add_argument("--api-key", metavar="KEY",
                        help=f"the bearer token every /v1 route asks for (default: ${KEY_VARIABLE}, else none)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"), default="auto",
                        help="auto: cuda, else mps, else cpu (default: %(default)s)")
    parser.add_argument("--precision", choices=DECODING_PRECISIONS, default="fp32",
                        help="the weights as trained (fp32), in bf16, or int8 weights (default: %(default)s)")
    parser.add_argument("--kv-cache", choices=tuple(CACHES), default="float",
                        help="the pool's keys and values: float, in the dtype attention computes in, or int8 "
                             "with a scale per token and head; sample.py decodes with the others (default: "
                             "%(default)s)")
    parser.add_argument("--max-batch", metavar="N", type=int, default=MAX_BATCH,
                        help="completions decoded together at most (default: %(default)s)")
    parser.add_argument("--max-waiting", metavar="N", type=int, default=MAX_WAITING,
                        help="completions that may wait beyond those; past it a request gets 429 "
                             "(default: %(default)s)")
    parser.add_argument("--blocks", metavar="N", type=int,
                        help="the pool's KV blocks (default: enough for --max-batch full contexts)")
    parser.add_argument("--block-tokens", metavar="N", type=int, default=BLOCK_TOKENS,
                        help="tokens per block (default: %(default)s)")
    parser.add_argument("--threads", metavar="N", type=int,
                        help="CPU threads that decode (default: one core fewer than torch's count, at least 1)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="serve through the engine's pass built into C++, compiled once for these weights and "
                             "kept (about half a minute): on the CPU, with fp32 weights and a float pool "
                             "(default: there); --no-compile serves eagerly")
    return parser


def serving_threads(args) -> int:
    """--threads, else OMP_NUM_THREADS, else one core fewer than torch's count: the event loop that reads requests
    and streams tokens keeps a core, and no decoding thread waits for it."""
    return args.threads or environment_threads() or max(1, min(DEFAULT_THREADS, usable_cores() - 1))


def check_options(args) -> None:
    for name, least in (("max_batch", 1), ("max_waiting", 0), ("blocks", 1), ("block_tokens", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    if not args.host.strip():  # an empty host would listen on every address
        raise UsageError("--host is empty: give the address to listen on, or leave it out for 127.0.0.1")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be from 0 to 65535, got {args.port}")
    if args.threads is not None and (why := threads_refused(args.threads)):
        raise UsageError(f"--threads {why}")
    if args.kv_cache not in POOLED:
        raise UsageError(f"--kv-cache {args.kv_cache} keeps one text's cache, not a pool of blocks: serve with "
                         f"{' or '.join(POOLED)}; sample.py --kv-cache {args.kv_cache} decodes with it")
    if args.compile and not pass_compiles(args):
        raise UsageError(f"--compile builds the engine's pass for fp32 weights and a float pool, not "
                         f"--precision {args.precision} --kv-cache {args.kv_cache}: leave out --compile, or those")
    source = "--api-key"
    if args.api_key is None and os.environ.get(KEY_VARIABLE):  # an empty variable is taken as unset
        args.api_key, source = os.environ[KEY_VARIABLE], KEY_VARIABLE
    if args.api_key is not None:
        check_api_key(args.api_key, source)


def check_api_key(key: str, source: str) -> None:
    """Refuse a key that no client could send as it is: clients strip spaces and encode non-ASCII differently."""
    if not key.strip():
        raise UsageError(f"{source} is empty: give a key, or leave it out" if source == "--api-key" else
                         f"{source} is empty: set a key in it, or unset it")
    if key != key.strip():
        raise UsageError(f"{source} starts or ends with whitespace, which HTTP clients drop, so none could "
                         f"authenticate: give the key without it")
    odd = sorted({c for c in key if not " " <= c <= "~"})
    if odd:
        raise UsageError(f"{source} has characters that are not printable ASCII ({', '.join(map(repr, odd))}), "
                         f"which clients send in different encodings: use letters, digits and punctuation")


def new_engine(args, model) -> Engine:
    """The engine over a pool that holds at least one full context; by default --max-batch of them."""
    try:
        check_servable(model)
    except ValueError as e:
        raise UsageError(f"serve.py cannot serve this checkpoint: {e}; sample.py decodes it") from None
    bt = args.block_tokens
    per_context = -(-model.config.block_size // bt)
    blocks = args.blocks or args.max_batch * per_context
    if blocks < per_context:
        raise UsageError(f"--blocks {blocks} cannot hold one full context: this model's {model.config.block_size} "
                         f"tokens take {per_context} blocks of {bt}")
    check_pool_fits(args, model, blocks)
    return Engine(model, n_blocks=blocks, block_tokens=bt, max_batch=args.max_batch, int8=args.kv_cache == "int8")


def pass_compiles(args) -> bool:
    """Whether the engine's pass can be compiled for these weights and this pool: fp32 and float (the device is
    known once the model is loaded)."""
    return args.precision == "fp32" and args.kv_cache == "float"


def compile_passes(args, engine: Engine, threads: int) -> None:
    """Give the engine its compiled pass (model/serving/compiled_rows.py) unless --no-compile: the one kept before
    for these weights and this pool, else compiled now and kept. Says on stderr when it compiles; where compiling
    fails, or its code is not batch-invariant on this host, the engine serves eagerly."""
    if engine.device.type != "cpu":
        if args.compile:
            raise UsageError(f"--compile builds the engine's pass for the CPU; on {engine.device.type} the engine "
                             f"captures its own: leave out --compile")
        return
    if args.compile is False or not pass_compiles(args):
        return
    torch.set_num_threads(threads)  # the code is built for the count the engine's thread decodes with
    if not has_engine_pass(engine):
        print("compiling the engine's pass for these weights, once: about half a minute (--no-compile serves "
              "eagerly)", file=sys.stderr)
    try:
        engine.passes = load_or_compile_engine_pass(engine, say=lambda line: print(line, file=sys.stderr))
    except Exception as e:  # noqa: BLE001  no C++ compiler, or code that is not batch-invariant: eager passes serve
        print(f"the engine's compiled pass cannot serve ({one_line(e)[:200]}); serving eagerly", file=sys.stderr)


def check_pool_fits(args, model, blocks: int) -> None:
    """Refuse, before allocating it, a pool larger than the share of memory a KV cache may take (MEMORY_SHARE)."""
    bt, int8, device = args.block_tokens, args.kv_cache == "int8", next(model.parameters()).device
    needed, memory = BlockPool.bytes_needed(model, blocks, bt, int8, pass_rows(args.max_batch)), memory_of(device)
    if needed > MEMORY_SHARE * memory:
        raise UsageError(f"a pool of {blocks} blocks of {bt} tokens for --max-batch {args.max_batch} needs "
                         f"{gib(needed)} GiB, more than {MEMORY_SHARE:.0%} of the {gib(memory)} GiB of "
                         f"{device.type} memory; lower --max-batch or --blocks"
                         f"{'' if int8 else ', or give --kv-cache int8'}")


def model_name(path: Path) -> str:
    """What /v1/models calls the model: an exported folder's name, or a checkpoint's run and file, as 'run/best'."""
    path = path.resolve()
    return path.name if path.is_dir() else f"{path.parent.name}/{path.stem}"


def listening_socket(host: str, port: int) -> socket.socket:
    """The socket bound before the server starts, so that a port in use is one line, and port 0 a free port."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET  # a host name: resolved by bind
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio then sends small writes at once
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}; give another --port or --host") \
            from None
    sock.listen(2048)
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def open_warning(host: str, api_key: str | None) -> str | None:
    """The warning for a server that anyone who reaches the machine can use; None when it needs a key or stays on it."""
    if api_key is None and not is_loopback(host):
        return (f"warning: listening on {host} without an API key: anyone who reaches this machine can use it "
                f"(give --api-key)")
    return None
