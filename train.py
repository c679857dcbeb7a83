"""Train kvgpt on tiny_shakespeare.

    python train.py                                   # preset gpu or cpu, picked from the device found
    python train.py preset=cpu model.n_layer=2 train.max_iters=200
    python train.py train.resume=runs/2025-01-31_12-00-00   # continue a run from its last.pt
    python train.py -m optim.lr=1e-3,2e-3             # a sweep, one run directory per job under runs/multirun/
    torchrun --standalone --nproc_per_node=2 train.py # DDP: NCCL on CUDA, gloo on CPU
    tensorboard --logdir runs

A run writes everything to its directory runs/<date>_<time>/: .hydra/ (the composed config), TensorBoard
events, last.pt (at every evaluation) and best.pt (at the best val loss so far); runs/latest links to it.
Ctrl-C or SIGTERM saves last.pt and exits cleanly.
"""

import dataclasses
import math
import os
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint, save_checkpoint
from data import Batches, DataError, prepare_shakespeare
from devices import choose_device
from model import GPT, GPTConfig

# Settings a resumed run must share with the run it continues: the model, the optimiser and the schedule.
RESUME_MUST_MATCH = ("model.", "optim.", "train.max_iters", "train.batch_size", "train.grad_accum_steps",
                     "train.seed")


class ConfigError(Exception):
    """A setting that cannot work, found before any training. One line; the command line exits with status 2."""


class Diverged(Exception):
    """The loss became NaN or infinite. The weights after that step are never saved."""


class Stopped(Exception):
    """SIGINT or SIGTERM stopped the run after last.pt was saved."""


