"""Train kvgpt on tiny_shakespeare, or on a text of your own.

    python train.py                                   # preset gpu or cpu, picked from the device found
    python train.py preset=cpu model.n_layer=2 train.max_iters=200
    python train.py data.text=path/to/any.txt         # your own UTF-8 text, its own vocabulary
    python train.py train.resume=runs/2025-01-31_12-00-00   # continue a run from its last.pt
    python train.py -m optim.lr=1e-3,2e-3             # a sweep, one run directory per job under runs/multirun/
    torchrun --standalone --nproc_per_node=2 train.py # DDP: NCCL on CUDA, gloo on CPU
    tensorboard --logdir runs

A run writes everything to its directory runs/<date>_<time>/ (runs started in the same second get -2, -3, ...):
.hydra/ (the composed config), TensorBoard events, last.pt (at every evaluation) and best.pt (at the best val loss
so far). A run that fails before its first step leaves no directory. Ctrl-C or SIGTERM saves last.pt and exits
cleanly.
"""

import dataclasses
import os
import shutil
import sys
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data import (SHAKESPEARE, Batches, DataError, PreparedData, UnknownCharacterError, prepare_shakespeare,
                  prepare_text)
from model import GPT
from training.checkpoint import CheckpointError, resolve_checkpoint, trained_on
from training.config import ConfigError, TrainConfig, config_error_line, register, validate
from training.devices import choose_device
from training.distributed import init_distributed, is_rank_zero
from training.files import os_error_line, remove_stale_temporaries
from training.loop import Diverged, Stopped, Trainer
from training.resume import load_resume_checkpoint
from training.runs import claim_run_dir, refuse_used_dirs
from training.summaries import Summaries

register()
OmegaConf.register_new_resolver("new_run_dir", claim_run_dir)  # conf/config.yaml's hydra.run.dir and sweep.dir


def main(cfg: DictConfig, run_dir) -> float | None:
    """Train as `cfg` says, writing events and checkpoints to run_dir; return the last val loss."""
    run_dir = Path(run_dir)
    earlier_events = set(run_dir.glob("events.out.tfevents.*"))
    settings = validate(cfg)
    config = OmegaConf.to_container(cfg, resolve=True)
    tc = settings.train
    resumed = None
    if tc.resume is not None:
        resumed = load_resume_checkpoint(tc.resume, config, tc.max_iters, settings.optim)
        if is_rank_zero():  # what a run killed mid-save left beside its checkpoints
            remove_stale_temporaries(resolve_checkpoint(tc.resume, prefer="last.pt").parent)
    for name in ("last.pt", "best.pt"):
        if (run_dir / name).exists():
            raise ConfigError(f"{run_dir} already holds {name}; continue it with train.resume={run_dir}, "
                              f"or give a new hydra.run.dir")
    rank, world_size, device = init_distributed(device_for(cfg.device))
    try:
        torch.manual_seed(tc.seed + rank)  # dropout differs between processes, like their batches
        if device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 matmuls where bf16 autocast does not reach
        data = prepare_data(settings)
        if resumed is not None and resumed.get("text", {}).get("sha256") != data.sha256:
            raise ConfigError(f"train.resume: the checkpoint was trained on {trained_on(resumed)}, not on "
                              f"{data.source}; resume with the text it was trained on (data.text)")
        model = GPT(dataclasses.replace(settings.model, vocab_size=len(data.vocab))).to(device)
        used = {**config, "model": dataclasses.asdict(model.config)}  # vocab_size filled in from the data
        summaries = Summaries(run_dir, OmegaConf.to_yaml(used)) if rank == 0 else None
        started = False
        try:
            trainer = Trainer(settings, model, data, device, run_dir, config, summaries, resumed, rank, world_size)
            started = True
            if rank == 0:
                print(f"training {model.num_params() / 1e6:.2f}M parameters on {device} ({world_size} "
                      f"process(es), {trainer.tokens_per_step} tokens per step) from step {trainer.step} to "
                      f"{tc.max_iters}; run directory {run_dir}", flush=True)
            last_val_loss = trainer.fit()
        finally:
            if summaries is not None:
                summaries.close()
                if not started:  # a run that never took a step leaves no events behind
                    for path in set(run_dir.glob("events.out.tfevents.*")) - earlier_events:
                        path.unlink(missing_ok=True)
        if rank == 0:
            print(f"done: val loss {last_val_loss:.4f} (best {trainer.best_val_loss:.4f}); checkpoints in {run_dir}")
        return last_val_loss
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def prepare_data(settings) -> PreparedData:
    """The text data.text names (tiny_shakespeare when none), obtained and encoded, checked to fit the settings:
    splits longer than the model's context, a sample prompt made of the text's characters."""
    dc = settings.data
    try:
        if dc.text is None:
            data = prepare_shakespeare(Path(dc.root) / SHAKESPEARE, val_fraction=dc.val_fraction)
        else:
            data = prepare_text(dc.text, dc.root, val_fraction=dc.val_fraction)
    except DataError as e:
        raise ConfigError(str(e)) from None
    for split in ("train", "val"):  # found now rather than at the first evaluation
        try:
            Batches(getattr(data, split), settings.model.block_size, batch_size=1)
        except DataError as e:
            raise ConfigError(f"the {split} split of {data.source} is too short: {e}") from None
    try:
        data.vocab.encode(settings.train.sample_prompt)
    except UnknownCharacterError as e:
        default = " (by default a line of Romeo and Juliet)" \
            if settings.train.sample_prompt == TrainConfig.sample_prompt else ""
        raise ConfigError(f"train.sample_prompt{default} has characters not in the vocabulary of {data.source} "
                          f"({', '.join(map(repr, e.chars))}); set train.sample_prompt='...' to text made of its "
                          f"characters") from None
    return data


