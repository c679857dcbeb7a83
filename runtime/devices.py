"""Which torch device to run on (the one named, or with "auto" the best one present), how many CPU threads, and
whether a training fits in its memory."""

import ctypes
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from decimal import Decimal

import torch

from model import GPTConfig, build_model
from runtime.errors import UsageError


def choose_device(name: str) -> torch.device:
    """'auto' picks cuda, then mps, then cpu. A named device that is absent is a ValueError whose
    one-line message starts with the name, so that callers can prefix their option: `--device cuda is ...`."""
    available = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
    if name == "auto":
        return torch.device(next(device for device, ok in available.items() if ok))
    if name not in available:
        raise ValueError(f"{name!r} is not a device: use auto, cuda, mps or cpu")
    if not available[name]:
        usable = ", ".join(device for device, ok in available.items() if ok)
        raise ValueError(f"{name} is not available on this machine (available: {usable}, or auto)")
    return torch.device(name)


RESOLVED_PRECISIONS = {torch.bfloat16: "bf16", torch.float32: "fp32"}  # what train.precision resolves to, by name


def training_dtype(precision: str, device: torch.device) -> torch.dtype:
    """What train.precision (auto, bf16 or fp32) computes in on `device`: bfloat16 (autocast) or float32. auto
    takes bf16 on CUDA, and on a CPU with native bf16 products (AVX512-BF16 or AMX), where it is the faster
    (docs/benchmarks.md); without them (AVX2 alone) bf16 products are emulated, and auto keeps float32. MPS
    trains in float32: bf16 there is refused, a ValueError."""
    if precision == "auto":
        native_cpu = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return torch.bfloat16 if device.type == "cuda" or (device.type == "cpu" and native_cpu) else torch.float32
    if precision == "bf16" and device.type == "mps":
        raise ValueError("bf16 trains on cuda and cpu only; on mps use fp32 (or auto)")
    return torch.bfloat16 if precision == "bf16" else torch.float32


def memory_needed(config: GPTConfig, batch_size: int) -> int:
    """A lower bound, in bytes, on what training `config` on micro-batches of batch_size takes: fp32 weights,
    gradients and AdamW's two moments (16 bytes a parameter), and each layer's input, which backward keeps (2 bytes
    a value at least, in bf16)."""
    with torch.device("meta"):  # counts the parameters without allocating them
        n_params = sum(p.numel() for p in build_model(config).parameters())
    return 16 * n_params + 2 * batch_size * config.block_size * config.n_layer * config.n_embd


# The largest share of the device's memory a KV cache may take: sample.py's samples with their tokens, serve.py's pool.
MEMORY_SHARE = 0.5


def gib(n: int) -> str:
    """n bytes in GiB, to one decimal, for a count of any size (as a float, one past 1e308 overflows)."""
    return f"{Decimal(n) / 2**30:,.1f}"


def memory_of(device: torch.device) -> int:
    """The device's total memory in bytes (the machine's for cpu and mps)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# torch's thread count for this machine, before anything changes it. On a busy machine fewer threads can be
# faster: a small operation waits for the thread whose core another process holds.
DEFAULT_THREADS = torch.get_num_threads()
clock = time.perf_counter  # what time_in_turns reads (a test's clock stands in for it)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the system keeps one, else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_refused(threads: int) -> str | None:
    """Why a run will not start `threads` threads, in words that follow the option's name, or None: the one rule
    for train.threads, sample.py's --threads, OMP_NUM_THREADS and the benchmarks. A count runs from 1 to the cores
    this process may run on, as torch's own default does: more only wait for one another, and tens of thousands
    cannot all be started (the process dies mid-way)."""
    cores = usable_cores()
    return None if 1 <= threads <= cores else \
        f"must be from 1 to {cores} (the cores this process may run on), got {threads}"


def environment_threads() -> int | None:
    """The thread count OMP_NUM_THREADS names, which torch obeys, or None; a UsageError where it names a count that
    a run will not start (threads_refused)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(value) if value.isdigit() and int(value) > 0 else None
    if threads is not None and (why := threads_refused(threads)):
        raise UsageError(f"OMP_NUM_THREADS {why}: set it lower, or unset it")
    return threads


def thread_counts() -> list[int]:
    """The thread counts worth timing on this machine: 1, 2, 4, ... up to torch's default."""
    return sorted({min(2 ** k, DEFAULT_THREADS) for k in range(DEFAULT_THREADS.bit_length() + 1)})


def time_in_turns(works: dict, rounds: int) -> dict:
    """{key: (work, threads)} -> {key: the median seconds of work()}: each work runs with its thread count, one
    after another in turns, `rounds` timed turns after an untimed one. A machine's speed drifts from second to
    second; works timed in turns share the drift, and their comparison holds."""
    seconds = {key: [] for key in works}
    for turn in range(rounds + 1):
        for key, (work, threads) in works.items():
            torch.set_num_threads(threads)
            start = clock()
            work()
            if turn:
                seconds[key].append(clock() - start)
    return {key: statistics.median(times) for key, times in seconds.items()}


def race_threads(steps: Callable[[], Iterable], rounds: int) -> tuple[int, dict[int, float]]:
    """Set torch's thread count to the one with which iterating steps() runs fastest now; return it and every
    count's median seconds. The counts take turns, fewest threads first, an untimed turn first (time_in_turns).
    A count that has taken longer than the fastest of its turn stops there: it has lost the turn. On a busy machine
    two threads can be many times slower than one, and finishing their work would cost more than the rest."""
    seconds = {threads: [] for threads in thread_counts()}
    for turn in range(rounds + 1):
        fastest = math.inf
        for threads, times in seconds.items():
            torch.set_num_threads(threads)
            start = clock()
            for _ in steps():
                if clock() - start > fastest:
                    break
            fastest = min(fastest, clock() - start)
            if turn:
                times.append(clock() - start)
    medians = {threads: statistics.median(times) for threads, times in seconds.items()}
    threads = min(medians, key=medians.get)
    torch.set_num_threads(threads)
    return threads, medians


def fastest_threads(work: Callable[[], object], rounds: int) -> tuple[int, dict[int, float]]:
    """Set torch's thread count to the one with which work() runs fastest now (time_in_turns); return it and
    every count's seconds."""
    seconds = time_in_turns({threads: (work, threads) for threads in thread_counts()}, rounds)
    threads = min(seconds, key=seconds.get)
    torch.set_num_threads(threads)
    return threads, seconds


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for the next allocation rather than hand it back to the system. By default a
    tensor over about 128 KiB gets fresh pages, which the kernel faults in and zeroes page by page: a CPU
    training step, which frees and allocates its activations at every step, spends a large share of its time
    there. Whether it took effect (not on other C libraries)."""
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False