def main(cfg: DictConfig, run_dir) -> float | None:
    """Train as `cfg` says, writing events and checkpoints to run_dir; return the last val loss."""
    run_dir = Path(run_dir)
    model_config = check_config(cfg)
    resumed = load_resume_checkpoint(cfg)
    for name in ("last.pt", "best.pt"):
        if (run_dir / name).exists():
            raise ConfigError(f"{run_dir} already holds {name}; continue it with train.resume={run_dir}, "
                              f"or give a new hydra.run.dir")
    device = device_for(cfg.device)
    rank, world_size, device = init_distributed(device)
    try:
        return train(cfg, run_dir, model_config, resumed, device, rank, world_size)
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def train(cfg, run_dir: Path, model_config: GPTConfig, resumed: dict | None, device: torch.device,
          rank: int, world_size: int) -> float | None:
    is_master = rank == 0
    tc = cfg.train
    torch.manual_seed(tc.seed + rank)  # dropout differs between processes, like their batches
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls where bf16 autocast does not reach
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    try:
        data = prepare_shakespeare(cfg.data.root, url=cfg.data.url, sha256=cfg.data.sha256,
                                   val_fraction=cfg.data.val_fraction)
        train_batches = Batches(data.train, model_config.block_size, tc.batch_size, device, seed=tc.seed + rank)
    except DataError as e:
        raise ConfigError(str(e)) from None
    vocab = data.vocab
    try:
        prompt = torch.tensor([vocab.encode(tc.sample_prompt)], device=device)
    except DataError as e:
        raise ConfigError(f"train.sample_prompt: {e}") from None
    if resumed is not None and resumed["vocab"] != vocab.chars:
        raise ConfigError(f"the checkpoint's vocabulary differs from that of {cfg.data.root}; "
                          f"resume with the data it was trained on")
    model_config = dataclasses.replace(model_config, vocab_size=len(vocab))

    raw_model = GPT(model_config).to(device)  # the module saved: no torch.compile or DDP prefix in its keys
    optimizer = make_optimizer(raw_model, cfg.optim, fused=device.type == "cuda")
    scheduler = make_scheduler(optimizer, cfg.optim, tc.max_iters)
    step, best_val_loss = 0, math.inf  # step: optimiser steps taken
    if resumed is not None:
        raw_model.load_state_dict(resumed["model"])
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
        step, best_val_loss = resumed["step"], resumed["best_val_loss"]
        restore_rng(resumed["rng"], train_batches, rank, world_size, device)
    model = torch.compile(raw_model) if tc.compile else raw_model
    if world_size > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    config_container = OmegaConf.to_container(cfg, resolve=True)
    tokens_per_step = tc.batch_size * model_config.block_size * tc.grad_accum_steps * world_size
    writer = SummaryWriter(str(run_dir)) if is_master else None
    if is_master:
        writer.add_text("config", as_code(OmegaConf.to_yaml(config_container)))
        link_latest(run_dir, Path(cfg.runs_dir))
        print(f"training {raw_model.num_params() / 1e6:.2f}M parameters on {device} ({world_size} process(es), "
              f"{tokens_per_step} tokens per step) from step {step} to {tc.max_iters}; run directory {run_dir}",
              flush=True)
    bar = tqdm(total=tc.max_iters, initial=step, unit="step", dynamic_ncols=True,
               disable=None if is_master else True)  # None: no bar when stderr is not a terminal

    last_path = run_dir / "last.pt"
    last_val_loss = None
    pending = []  # (loss, grad norm, lr) of the steps since the last log; tensors, read back in one sync
    timer = time.perf_counter()

    def checkpoint_state() -> dict:
        rng = [rng_state(train_batches, device)]
        if world_size > 1:  # every process's generators, so that a resumed DDP run draws what this one would
            ours, rng = rng[0], [None] * world_size
            dist.all_gather_object(rng, ours)
        return {"model_config": dataclasses.asdict(model_config), "vocab": vocab.chars,
                "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "step": step, "best_val_loss": best_val_loss,
                "rng": rng, "config": config_container}

    def diverged(what: str) -> Diverged:
        kept = f"the last good checkpoint is {last_path}" if last_path.exists() else "no checkpoint was saved"
        return Diverged(f"{what}; stopped, {kept}")

    def log_pending():
        """Read the pending steps' values back (the host-device sync), check and log them."""
        nonlocal pending, timer
        if not pending:
            return
        losses = torch.stack([p[0] for p in pending]).tolist()
        norms = torch.stack([p[1] for p in pending]).tolist()
        first = step - len(pending)
        for i, (loss, norm) in enumerate(zip(losses, norms)):
            if not (math.isfinite(loss) and math.isfinite(norm)):
                raise diverged(f"non-finite training loss {loss} (gradient norm {norm}) at step {first + i}")
        tokens_per_sec = tokens_per_step * len(pending) / (time.perf_counter() - timer)
        if is_master:
            for i, (loss, norm, (_, _, lr)) in enumerate(zip(losses, norms, pending)):
                writer.add_scalar("train/loss", loss, first + i)
                writer.add_scalar("train/grad_norm", norm, first + i)
                writer.add_scalar("train/lr", lr, first + i)
            writer.add_scalar("perf/tokens_per_sec", tokens_per_sec, step)
            bar.set_postfix(loss=f"{sum(losses) / len(losses):.4f}", lr=f"{pending[-1][2]:.2e}",
                            tok_s=f"{tokens_per_sec:,.0f}", refresh=False)
        pending, timer = [], time.perf_counter()

    try:
        with StopSignals() as stop:
            while step < tc.max_iters:
                if stop.agreed(step, tc.log_interval, device):
                    log_pending()
                    state = checkpoint_state()
                    if is_master:
                        save_checkpoint(state, last_path)
                        write_hparams(writer, config_container, last_val_loss)
                    raise Stopped(f"stopped by {stop.signal_name} at step {step}: saved {last_path}; "
                                  f"continue with the same command plus train.resume={run_dir}")

                lr = scheduler.get_last_lr()[0]
                loss_sum = torch.zeros((), device=device)
                for micro_step in range(tc.grad_accum_steps):
                    x, y = train_batches.next()
                    # DDP all-reduces gradients during backward(): only the last micro-step's need it
                    sync = world_size == 1 or micro_step == tc.grad_accum_steps - 1
                    with nullcontext() if sync else model.no_sync():
                        with autocast:
                            _, loss = model(x, y)
                        (loss / tc.grad_accum_steps).backward()
                    loss_sum += loss.detach()
                grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.optim.grad_clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                pending.append((loss_sum / tc.grad_accum_steps, grad_norm, lr))
                step += 1
                bar.update()

                evaluating = step % tc.eval_interval == 0 or step == tc.max_iters
                if evaluating or step % tc.log_interval == 0:
                    log_pending()
                if evaluating:
                    losses = evaluate(model, data, model_config.block_size, tc, device, autocast, rank, world_size)
                    if not all(math.isfinite(v) for v in losses.values()):
                        raise diverged(f"non-finite evaluation loss {losses} at step {step}")
                    last_val_loss = losses["val"]
                    improved = last_val_loss < best_val_loss
                    best_val_loss = min(best_val_loss, last_val_loss)
                    state = checkpoint_state()
                    if is_master:
                        save_checkpoint(state, last_path)
                        if improved:
                            save_checkpoint(state, run_dir / "best.pt")
                        writer.add_scalar("val/loss", losses["val"], step)
                        writer.add_scalar("train/eval_loss", losses["train"], step)
                        log_sample_and_attention(writer, raw_model, vocab, prompt, tc, step)
                        tqdm.write(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
                                   f"{' (best)' if improved else ''}, lr {lr:.2e}")
                    timer = time.perf_counter()  # tokens/s counts training only
        if is_master:
            write_hparams(writer, config_container, last_val_loss)
    finally:
        bar.close()
        if writer is not None:
            writer.close()
    if is_master:
        print(f"done: val loss {last_val_loss:.4f} (best {best_val_loss:.4f}); checkpoints in {run_dir}")
    return last_val_loss