def device_for(name: str) -> torch.device:
    try:
        return choose_device(name)
    except ValueError as e:
        raise ConfigError(f"device={e}") from None


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def hydra_main(cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        return main(cfg, run_dir)
    except ConfigError as e:
        fail(str(e))
    except (Diverged, CheckpointError) as e:  # CheckpointError: a checkpoint could not be saved
        fail(str(e), status=1)
    except OSError as e:  # a full disk, a closed stdout, ...: the machine failed, not the settings
        fail(os_error_line(e), status=1)
    except Stopped as e:
        if is_rank_zero():
            print(e, file=sys.stderr)
        sys.exit(0)  # also ends a multirun: one Ctrl-C stops the whole sweep
    finally:
        if is_rank_zero() and run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra"}:
            shutil.rmtree(run_dir, ignore_errors=True)  # a run that never started leaves no directory


def fail(message: str, status: int = 2):
    if is_rank_zero():  # under torchrun every process fails alike: one message is enough
        print(f"train.py: error: {message}", file=sys.stderr)
    sys.exit(status)


def added_overrides(argv: list[str]) -> list[str]:
    """Overrides train.py adds to the command line before Hydra reads it."""
    added = []
    if not any(arg.lstrip("+~").startswith("preset=") for arg in argv):
        # Hydra composes the config before any code of ours runs, so the preset is chosen here
        requested = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("device=")), "auto")
        device = device_for(requested)
        preset = "cpu" if device.type == "cpu" else "gpu"
        added.append(f"preset={preset}")
        if is_rank_zero():
            other = "gpu" if preset == "cpu" else "cpu"
            print(f"preset={preset} for the {device.type} device found (preset={other} to choose the other)",
                  file=sys.stderr)
    if not is_rank_zero():
        # torchrun: only rank 0 writes a run directory; the others must not create one of their own
        added += ["hydra.output_subdir=null", "hydra.run.dir=${runs_dir}"]
    return added


if __name__ == "__main__":
    # Hydra reports its own errors (a bad override, an unknown preset) in several lines with exit status 1;
    # this lets them through to be reported in one line with status 2, like ours.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    sys.stdout.reconfigure(line_buffering=True)  # evaluation lines reach a log file as they happen
    try:
        if is_rank_zero():
            refuse_used_dirs(sys.argv[1:])
        sys.argv += added_overrides(sys.argv[1:])
        hydra_main()
    except ConfigError as e:
        fail(str(e))
    except OSError as e:  # Hydra could not write the run's .hydra/: runs_dir is read-only, a file, ...
        fail(f"cannot create the run directory ({os_error_line(e)})")
    except (HydraException, OmegaConfBaseException) as e:
        fail(config_error_line(e))
    except KeyboardInterrupt:
        fail("interrupted", status=130)
