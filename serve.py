"""Serve a kvgpt checkpoint: OpenAI's completions API, and a page that shows the KV pool at work.

    python serve.py                                  # the newest run's best.pt, on http://127.0.0.1:8000
    python serve.py --checkpoint runs/<run> --max-batch 32 --kv-cache int8
    python serve.py --host 0.0.0.0 --api-key SECRET  # other machines too, with a key

Every request of every client goes into one engine (model/serving/engine.py): one pool of KV blocks, continuous
batching, and the prefix cache across requests. Open the URL it prints for the page; point any OpenAI client at
URL/v1. Once it has printed its URL, SIGTERM, Ctrl-C or SIGHUP stops it with status 0: running streams end with an
error event. Before then, while it loads, a stop signal interrupts it (status 130). A mistake in the command line is
one line on stderr with status 2. docs/serving.md says more.
"""

import sys

from runtime.installed import DECODING, require_installed

if __name__ == "__main__":
    require_installed("serve.py", DECODING)

from runtime.checkpoint import find_latest_checkpoint, load_model, resolve_checkpoint  # noqa: E402
from runtime.devices import choose_device  # noqa: E402
from runtime.command import run_command  # noqa: E402
from runtime.errors import UsageError  # noqa: E402
from runtime.signals import interrupt_on_signals  # noqa: E402
from runtime.stop_signals import ignoring_stop_signals_after  # noqa: E402

try:
    from server.app import StoppingServer, build_app
except ImportError as missing:  # the optional extra is not installed
    NEEDS = f"serve.py needs fastapi and uvicorn ({missing.name} is missing): pip install -r requirements-serve.txt"
else:
    NEEDS = ""
from server.options import (build_parser, check_options, compile_passes, listening_socket, model_name,  # noqa: E402
                            new_engine, open_warning, serving_threads)
from server.protocol import Limits  # noqa: E402
from server.runner import EngineRunner  # noqa: E402


def serve(args) -> None:
    if NEEDS:
        raise UsageError(NEEDS)
    check_options(args)
    try:
        device = choose_device(args.device)
    except ValueError as e:
        raise UsageError(f"--device {e}") from None
    path = resolve_checkpoint(args.checkpoint) if args.checkpoint else find_latest_checkpoint("runs")
    model, vocab, _ = load_model(path, device, precision=args.precision)
    engine, threads = new_engine(args, model), serving_threads(args)
    compile_passes(args, engine, threads)
    runner = EngineRunner(engine, vocab.decode, args.max_waiting, threads)
    limits = Limits(model_name(path), model.config.block_size, runner.capacity)
    app = build_app(runner, vocab, limits, args.api_key)
    sock = listening_socket(args.host, args.port)
    server = StoppingServer(app, runner)
    server.take_signals()  # before the URL: whoever reads it may stop the server at once
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {path} as {limits.model!r} on {device.type}: http://{shown}:{port} (the page), "
          f"http://{shown}:{port}/v1 (the API)", flush=True)
    if warning := open_warning(args.host, args.api_key):  # once bound: a host it cannot listen on is an error alone
        print(warning, file=sys.stderr)
    runner.start()
    server.run(sockets=[sock])


def main(argv=None) -> None:
    parser = build_parser()
    interrupt_on_signals()  # until the server takes them: loading is cut short, with status 130
    run_command(parser.prog, lambda: serve(parser.parse_args(argv)))


if __name__ == "__main__":
    with ignoring_stop_signals_after():
        main()