def check_config(cfg) -> GPTConfig:
    """Refuse settings that cannot work, before any work; the model's shape as a GPTConfig (vocab_size
    comes from the data later)."""
    try:  # GPTConfig's types and its own checks, e.g. n_embd divisible by n_head
        model_config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GPTConfig), cfg.model))
    except OmegaConfBaseException as e:
        raise ConfigError(f"model.{e.full_key}: {first_line(e)}") from None
    except ValueError as e:
        raise ConfigError(f"model: {first_line(e)}") from None

    def require(key, types, ok, what):
        value = OmegaConf.select(cfg, key)
        if type(value) not in types or not ok(value):
            raise ConfigError(f"{key} must be {what}, got {value!r}")

    for key in ("train.max_iters", "train.batch_size", "train.grad_accum_steps", "train.eval_interval",
                "train.eval_iters", "train.log_interval"):
        require(key, (int,), lambda v: v >= 1, "a positive integer")
    require("train.sample_tokens", (int,), lambda v: v >= 0, "a non-negative integer")
    require("train.seed", (int,), lambda v: v >= 0, "a non-negative integer")
    require("train.compile", (bool,), lambda v: True, "true or false")
    require("optim.warmup_iters", (int,), lambda v: 0 <= v < cfg.train.max_iters,
            f"an integer in [0, train.max_iters={cfg.train.max_iters})")
    number = (int, float)
    require("optim.lr", number, lambda v: v > 0, "a positive number")
    require("optim.min_lr", number, lambda v: 0 <= v <= cfg.optim.lr, f"in [0, optim.lr={cfg.optim.lr}]")
    require("optim.weight_decay", number, lambda v: v >= 0, "a non-negative number")
    require("optim.grad_clip", number, lambda v: v > 0, "a positive number (.inf: no clipping)")
    for key in ("optim.beta1", "optim.beta2"):
        require(key, number, lambda v: 0 <= v < 1, "in [0, 1)")
    return model_config


