"""The training loop: steps, periodic logging, evaluation and checkpoints, stopping on a signal."""

import math
import time
import uuid
from contextlib import nullcontext
from pathlib import Path

import torch
from tensorboard.plugins.hparams.api_pb2 import STATUS_FAILURE, STATUS_SUCCESS
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from tqdm import tqdm

from data import Batches, PreparedData
from model import GPT
from runtime.checkpoint import build_checkpoint, load_checkpoint, save_checkpoint
from runtime.devices import RESOLVED_PRECISIONS, training_dtype
from runtime.errors import ConfigError
from runtime.signals import StopSignals
from runtime.streams import write_line

from . import budget as timing
from .budget import Budget
from .clock import Clock, Plan, repeated_by
from .config import Settings
from .distributed import gather
from .evaluation import evaluate
from .optim import Schedule, make_optimizers, make_scheduler, set_step
from .rng import restore_rng, rng_state
from .summaries import Summaries
from .threads import ThreadChoice


class Diverged(Exception):
    """The loss became NaN or infinite. The weights after that step are never saved."""


class Stopped(Exception):
    """A stop signal (SIGINT, SIGTERM, SIGHUP) stopped the run after last.pt was saved."""


class Trainer:
    """Trains one model on one process (of world_size), from step 0 or from a checkpoint's training state.
    Rank 0 alone writes checkpoints, events and progress."""

    def __init__(self, settings: Settings, model: GPT, data: PreparedData, device: torch.device, run_dir: Path,
                 summaries: Summaries | None, resumed: dict | None = None, rank: int = 0, world_size: int = 1,
                 started_at: float | None = None, run_id: str | None = None, thread_counts: list[int] | None = None,
                 chosen: tuple[str, ...] = ()):
        """summaries: rank 0's TensorBoard events. A sample_prompt outside the data's vocabulary is an
        UnknownCharacterError, raised before any step. started_at: when train.max_minutes began to count, on
        training/budget.py's clock (default: now). run_id: the run directory's identity, which the checkpoints
        record (a new one when None). thread_counts: the counts to choose among again when the steps slow down
        (training/threads.py); None: the count stays. chosen: the settings the run chose rather than the command
        ("model.n_layer", ...: what sizing chose), which a command that repeats it names (repeated_by)."""
        tc = self.tc = settings.train
        self.chosen = {key: settings.config[section][name] for key in chosen for section, name in [key.split(".")]}
        try:
            self.dtype = training_dtype(tc.precision, device)  # bfloat16: the steps and evaluations run under autocast
        except ValueError as e:
            raise ConfigError(f"train.precision={e}") from None
        self.precision = RESOLVED_PRECISIONS[self.dtype]  # what train.precision resolved to
        self.settings, self.data, self.device, self.run_dir = settings, data, device, run_dir
        self.rank, self.world_size, self.is_master = rank, world_size, rank == 0
        self.run_id = run_id or uuid.uuid4().hex
        self.raw_model = model  # the module trained: no torch.compile or DDP prefix in its keys
        self.vocab = data.vocab
        self.prompt = torch.tensor([self.vocab.encode(tc.sample_prompt)], device=device)
        self.batches = Batches(data.train, model.config.block_size, tc.batch_size, device, seed=tc.seed + rank)
        self.budget = Budget(tc.max_minutes, timing.clock() if started_at is None else started_at)
        self.optimizers = make_optimizers(model, settings.optim, fused=device.type == "cuda")
        # With a budget, fit() fixes the length as it trains, and plans it again as the speed changes; until
        # then the schedule is open (see Schedule)
        self.schedule = Schedule(settings.optim, tc.max_iters)
        self.schedulers = [make_scheduler(o, self.schedule) for o in self.optimizers]
        compile_if_asked = torch.compile if tc.compile else lambda module: module
        compiled = compile_if_asked(model)
        self.model = DDP(compiled, device_ids=[device.index] if device.type == "cuda" else None) \
            if world_size > 1 else compiled  # DDP gives every process rank 0's weights
        self.ema = None  # with train.ema_decay, the moving average of the weights, updated after every step
        if tc.ema_decay is not None:  # made after DDP's copy of the weights: every process averages the same ones
            self.ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(tc.ema_decay))
            self.ema.update_parameters(model)  # the first update copies: the average starts at the initial weights
        self.eval_model = model if self.ema is None else self.ema.module  # evaluated, sampled and saved as `model`
        self.step, self.best_val_loss, self.last_val_loss = 0, math.inf, None  # step: optimiser steps taken
        self.best_step, self.since_best = None, 0  # best.pt's step; evaluations since it (train.patience)
        self.ended_by = None  # why the run ends before its max_iters, in words (train.patience)
        # every CPU thread count the run's steps ran at, in all its lives: sums round apart at each (repeated_by)
        self.threads_used = {torch.get_num_threads()} if device.type == "cpu" else set()
        self.resumed = resumed is not None
        if self.resumed:
            self.restore(resumed)
        self.start_step = self.step
        self.clock = Clock(self.budget, tc, settings.optim, world_size, self.start_step, self.resumed)
        self.evaluated = self.model if self.ema is None else compile_if_asked(self.eval_model)  # what evaluations run
        self.autocast = torch.autocast(device.type, dtype=self.dtype) if self.dtype != torch.float32 else nullcontext()
        self.tokens_per_step = tc.batch_size * model.config.block_size * tc.grad_accum_steps * world_size
        self.signals = StopSignals()  # what fit() does on SIGINT and SIGTERM
        self.threads = ThreadChoice(torch.get_num_threads(), thread_counts) if thread_counts else None
        self.pending = []  # (loss, grad norm, lrs, wall time) of the steps since the last log; read back in one sync
        self.trained_since = None  # (step, clock time) since which the next evaluation line counts tokens/s
        self.summaries = summaries

    def restore(self, resumed: dict) -> None:
        state = resumed["training"]
        self.eval_model.load_state_dict(resumed["model"])
        if self.ema is not None:  # the checkpoint's model is the average; the weights it averages are kept beside it
            self.raw_model.load_state_dict(state["raw_model"])
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(optimizer_state)
        # the plan it recorded; extended (or shortened): the rates of a run planned for max_iters from the start
        same = state["config"]["train"]["max_iters"] == self.tc.max_iters
        self.schedule.set(state.get("plan") if same and "plan" in state else self.tc.max_iters)
        for scheduler in self.schedulers:
            set_step(scheduler, state["step"])
        self.step, self.best_val_loss = state["step"], state["best_val_loss"]
        self.best_step, self.since_best = state.get("best_step"), state.get("since_best", 0)
        self.threads_used.update(state.get("threads", ()) if self.threads_used else ())
        if self.tc.max_minutes is not None:  # a budget counts the run's earlier lives too, and knows their costs
            self.budget.started_at -= state.get("seconds", 0.0)
            self.budget.resumed(state)
        if not restore_rng(state["rng"], self.batches, self.rank, self.world_size, self.device) and self.is_master:
            before = len(state["rng"])
            print(f"resuming a run of {before} process{'es' * (before > 1)} with {self.world_size}: its batches and "
                  f"dropout cannot go on where they stopped, so they start afresh from the seed")

    def fit(self) -> float | None:
        """Train to max_iters (with a budget, to the steps that fit in it); return the last val loss (None if no
        evaluation ran)."""
        self.timer = time.perf_counter()
        with self.signals as stop:
            if self.tc.max_minutes is not None:
                self.clock.check(self.step, self.evaluation)
            if self.step % self.tc.eval_interval == 0:  # a run resumed between evaluations adds no point of its own
                self.evaluate_and_save()
            if self.tc.max_iters is not None:  # else once the budget has fixed it
                self.start_session()
            self.budget.start(self.step)
            if self.resumed and self.tc.max_iters is not None and self.tc.max_minutes is not None:
                self.follow(self.clock.resumed(self.step, self.tc.max_iters, len(self.schedule.plan) > 1))
            self.trained_since = (self.step, timing.clock())
            with tqdm(total=self.tc.max_iters, initial=self.step, unit="step", dynamic_ncols=True,
                      disable=None if self.is_master else True) as bar:  # None: no bar unless stderr is a terminal
                while self.tc.max_iters is None or self.step < self.tc.max_iters:
                    if stop.agreed():
                        self.stop(stop.signal_name)
                    self.timed_step()
                    bar.update()
                    due = self.step % self.tc.eval_interval == 0  # an evaluation this step takes anyway
                    if self.tc.max_iters is None:
                        self.follow(self.clock.fix(self.step, self.threads_used, self.chosen))
                    elif self.tc.max_minutes is not None and self.step < self.tc.max_iters:
                        self.keep_to_budget(due)
                    if bar.total != self.tc.max_iters:
                        bar.total = self.tc.max_iters
                        bar.refresh()
                    evaluating = due or self.step == self.tc.max_iters
                    if evaluating or self.step % self.tc.log_interval == 0:
                        self.log_pending(bar)
                    if evaluating:
                        self.evaluate_and_save()
                    if self.ended_by:
                        break
        self.end_session(STATUS_SUCCESS)
        return self.last_val_loss

    def keep_to_budget(self, due: bool) -> None:
        """Once the budget has fixed the length: follow the clock's new plan, if the speed has changed or the run must
        end at this step (Clock.kept). due: this step evaluates anyway."""
        self.follow(self.clock.kept(self.step, self.tc.max_iters, due, len(self.schedule.plan) > 1))

    def follow(self, plan: Plan | None) -> None:
        """The run's length is now plan.steps (None: the plan stands): the schedule and the settings change with it,
        rank 0 says why and records it."""
        if plan is None:
            return
        if plan.first:  # this step's rate is the open schedule's: the plan's decay begins here or later
            self.schedule.set(plan.steps)
        else:  # the rest of the decay refitted from here, the optimisers' rates with it from the next step
            self.schedule.replan(self.step, plan.steps)
            for scheduler in self.schedulers:
                set_step(scheduler, self.step)
        self.settings = self.settings.planned(plan.steps, self.tc.max_minutes)
        self.tc = self.settings.train
        if self.is_master:
            self.say(plan.line)
            self.summaries.plan(self.step, plan.steps)
        if plan.first:
            self.start_session()

    def start_session(self) -> None:
        """The run's HParams session, once its length is known (rank 0)."""
        if self.is_master:
            self.summaries.start_session(self.settings.config, self.device.type, self.precision)

    def end_session(self, status: int) -> None:
        """status: TensorBoard's STATUS_SUCCESS or STATUS_FAILURE (rank 0). A budget run that ends before its length
        is fixed (train.patience, a divergence) starts its session first: the dashboard shows every run that ended."""
        if self.tc.max_iters is None:
            self.start_session()
        if self.is_master:
            self.summaries.end_session(status)

    def say(self, line: str) -> None:
        write_line(line)

    def timed_step(self) -> None:
        """train_step(), at the thread count that is fastest now (ThreadChoice). Once a budget has fixed the run's
        length, a step at a count not used before says that train.max_iters no longer repeats the run."""
        if self.threads is None:
            return self.train_step()
        threads, changed = self.threads.take(self.train_step)
        counts = len(self.threads_used)
        self.threads_used.add(threads)
        if changed and self.is_master:
            self.say(changed)
            self.summaries.threads(self.step, self.threads.threads)
        promised = self.tc.max_minutes and self.tc.max_iters and len(self.schedule.plan) == 1
        if counts == 1 < len(self.threads_used) and promised and self.is_master:
            self.say(f"threads: {repeated_by(self.tc.max_iters, self.threads_used, self.chosen)}")

    def train_step(self) -> None:
        """One optimiser step over grad_accum_steps micro-batches; its values stay on the device until logged."""
        tc = self.tc
        lrs = tuple(scheduler.get_last_lr()[0] for scheduler in self.schedulers)  # AdamW's, then Muon's
        loss_sum = torch.zeros((), device=self.device)
        for micro_step in range(tc.grad_accum_steps):
            x, y = self.batches.next()
            # DDP all-reduces gradients during backward(): only the last micro-step's need it
            sync = self.world_size == 1 or micro_step == tc.grad_accum_steps - 1
            with nullcontext() if sync else self.model.no_sync():
                with self.autocast:
                    _, loss = self.model(x, y)
                (loss / tc.grad_accum_steps).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), self.settings.optim.grad_clip)
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update_parameters(self.raw_model)
        self.pending.append((loss_sum / tc.grad_accum_steps, grad_norm, lrs, time.time()))
        self.step += 1

    def log_pending(self, bar=None) -> None:
        """Read the pending steps' values back (the host-device sync), check and log them."""
        if not self.pending:
            return
        losses = torch.stack([p[0] for p in self.pending]).tolist()
        norms = torch.stack([p[1] for p in self.pending]).tolist()
        lrs = [p[2] for p in self.pending]
        walltimes = [p[3] for p in self.pending]
        first = self.step - len(self.pending)
        for i, (loss, norm) in enumerate(zip(losses, norms)):
            if not (math.isfinite(loss) and math.isfinite(norm)):
                raise self.diverged(f"non-finite training loss {loss} (gradient norm {norm}) at step {first + i}")
        tokens_per_sec = self.tokens_per_step * len(losses) / (time.perf_counter() - self.timer)
        if self.is_master:
            self.summaries.train_steps(first, losses, norms, lrs, walltimes, tokens_per_sec)
            if bar is not None:
                bar.set_postfix(loss=f"{sum(losses) / len(losses):.4f}", lr=f"{lrs[-1][0]:.2e}",
                                tok_s=f"{tokens_per_sec:,.0f}", refresh=False)
        self.pending, self.timer = [], time.perf_counter()

    def evaluate_and_save(self) -> None:
        """Evaluate; save best.pt where val improved, and last.pt; end the run where train.patience runs out (last.pt
        then holds best.pt's weights)."""
        tc, started = self.tc, timing.clock()
        speed = self.training_speed(started)
        losses = evaluate(*self.evaluation(tc.eval_iters))
        if not all(math.isfinite(v) for v in losses.values()):
            raise self.diverged(f"non-finite evaluation loss {losses} at step {self.step}")
        self.last_val_loss = losses["val"]
        trained = self.step > self.start_step  # the weights as they started are saved already, or not worth it
        improved = self.last_val_loss < self.best_val_loss and trained
        if improved:  # best_val_loss is always the val loss of the model best.pt holds
            self.best_val_loss, self.best_step = self.last_val_loss, self.step
        if trained:
            self.since_best = 0 if improved else self.since_best + 1
            if tc.patience is not None and self.since_best >= tc.patience and self.step != tc.max_iters:
                self.ended_by = (f"train.patience={tc.patience}: val loss has not improved for {self.since_best} "
                                 f"evaluations, since step {self.best_step}")
            best = self.run_dir / "best.pt" if self.is_master else None
            if self.ended_by and gather(best is not None and best.exists(), self.world_size)[0]:
                self.ended_by += "; last.pt holds best.pt's weights"  # the run ends on its best weights
                if self.is_master:
                    save_checkpoint(load_checkpoint(best), self.run_dir / "last.pt")
            else:  # best.pt first: last.pt never records a best that no checkpoint holds
                self.save(*(["best.pt"] if improved else []), "last.pt")
            if self.step == tc.max_iters or self.ended_by:  # done and saved: a signal can no longer make it fail
                self.signals.finished()
        if self.is_master:
            self.summaries.evaluation(self.step, losses, self.best_val_loss)
            self.summaries.sample_and_attention(self.eval_model, self.vocab, self.prompt, tc.sample_tokens,
                                                tc.seed, self.step)
            write_line(f"step {self.step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
                       f"{' (best)' if improved else ''}, lr {self.schedulers[0].get_last_lr()[0]:.2e}{speed}")
        self.timer = time.perf_counter()  # tokens/s counts training only
        self.budget.evaluated(self.step, started)
        self.trained_since = (self.step, timing.clock())

    def evaluation(self, batches: int) -> tuple:
        """evaluate()'s arguments for `batches` batches of each split: the model evaluated, on this process's seed."""
        return (self.evaluated, self.data, self.raw_model.config.block_size, self.tc.batch_size, batches,
                self.tc.seed + self.rank, self.device, self.autocast, self.world_size)

    def training_speed(self, now: float) -> str:
        """The evaluation line's ", N tokens/s": the training tokens a second since the previous evaluation line (or
        the first step), evaluations left out; "" where no step has trained since. Piped output has no progress bar,
        so this line carries the speed."""
        if self.trained_since is None or self.step == self.trained_since[0] or now <= self.trained_since[1]:
            return ""
        step, since = self.trained_since
        return f", {self.tokens_per_step * (self.step - step) / (now - since):,.0f} tokens/s"

    def save(self, *names: str) -> None:
        """Write the checkpoint to each of names in the run directory (rank 0; every process takes part)."""
        training = {"optimizers": [o.state_dict() for o in self.optimizers],
                    "schedulers": [s.state_dict() for s in self.schedulers],
                    "step": self.step, "best_val_loss": self.best_val_loss, "plan": self.schedule.record(),
                    "best_step": self.best_step, "since_best": self.since_best,  # (train.patience)
                    # every process's generators, so that a resumed DDP run draws what this one would
                    "rng": gather(rng_state(self.batches, self.device), self.world_size),
                    "config": self.settings.config, "run_id": self.run_id,
                    "seconds": self.budget.spent(),  # the run's wall-clock time so far
                    **self.budget.record(),  # what a step and an evaluation cost, for the life that resumes it
                    "threads": sorted(self.threads_used)}
        if self.ema is not None:
            training["raw_model"] = self.raw_model.state_dict()
        if self.is_master:
            contents = build_checkpoint(self.eval_model, self.vocab, training, text=self.data)
            for name in names:
                save_checkpoint(contents, self.run_dir / name)

    def stop(self, signal_name: str):
        self.log_pending()
        self.save("last.pt")  # its HParams status stays unknown: it can go on
        raise Stopped(f"stopped by {signal_name} at step {self.step}: saved {self.run_dir / 'last.pt'}; "
                      f"continue with the same command plus train.resume={self.run_dir}")

    def diverged(self, what: str) -> Diverged:
        last = self.run_dir / "last.pt"
        kept = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was saved"
        self.end_session(STATUS_FAILURE)
        return Diverged(f"{what}; stopped, {kept}")

