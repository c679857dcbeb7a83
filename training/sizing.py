"""Sizing a budget run to the machine: the threads and the model shape that learn the most here.

A budget (train.max_minutes) buys a number of steps, and that number depends on the machine. A deeper model
learns more per step but takes fewer steps. SHAPES records, for each shape the cpu preset may train, the best
val loss that a run of so many steps reached (docs/training.md, "How the run sizes itself"). At start-up the
run times a few steps of each shape here, counts the steps its budget then buys, and trains the shape whose
record predicts the lowest val loss at that count.

Threads are timed the same way. On an idle 2-core machine two threads beat one; when another process keeps a
core busy, each small operation waits for the thread whose core is taken, and one thread is several times
faster. So the run times its step with each thread count and keeps the fastest.
"""

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from data import PreparedData
from model import build_model
from runtime.devices import DEFAULT_THREADS, environment_threads, fastest_threads, thread_counts, time_in_turns
from runtime.errors import ConfigError

from .budget import planned_seconds, steps_within
from .config import Settings
from .loop import Trainer
from .threads import timings


@dataclass(frozen=True)
class Shape:
    """A model depth and batch, and the best val loss that runs of so many steps reached with them."""

    n_layer: int
    batch_size: int
    record: tuple[tuple[int, float], ...]  # (steps, best val loss), by steps

    def predicted_loss(self, steps: int) -> float:
        """The val loss `steps` steps should reach: the record interpolated linearly in 1/sqrt(steps), extended
        below its fewest steps along its first segment, and held at its last loss past its most steps (what
        was never measured is not promised)."""
        x = [n ** -0.5 for n, _ in self.record]  # falls as steps grow
        y = [loss for _, loss in self.record]
        target = max(steps, 1) ** -0.5
        if target <= x[-1]:
            return y[-1]
        i = next(i for i in range(1, len(x)) if target >= x[i])
        return y[i - 1] + (y[i] - y[i - 1]) * (target - x[i - 1]) / (x[i] - x[i - 1])

    def __str__(self) -> str:
        return f"{self.n_layer} layers at batch {self.batch_size}"


# The cpu preset's shapes (conf/model/small.yaml's 128-wide model at these depths and batches), each with the
# best val loss that runs of so many steps reached: docs/training.md lists the runs, and how to add one.
SHAPES = (
    Shape(2, 32, ((700, 1.6135), (1200, 1.5561), (2000, 1.5141))),
    Shape(3, 32, ((500, 1.6499), (696, 1.5781), (1150, 1.5164), (2001, 1.4871))),
    Shape(4, 32, ((600, 1.5926), (872, 1.5366), (981, 1.5214), (1650, 1.4768), (3234, 1.4649))),
    Shape(6, 24, ((600, 1.6132), (1000, 1.5319), (1549, 1.4834), (2843, 1.4553))),
)
SIZED = ("model.n_layer", "train.batch_size")  # what sizing chooses; naming either chooses it instead
TIMED_STEPS = 3  # steps timed of each shape, and at each thread count, after an untimed one; the median counts


def sizing(settings: Settings, named: set[str] | None, world_size: int) -> str | None:
    """Why the run is not sized to the machine, or None if it is: the preset asks for it (train.size_to_host),
    the run has a budget, a single process, and no model field or batch named on the command line."""
    tc = settings.train
    if not tc.size_to_host:
        return "not asked"
    if tc.resume is not None:
        return "a resumed run keeps its shape"
    if tc.max_iters is not None:
        return "train.max_iters names the steps"
    if world_size > 1:
        return f"{world_size} processes"
    if named is None:
        return "every setting as given"
    fixed = sorted(key for key in named if key in SIZED or key.startswith("model"))
    return f"{', '.join(fixed)} named" if fixed else None


