"""Compiled decoding steps kept on disk: compiling costs tens of seconds once, and loading a step compiled before
takes hundredths of a second: its native code is loaded without importing torch's compiler (model/decoding/aot_step.py).

A step is built one of two ways. A shared step reads the weights of the model it is given, so one serves every
model of its shape. A packed step holds one model's weights, frozen into it and laid out for the CPU's matrix
kernels, which run inside the step's own code: it is the fastest, and it serves that model only.

A step is named by everything that shapes its code: the model's config and precision (and a packed step's
weights), the cache's tensors, the device, the thread count it is built for (one thread's code runs serially, and
code built for more threads splits its loops), torch's version, the CPU's instruction set and the model code.
It is kept in $KVGPT_CACHE_DIR, else $XDG_CACHE_HOME/kvgpt, else ~/.cache/kvgpt, under steps/.
"""

import copy
import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

import model as model_package
from model.decoding.aot_step import AotStep, export_step, load_package, quiet_tracing, step_signature
from runtime.files import write_atomically

# one-token steps after which compiling the step for the first time has paid for itself (docs/benchmarks.md)
COMPILE_PAYS_AFTER = 10_000
DEVICES = ("cpu",)  # where AOTInductor builds steps; on CUDA a step is captured (model/decoding/cuda_graph.py)
# AOTInductor's settings for a shared step (packed=False) and a packed one (packed=True). Both keep a pass's
# buffers of fixed size on the stack: a one-token pass otherwise spends much of its time allocating them.
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


def packs(model) -> bool:
    """Whether a packed step computes what the eager step does, up to float32's rounding: for float32 weights. In
    bf16 or int8 its products would round in another order, and the greedy text would change."""
    return all(t.dtype == torch.float32 for t in [*model.parameters(), *model.buffers()])


def weights_digest(model) -> str:
    """sha256 of the model's weights and buffers, names and bytes: a packed step holds exactly these."""
    digest = hashlib.sha256()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(name.encode() + b"\0" + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


def step_path(model, cache, tokens: int = 1, packed: bool = False, threads: int | None = None) -> Path:
    """Where the compiled pass of `tokens` tokens per row for this model's shape and precision (packed: for these
    very weights), this cache's shape and `threads` CPU threads (None: torch's count now) is kept."""
    device = cache.device
    identity = {
        "tokens": tokens,
        "config": dataclasses.asdict(model.config),
        "weights": sorted({str(t.dtype) for t in [*model.parameters(), *model.buffers()]}),
        "packed": weights_digest(model) if packed else None,
        "cache": [type(cache).__name__, *[(name, shape, str(dtype)) for name, shape, dtype in step_signature(cache)]],
        "device": device.type,
        "threads": threads or torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "code": model_code_digest(),
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return cache_dir() / "steps" / f"{key}.pt2"


def prompt_tokens(model, tokens: int = 1) -> int:
    """The most tokens per row of the CPU step sample.py compiles when it asks for passes of `tokens`: at least
    block_size, so that a prompt's chunks go through compiled code too, beside the one-token pass (passes)."""
    return max(tokens, model.config.block_size)


def passes(tokens: int) -> tuple[int, ...]:
    """The compiled passes a step of up to `tokens` tokens per row holds, by the most tokens each takes: the
    one-token pass, which decodes, and for more tokens a pass of 1 to `tokens` (model/decoding/aot_step.py)."""
    return (1,) if tokens == 1 else (1, tokens)


def has_compiled_step(model, cache, tokens: int = 1, packed: bool = False, threads: int | None = None) -> bool:
    """Whether such a step is kept, for `threads` CPU threads (None: torch's count now); where none has ever been
    kept, without naming it (which reads model/'s code)."""
    return (cache_dir() / "steps").is_dir() and all(step_path(model, cache, n, packed, threads).is_file()
                                                    for n in passes(tokens))


def load_or_compile_step(model, cache, tokens: int = 1, say=print, packed: bool = False) -> AotStep:
    """The compiled step of 1 to `tokens` tokens per row (one: the decoding step) for model (packed: for its
    weights as they are now) and caches shaped like `cache`: each of its passes loaded if compiled before, else
    compiled and kept (or, where nothing can be written, compiled for this run only). say: one line to the user."""
    with tempfile.TemporaryDirectory(prefix="kvgpt-step-") as folder:  # where a pass that cannot be kept goes
        runners = {n: load_or_compile_pass(model, cache, n, say, packed, Path(folder)) for n in passes(tokens)}
        step = AotStep(runners, model, cache, packed)
    warm(step, cache)
    return step


@torch.no_grad()
def warm(step: AotStep, cache) -> None:
    """Run each of the step's passes once, over a copy of cache: a pass's first run maps its code and weights into
    memory, which would otherwise slow the first tokens it decodes."""
    twin = copy.deepcopy(cache)
    for most in step.runners:
        step(torch.zeros(twin.batch_size, min(most, 2), dtype=torch.long, device=twin.device), twin)


def load_or_compile_pass(model, cache, tokens: int, say, packed: bool, scratch: Path):
    """One compiled pass of 1 to `tokens` tokens per row, loaded from where it is kept, else compiled and kept
    there; where nothing can be written, compiled into scratch for this run only."""
    path = step_path(model, cache, tokens, packed)
    if path.is_file():
        try:
            return load_package(path)
        except (RuntimeError, ValueError, OSError) as e:  # damaged, or from an incompatible build
            say(f"the compiled step in {path} could not be loaded ({str(e).splitlines()[0][:120]}); compiling it "
                f"again")
    program = export_step(model, cache, tokens)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda file: compile_step(program, file, packed))
    except OSError as e:  # a read-only or full disk: this run still gets its step
        say(f"cannot keep the compiled step in {path.parent} ({e.strerror or e}); it serves this run only")
        path = scratch / f"step-{tokens}.pt2"
        compile_step(program, str(path), packed)  # inductor checks the package's path against its own string
    return load_package(path)


def compile_step(program, package, packed: bool = False) -> None:
    """AOTInductor's build of the exported step into package (a path or a file): without a copy of the weights,
    so that the step reads the model's own (AotStep), or packed, with them frozen in."""
    with quiet_tracing():
        torch._inductor.aoti_compile_and_package(program, package_path=package, inductor_configs=BUILDS[packed])
