"""Train kvgpt on tiny_shakespeare, or on a text of your own.

    python train.py                                   # preset gpu where CUDA or MPS is found, else cpu
    python train.py preset=cpu model.n_layer=2 train.max_iters=200
    python train.py data.text=path/to/any.txt         # your own UTF-8 text, its own vocabulary
    python train.py train.max_minutes=10              # as many steps as fit in 10 minutes on this machine
    python train.py train.resume=runs/2025-01-31_12-00-00   # continue a run from its last.pt, in its directory
    python train.py train.resume=runs/2025-01-31_12-00-00 train.max_iters=3000   # train it on to step 3000
    python train.py -m optim.lr=1e-3,2e-3             # a sweep, one run directory per job under runs/multirun/
    torchrun --standalone --nproc_per_node=2 train.py # DDP: NCCL on CUDA, gloo on CPU
    tensorboard --logdir runs

A run writes everything to its directory runs/<date>_<time>/ (runs started in the same second get -2, -3, ...;
hydra.run.dir=... names another, which must be new): .hydra/ (the composed config), TensorBoard events, last.pt (at
every evaluation) and best.pt (at the best val loss so far). A resumed run goes on in its own directory, unless
hydra.run.dir names a new one. A run that fails before its first step leaves no directory. Ctrl-C, SIGTERM or
SIGHUP (a closed terminal) saves last.pt and exits cleanly; a second one interrupts at once. Under nohup the run
outlives its terminal.
"""

import contextlib
import dataclasses
import os
import sys
import threading
import time
from pathlib import Path

from runtime.installed import require_installed

if __name__ == "__main__":
    require_installed("train.py")

import hydra  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from model import build_model  # noqa: E402
from runtime.devices import choose_device, keep_freed_memory, thread_counts  # noqa: E402
from runtime.command import fail, run_command  # noqa: E402
from runtime.errors import ConfigError, OutputError, exit_status, one_line  # noqa: E402
from runtime.stop_signals import ignoring_stop_signals_after  # noqa: E402
from runtime.streams import write_line  # noqa: E402
from training.applies import named_keys  # noqa: E402
from training.budget import process_started  # noqa: E402
from training.config import explained, register, validate  # noqa: E402
from training.distributed import init_distributed, is_rank_zero  # noqa: E402
from training.hydra_gate import CONFIG_DIR, CONFIG_NAME, VERSION_BASE, info_written, read_flags  # noqa: E402
from training.loop import Stopped, Trainer  # noqa: E402
from training.clock import check_start  # noqa: E402
from training.resume import resumed_settings  # noqa: E402
from training.runs import take_run_dir  # noqa: E402
from runtime.signals import StopSignals, interrupt_on_signals  # noqa: E402
from training.sizing import kept_on_resume, size_to_host, threads_fixed  # noqa: E402
from training.summaries import Summaries, report_thread_error  # noqa: E402
from training.text import check_training_fits_memory, fit_sample_prompt, prepare_data  # noqa: E402

register()
failed_jobs = []  # the exit statuses of a sweep's failed jobs


def main(cfg: DictConfig, run_dir, preset: str | None = None, named: set[str] | None = None,
         started_at: float | None = None) -> float | None:
    """Train as `cfg` says, writing events and checkpoints to run_dir; return the last val loss. preset: which
    preset cfg was composed with and why (preset_picked), for the first line. named: the keys the command line
    names (None: all of cfg's); started_at: when train.max_minutes began to count, on time.perf_counter()'s clock
    (None: now)."""
    run_dir = Path(run_dir)
    started_at = time.perf_counter() if started_at is None else started_at
    settings, resumed, run_id = resumed_settings(validate(cfg, named), named, run_dir)
    check_start(settings.train, named, resumed, started_at)
    rank, world_size, device = init_distributed(device_for(cfg.device))
    try:
        if device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 matmuls where bf16 autocast does not reach
        data = prepare_data(settings, resumed)
        settings, prompt_changed = fit_sample_prompt(settings, data)
        check_training_fits_memory(settings, len(data.vocab), device)
        counts = thread_counts() if world_size == 1 and threads_fixed(settings, device) is None else None
        settings, chosen, why = size_to_host(settings, named, data, device, world_size, started_at)
        model_config = dataclasses.replace(settings.model, vocab_size=len(data.vocab))
        torch.manual_seed(settings.train.seed + rank)  # dropout differs between processes, like their batches
        model = build_model(model_config).to(device)
        used = {**settings.config, "model": dataclasses.asdict(model_config)}  # vocab_size filled in from the data
        with events(run_dir, OmegaConf.to_yaml(used), resumed, rank) as (summaries, watch):
            trainer = watch(Trainer(settings, model, data, device, run_dir, summaries, resumed, rank, world_size,
                                    started_at, run_id=run_id, thread_counts=counts,
                                    chosen=kept_on_resume(settings, named)))
            with trainer.signals:  # from the first line on, a stop signal stops the run as it does while training
                if rank == 0:
                    announce(trainer, chosen, why, preset, world_size)
                    if prompt_changed:
                        write_line(prompt_changed)
                last_val_loss = trainer.fit()
        if rank == 0:
            ended = f", ended early by {trainer.ended_by}" if trainer.ended_by else ""
            write_line(f"done: val loss {last_val_loss:.4f} (best {trainer.best_val_loss:.4f}) at step "
                       f"{trainer.step}{ended}; checkpoints in {run_dir}")
        return last_val_loss
    finally:
        if world_size > 1:
            dist.destroy_process_group()