def load_resume_checkpoint(cfg) -> dict | None:
    """The checkpoint train.resume names (a run directory means its last.pt), checked to fit this config."""
    if cfg.train.resume is None:
        return None
    try:
        ckpt = load_checkpoint(resolve_checkpoint(cfg.train.resume, prefer="last.pt"))
    except CheckpointError as e:
        raise ConfigError(f"train.resume: {e}") from None
    if "optimizer" not in ckpt or "config" not in ckpt:
        raise ConfigError(f"train.resume: {cfg.train.resume} holds weights only, no training state to continue")
    ours, theirs = flatten(OmegaConf.to_container(cfg, resolve=True)), flatten(ckpt["config"])
    differ = [key for key in theirs if key.startswith(RESUME_MUST_MATCH) and ours.get(key) != theirs[key]]
    if differ:
        raise ConfigError(f"train.resume continues a run with other settings; add them to the command: "
                          + " ".join(f"{key}={as_override(theirs[key])}" for key in differ))
    if ckpt["step"] >= cfg.train.max_iters:
        raise ConfigError(f"train.resume: the checkpoint is at step {ckpt['step']}, the end of its schedule "
                          f"(train.max_iters={cfg.train.max_iters}); there is nothing left to train")
    return ckpt


def device_for(name: str) -> torch.device:
    try:
        return choose_device(name)
    except ValueError as e:
        raise ConfigError(f"device={e}") from None


def init_distributed(device: torch.device) -> tuple[int, int, torch.device]:
    """(rank, world size, this process's device); joins the process group that torchrun set up, if any."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world_size, device


def make_optimizer(model: torch.nn.Module, oc, fused: bool) -> torch.optim.AdamW:
    # Decay pulls matrices and embeddings towards zero; biases and LayerNorm gains (1-D) keep their scale.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": oc.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=oc.lr, betas=(oc.beta1, oc.beta2), fused=fused)


def make_scheduler(optimizer, oc, max_iters: int):
    """Linear warmup from lr / warmup_iters to lr, then a cosine decay to min_lr at max_iters."""
    cosine = CosineAnnealingLR(optimizer, T_max=max_iters - oc.warmup_iters, eta_min=oc.min_lr)
    if oc.warmup_iters == 0:
        return cosine
    warmup = LinearLR(optimizer, start_factor=1 / oc.warmup_iters, total_iters=oc.warmup_iters)
    return SequentialLR(optimizer, [warmup, cosine], milestones=[oc.warmup_iters])


@torch.no_grad()
def evaluate(model, data, block_size: int, tc, device, autocast, rank: int, world_size: int) -> dict[str, float]:
    """Mean loss over eval_iters batches of each split (and over the processes). The batches are the same at
    every evaluation, so that evaluations differ only by the weights."""
    model.eval()
    means = []
    for tokens in (data.train, data.val):
        batches = Batches(tokens, block_size, tc.batch_size, device, seed=tc.seed + rank)
        losses = torch.empty(tc.eval_iters, device=device)
        for i in range(tc.eval_iters):
            x, y = batches.next()
            with autocast:
                losses[i] = model(x, y)[1]
        means.append(losses.mean())
    means = torch.stack(means)
    if world_size > 1:
        dist.all_reduce(means)
        means /= world_size
    model.train()
    train_loss, val_loss = means.tolist()
    return {"train": train_loss, "val": val_loss}


def log_sample_and_attention(writer, model: GPT, vocab, prompt, tc, step: int) -> None:
    """A sample continuing the prompt (KV-cache generation, fixed seed) and each layer's attention on it."""
    model.eval()
    generator = torch.Generator(prompt.device).manual_seed(tc.seed)  # leaves the training RNG untouched
    ids = model.generate(prompt, tc.sample_tokens, generator=generator)
    writer.add_text("sample", as_code(vocab.decode(ids[0].tolist())), step)
    context = prompt[:, -model.config.block_size:]
    for layer, weights in enumerate(model.attention_weights(context)):  # (1, n_head, T, T)
        # each query's strongest key white; the heads side by side with a white line between them
        heads = weights[0] / weights[0].amax(dim=-1, keepdim=True)
        image = torch.cat([F.pad(head, (0, 1), value=1.0) for head in heads], dim=1)
        writer.add_image(f"attention/layer_{layer}", image.float().cpu(), step, dataformats="HW")
    model.train()


