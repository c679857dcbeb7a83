"""Compiled code kept on disk: compiling costs tens of seconds once, and loading code compiled before takes
hundredths of a second, without importing torch's compiler (model/decoding/aot_step.py: load_package). It serves
sample.py's decoding steps (sampling/compiled_step.py) and serve.py's engine pass (model/serving/compiled_rows.py).

Compiled code is named by everything that shapes it: the model's config and precision (and, where they are frozen
into it, its weights), the shapes of what it reads and writes, the thread count it is built for (one thread's code
runs serially, and code built for more threads splits its loops), torch's version, the CPU's instruction set and
the model code. It is kept in $KVGPT_CACHE_DIR, else $XDG_CACHE_HOME/kvgpt, else ~/.cache/kvgpt, under steps/.
"""

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

import model as model_package
from model.decoding.aot_step import load_package, quiet_tracing
from model.serving.compiled_rows import CompiledRows, check_invariance, export_rows
from runtime.files import write_atomically

# AOTInductor's settings for code that reads the model's weights where they are (packed=False), and for code with
# them frozen in and laid out for the CPU's matrix kernels (packed=True). Both keep a pass's buffers of fixed size
# on the stack: a one-token pass otherwise spends much of its time allocating them.
ON_THE_STACK = {"aot_inductor.allow_stack_allocation": True}
BUILDS = {False: {**ON_THE_STACK, "aot_inductor.package_constants_in_so": False},
          True: {**ON_THE_STACK, "freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}}


def cache_dir() -> Path:
    if os.environ.get("KVGPT_CACHE_DIR"):
        return Path(os.environ["KVGPT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgpt"


@functools.cache
def model_code_digest() -> str:
    """sha256 of model/'s source, read once per process: a step compiled from other code is another step."""
    digest = hashlib.sha256()
    root = Path(model_package.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def weights_digest(model) -> str:
    """sha256 of the model's weights and buffers, names and bytes: a packed step holds exactly these."""
    digest = hashlib.sha256()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(name.encode() + b"\0" + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


def kept_path(model, packed: bool, threads: int | None, **shape) -> Path:
    """Where compiled code for this model (packed: for these very weights), `threads` CPU threads and what else
    shapes it (shape) is kept: its name is a digest of all that, torch's version, the CPU's and the model code."""
    identity = {
        **shape,
        "config": dataclasses.asdict(model.config),
        "weights": sorted({str(t.dtype) for t in [*model.parameters(), *model.buffers()]}),
        "packed": weights_digest(model) if packed else None,
        "threads": threads or torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "code": model_code_digest(),
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return cache_dir() / "steps" / f"{key}.pt2"


def load_or_compile(path: Path, export, say, options: dict, scratch: Path):
    """Compiled code kept at path, loaded, else exported (export()), compiled with AOTInductor's options and kept
    there; where nothing can be written, compiled to scratch for this run only."""
    if path.is_file():
        try:
            return load_package(path)
        except (RuntimeError, ValueError, OSError) as e:  # damaged, or from an incompatible build
            say(f"the compiled code in {path} could not be loaded ({str(e).splitlines()[0][:120]}); compiling it "
                f"again")
    program = export()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda file: compile_package(program, file, options))
    except OSError as e:  # a read-only or full disk: this run still gets its code
        say(f"cannot keep the compiled code in {path.parent} ({e.strerror or e}); it serves this run only")
        path = scratch
        compile_package(program, str(path), options)  # inductor checks the package's path against its own string
    return load_package(path)


def compile_package(program, package, options: dict) -> None:
    """AOTInductor's build of an exported program into package (a path or a file), with options (BUILDS): a
    shared step's without a copy of the weights, so that it reads the model's own (AotStep), or packed, with
    them frozen in."""
    with quiet_tracing():
        torch._inductor.aoti_compile_and_package(program, package_path=package, inductor_configs=options)


def engine_pass_path(engine) -> Path:
    """Where the engine's compiled pass for its model's very weights and its pool's shape, built for torch's thread
    count now, is kept."""
    pool = engine.pool
    return kept_path(engine.model, True, None, rows=engine.rows, device=engine.device.type,
                     block_tokens=pool.block_tokens, table_width=pool.table_width,
                     pool=[(name, tuple(stores[0].shape), str(stores[0].dtype), len(stores))
                           for name, stores in pool.buffers.items()])


def has_engine_pass(engine) -> bool:
    """Whether the engine's compiled pass is kept, for torch's thread count now."""
    return (cache_dir() / "steps").is_dir() and engine_pass_path(engine).is_file()


def load_or_compile_engine_pass(engine, say=print) -> CompiledRows:
    """The engine's compiled pass (model/serving/compiled_rows.py) for its model's weights as they are now and its
    pool, before any request is in it: loaded if compiled before, else compiled and kept (or, where nothing can be
    written, compiled for this run only). Raises ValueError where its rows are not batch-invariant on this host."""
    model, pool, rows = engine.model, engine.pool, engine.rows
    with tempfile.TemporaryDirectory(prefix="kvgpt-pass-") as folder:
        runner = load_or_compile(engine_pass_path(engine), lambda: export_rows(model, pool, rows), say, BUILDS[True],
                                 Path(folder) / "pass.pt2")
    passes = CompiledRows(runner, pool)
    if why := check_invariance(passes, rows, model.config.vocab_size):
        raise ValueError(f"the compiled pass is not batch-invariant on this host: {why}")
    return passes

