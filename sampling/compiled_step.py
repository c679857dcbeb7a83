"""Compiled decoding steps, kept on disk as runtime/compiled.py keeps compiled code, named by the model, the cache's
tensors and the device besides.

A step is built one of two ways. A shared step reads the weights of the model it is given, so one serves every
model of its shape. A packed step holds one model's weights, frozen into it and laid out for the CPU's matrix
kernels, which run inside the step's own code: it is the fastest, and it serves that model only.
"""

import copy
import tempfile
from pathlib import Path

import torch

from model.decoding.aot_step import AotStep, export_step, step_signature
from runtime.compiled import BUILDS, cache_dir, kept_path, load_or_compile

# one-token steps after which compiling the step for the first time has paid for itself (docs/benchmarks.md)
COMPILE_PAYS_AFTER = 10_000
DEVICES = ("cpu",)  # where AOTInductor builds steps; on CUDA a step is captured (model/decoding/cuda_graph.py)


def packs(model) -> bool:
    """Whether a packed step computes what the eager step does, up to float32's rounding: for float32 weights. In
    bf16 or int8 its products would round in another order, and the greedy text would change."""
    return all(t.dtype == torch.float32 for t in [*model.parameters(), *model.buffers()])


def step_path(model, cache, tokens: int = 1, packed: bool = False, threads: int | None = None) -> Path:
    """Where the compiled pass of `tokens` tokens per row for this model's shape and precision (packed: for these
    very weights), this cache's shape and `threads` CPU threads (None: torch's count now) is kept."""
    return kept_path(model, packed, threads, tokens=tokens, device=cache.device.type,
                     cache=[type(cache).__name__, *[(name, shape, str(dtype))
                                                    for name, shape, dtype in step_signature(cache)]])


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
    return load_or_compile(step_path(model, cache, tokens, packed), lambda: export_step(model, cache, tokens), say,
                           BUILDS[packed], scratch / f"step-{tokens}.pt2")