def write_hparams(writer, config: dict, val_loss: float | None) -> None:
    if val_loss is None:  # stopped before the first evaluation: no result to show
        return
    hparams = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in flatten(config).items()}
    writer.add_hparams(hparams, {"hparam/val_loss": val_loss}, run_name=".")  # ".": in the run's own directory


def rng_state(batches: Batches, device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "batches": batches.state_dict()}
    if device.type != "cpu":
        state["device"] = torch.get_device_module(device).get_rng_state()
    return state


def restore_rng(states: list, batches: Batches, rank: int, world_size: int, device: torch.device) -> None:
    if len(states) != world_size:
        if rank == 0:
            print(f"resuming {len(states)} process(es) as {world_size}: batches and dropout draw afresh from the seed")
        return
    state = states[rank]
    torch.set_rng_state(state["torch"])
    batches.load_state_dict(state["batches"])
    if "device" in state and device.type != "cpu":
        torch.get_device_module(device).set_rng_state(state["device"])


class StopSignals:
    """Turns the first SIGINT or SIGTERM into a request to stop after the current step; a second one
    interrupts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal_name = None
        self._previous = {}

    def __enter__(self):
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if self.signal_name is not None:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def agreed(self, step: int, log_interval: int, device) -> bool:
        """Whether to stop now. Under DDP all processes must stop at the same step: they agree at log
        intervals, so that the exchange costs no extra sync."""
        if not dist.is_initialized():
            return self.signal_name is not None
        if step % log_interval:
            return False
        flag = torch.tensor(float(self.signal_name is not None), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = bool(flag.item())
        if stop and self.signal_name is None:
            self.signal_name = "a signal to another process"
        return stop


def link_latest(run_dir: Path, runs_dir: Path) -> None:
    """Point runs_dir/latest at run_dir, for tensorboard and for people; best-effort."""
    link = runs_dir / "latest"
    tmp = runs_dir / f".latest.{os.getpid()}"
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(os.path.relpath(run_dir.resolve(), runs_dir.resolve()), target_is_directory=True)
        os.replace(tmp, link)  # atomic: readers see the old link or the new one
    except OSError:  # e.g. no symlinks on this file system; sample.py finds the newest best.pt without it
        tmp.unlink(missing_ok=True)


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def as_override(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def as_code(text: str) -> str:
    """Text as a Markdown code block, which is how TensorBoard shows it verbatim."""
    return "\n".join("    " + line for line in text.splitlines())


def config_error_line(error: Exception) -> str:
    """Hydra's and OmegaConf's errors, several lines long, as one."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if isinstance(error, OverrideParseException):  # the last line links to the override grammar
        return f"cannot parse {error.override!r} ({lines[0]}); {lines[-1]}"
    parts = [lines[0].rstrip(".")]
    if error.__cause__ is not None:
        parts.append(first_line(error.__cause__))
    if isinstance(error, MissingConfigException) and error.options:
        parts.append(f"options: {', '.join(error.options)}")
    return "; ".join(parts)


def first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def hydra_main(cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        return main(cfg, run_dir)
    except ConfigError as e:
        if {p.name for p in run_dir.iterdir()} == {".hydra"}:  # a run that never started leaves no directory
            shutil.rmtree(run_dir)
        fail(str(e))
    except Diverged as e:
        fail(str(e), status=1)
    except Stopped as e:
        if is_rank_zero():
            print(e, file=sys.stderr)
        sys.exit(0)  # also ends a multirun: one Ctrl-C stops the whole sweep


def fail(message: str, status: int = 2):
    if is_rank_zero():  # under torchrun every process fails alike: one message is enough
        print(f"train.py: error: {message}", file=sys.stderr)
    sys.exit(status)


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", 0)) == 0


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
        sys.argv += added_overrides(sys.argv[1:])
        hydra_main()
    except ConfigError as e:
        fail(str(e))
    except (HydraException, OmegaConfBaseException) as e:
        fail(config_error_line(e))
    except KeyboardInterrupt:
        fail("interrupted", status=130)