@contextlib.contextmanager
def events(run_dir: Path, config_yaml: str, resumed: dict | None, rank: int):
    """Rank 0's TensorBoard events (None elsewhere), closed at the end, and watch(trainer), which returns it: a run
    that fails before the trainer's first step (its evaluation at the start included), or on a mistake of its
    settings (a ConfigError: a budget too short), leaves no events behind; one stopped by a signal keeps them."""
    earlier = set(run_dir.glob("events.out.tfevents.*"))
    summaries = Summaries(run_dir, config_yaml, first_step=resumed["training"]["step"] if resumed else 0) \
        if rank == 0 else None
    trainers, kept = [], False
    try:
        yield summaries, lambda trainer: trainers.append(trainer) or trainer
        kept = True
    except BaseException as e:  # a Stopped run saved last.pt, which its events go with
        kept = isinstance(e, Stopped) or not isinstance(e, ConfigError) and \
            any(trainer.step > trainer.start_step for trainer in trainers)
        raise
    finally:
        if summaries is not None:
            summaries.close()
            if not kept:
                for path in set(run_dir.glob("events.out.tfevents.*")) - earlier:
                    path.unlink(missing_ok=True)


def announce(trainer: Trainer, chosen: str, why: str, preset: str | None, world_size: int) -> None:
    """The run's first two lines: what it trains, where, how and to which step; and why that model."""
    tc = trainer.tc
    to = tc.max_iters or f"the steps that fit in train.max_minutes={tc.max_minutes:g} (measured as it trains)"
    write_line(f"training {trainer.raw_model.num_params() / 1e6:.2f}M parameters ({chosen}) on {trainer.device} in "
               f"{trainer.precision} ({f'{preset}; ' if preset else ''}{world_size} process{'es' * (world_size > 1)}, "
               f"{trainer.tokens_per_step} tokens per step) from step {trainer.step} to {to}; run directory "
               f"{trainer.run_dir}")
    write_line(why)


def preset_picked(hydra_config) -> str:
    """Which preset a run was composed with, and why: "preset cpu, as named" where the command line names it,
    else "preset gpu, picked for the cuda found" (conf/config.yaml picks it for the best device present)."""
    preset = hydra_config.runtime.choices.preset
    if any(override.split("=")[0].lstrip("+~") == "preset" for override in hydra_config.overrides.task):
        return f"preset {preset}, as named"
    return f"preset {preset}, picked for the {choose_device('auto').type} found"


def device_for(name: str) -> torch.device:
    try:
        return choose_device(name)
    except ValueError as e:
        raise ConfigError(f"device={e}") from None


@hydra.main(version_base=VERSION_BASE, config_path=str(CONFIG_DIR), config_name=CONFIG_NAME)
def hydra_main(cfg: DictConfig) -> float | None:
    job = HydraConfig.get()
    named = named_keys(job.overrides.task)
    # a sweep's jobs run one after another in one process: each counts its budget from its own start
    started_at = process_started() if job.mode != RunMode.MULTIRUN else time.perf_counter()
    if StopSignals.late is not None:  # it came as the sweep's previous job ended
        if is_rank_zero():
            print(f"stopped by {StopSignals.late} after job {job.job.num - 1}", file=sys.stderr)
        sys.exit(0)
    interrupt_on_signals()  # after a sweep's previous job, signals were only noted
    try:
        take_run_dir(cfg)
        return main(cfg, job.runtime.output_dir, preset_picked(job), named, started_at)
    except Stopped as e:
        if is_rank_zero():
            print(e, file=sys.stderr)
        sys.exit(0)  # also ends a multirun: one Ctrl-C stops the whole sweep
    except Exception as e:
        if not os.path.isdir(job.runtime.output_dir):  # what failed first in it (events, a checkpoint) says less
            e = OutputError(f"the run directory {job.runtime.output_dir} vanished while training (removed or "
                            f"moved); if it was moved, continue the run with train.resume=<its new place>")
        if job.mode != RunMode.MULTIRUN:
            fail("train.py", e, speak=is_rank_zero())
        if is_rank_zero():
            print(f"train.py: error: job {job.job.num} ({' '.join(job.overrides.task)}): {one_line(e)}",
                  file=sys.stderr)
        failed_jobs.append(exit_status(e))  # the sweep goes on with its other jobs, and fails at its end


def command() -> None:
    """train.py's command line: its own flags, then Hydra's run or sweep."""
    flags = read_flags(sys.argv[1:])
    sys.stdout.reconfigure(line_buffering=True)  # evaluation lines reach a log file as they happen
    try:
        with info_written(flags):
            hydra_main()
    except Exception as e:  # an override naming no setting: said as one
        if (said := explained(e)) is not e:
            raise said from None
        raise


if __name__ == "__main__":
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its errors as they are, for fail() to report in one line
    keep_freed_memory()
    interrupt_on_signals()
    threading.excepthook = report_thread_error
    with ignoring_stop_signals_after():
        run_command("train.py", command, ends=(Exception,), speak=is_rank_zero())
    if failed_jobs:
        sys.exit(failed_jobs[0])