def trainer_step(settings: Settings, data: PreparedData, device: torch.device) -> Callable[[], None]:
    """One training step of a throwaway model with these settings, as a function to time."""
    model = build_model(dataclasses.replace(settings.model, vocab_size=len(data.vocab))).to(device)
    trainer = Trainer(settings, model, data, device, run_dir=None, summaries=None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return lambda: (trainer.train_step(), sync())


def steps_affordable(settings: Settings, step_s: float, spent_s: float) -> int:
    """About how many steps the budget buys at step_s a step, once spent_s are gone, as the run's plan counts
    them (steps_within), with an evaluation at step 0 too: each evaluation's batch counted as a third of a step
    (a forward pass)."""
    tc = settings.train
    evaluation_s = 2 * tc.eval_iters * step_s / 3
    return steps_within(planned_seconds(tc.max_minutes * 60) - spent_s - evaluation_s, step_s, evaluation_s,
                        tc.eval_interval)


def threads_fixed(settings: Settings, device: torch.device) -> str | None:
    """Why the thread count is not timed, or None if it is (before sizing sets train.threads)."""
    tc = settings.train
    return ("as train.threads names" if tc.threads else "as OMP_NUM_THREADS names" if environment_threads() else
            "a compiled step is not timed" if tc.compile and device.type == "cpu" else
            "torch's default" if device.type != "cpu" or tc.compile or len(thread_counts()) == 1 else None)


def choose_threads(settings: Settings, data: PreparedData, device: torch.device) -> tuple[int, str]:
    """Set torch's thread count to train.threads, or to the count whose step of these settings is fastest now;
    return the count and why it was chosen."""
    why = threads_fixed(settings, device)
    if why is not None:
        threads = settings.train.threads or environment_threads() or DEFAULT_THREADS
        torch.set_num_threads(threads)
        return threads, why
    threads, seconds = fastest_threads(trainer_step(settings, data, device), TIMED_STEPS)
    return threads, f"the fastest when timed: {timings(seconds)}"


def kept_on_resume(settings: Settings, named: set[str] | None) -> tuple[str, ...]:
    """What a run takes from sizing rather than from the command: the shape sizing chose. A resumed run takes it
    from its checkpoint, not from the preset; a command that repeats a budget run names it."""
    return tuple(key for key in SIZED if named is not None and key not in named) if settings.train.size_to_host \
        else ()


def size_to_host(settings: Settings, named: set[str] | None, data: PreparedData, device: torch.device,
                 world_size: int, started_at: float) -> tuple[Settings, str, str]:
    """The settings with train.threads, and where the run is sized, model.n_layer and train.batch_size, chosen
    for this machine now (see the module's docstring); with what was chosen, in a few words, and why."""
    not_sized = sizing(settings, named, world_size)
    if not_sized is not None and settings.train.size_to_host and named is not None and \
            "train.size_to_host" in named and settings.train.resume is None:  # a resume repeats its command
        raise ConfigError(f"train.size_to_host=true cannot apply ({not_sized}): it sizes a new single-process run "
                          f"to its budget, train.max_minutes, with no model setting or train.batch_size named; "
                          f"drop it, or what stops it")
    shapes = {shape: settings.replaced({"model.n_layer": shape.n_layer, "train.batch_size": shape.batch_size})
              for shape in (SHAPES if not_sized is None else ())}
    # the threads are timed on the smallest shape, the cheapest to time, when the run is sized; every shape
    # is then timed afresh, once the process's memory has grown to what a step needs
    threads, why_threads = choose_threads(next(iter(shapes.values()), settings), data, device)
    settings = settings.replaced({"train.threads": threads})
    chosen = f"{threads} thread{'s' if threads > 1 else ''}"
    if not_sized is not None:
        why_shape = f"; the model as configured, not sized to this machine ({not_sized})" \
            if settings.train.size_to_host else ""
        return settings, chosen, f"threads: {threads}, {why_threads}{why_shape}"
    shapes = {shape: candidate.replaced({"train.threads": threads}) for shape, candidate in shapes.items()}
    seconds = time_in_turns({shape: (trainer_step(candidate, data, device), threads)
                             for shape, candidate in shapes.items()}, TIMED_STEPS)
    predictions = []
    for shape, candidate in shapes.items():
        steps = steps_affordable(candidate, seconds[shape], time.perf_counter() - started_at)
        predictions.append((shape.predicted_loss(steps), shape, seconds[shape], steps, candidate))
    loss, shape, _, steps, settings = min(predictions, key=lambda p: p[0])
    timed = "; ".join(f"{s.n_layer} layers: {step_s:.3g} s a step, {n} steps, {p:.3f} predicted"
                      for p, s, step_s, n, _ in predictions)
    return settings, f"{shape} with {chosen}, sized to this machine", (
        f"sized: {shape} should learn the most here, a best val loss of {loss:.3f} predicted for the {steps} steps "
        f"that fit ({timed}); threads: {threads}, {why_threads}")
