"""training/sizing.py: the cpu preset sizes its model and threads to the machine by timing steps here."""

import math
import os
import re
import subprocess
import sys

import pytest
import torch

import train
import training.budget
import training.config
import runtime.devices
import training.loop
import training.sizing as sizing
import training.threads
from test_train import AIM_AT_HALF, HOLD, REPO, TINY, config, data_overrides, data_root, scalars  # noqa: F401
from training.sizing import Shape

BUDGET = ["train.max_iters=null", "train.max_minutes=0.2", *HOLD]  # after TINY; 12 s: room for a busy start
# Two tiny shapes: the deeper one learns more per step, the shallower one is cheaper
SHALLOW = Shape(1, 4, ((100, 2.0), (400, 1.8)))
DEEP = Shape(2, 8, ((100, 1.9), (400, 1.6)))


def test_a_record_predicts_by_interpolating_in_the_inverse_square_root_of_the_steps():
    shape = Shape(2, 8, ((400, 2.0), (1600, 1.5), (6400, 1.3)))
    assert shape.predicted_loss(400) == pytest.approx(2.0)
    # 900 steps: 1/30 lies two thirds of the way from 1/20 to 1/40
    assert shape.predicted_loss(900) == pytest.approx(2.0 - 0.5 * (1 / 20 - 1 / 30) / (1 / 20 - 1 / 40))
    assert shape.predicted_loss(3600) == pytest.approx(1.5 - 0.2 * (1 / 40 - 1 / 60) / (1 / 40 - 1 / 80))
    # below the fewest steps along the first segment (100 steps: 1/10); past the most, the last loss held
    assert shape.predicted_loss(100) == pytest.approx(2.0 + 0.5 * (1 / 10 - 1 / 20) / (1 / 20 - 1 / 40))
    assert shape.predicted_loss(6400) == shape.predicted_loss(25_600) == 1.3


def test_every_recorded_shape_predicts_less_loss_from_more_steps():
    for shape in sizing.SHAPES:
        steps = [n for n, _ in shape.record]
        assert steps == sorted(steps) and len(steps) >= 2, shape
        losses = [shape.predicted_loss(n) for n in (100, 500, 1000, 2000, 4000)]
        assert losses == sorted(losses, reverse=True), shape


@pytest.fixture
def timed(monkeypatch):
    """Each training step that sizing times runs for real (with one thread, whatever count it is timed at: two
    threads' steps stall on a busy machine), and takes on the clock that time_in_turns reads the seconds that
    `table` gives its depth at that count: the choice is then the test's, the steps as real as the run's."""
    table, now = {}, [0.0]
    real = sizing.trainer_step

    def trainer_step(settings, data, device):
        step = real(settings, data, device)

        def timed_step():
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            step()
            torch.set_num_threads(threads)
            now[0] += table[settings.model.n_layer, threads]

        return timed_step

    monkeypatch.setattr(sizing, "trainer_step", trainer_step)
    monkeypatch.setattr(runtime.devices, "clock", lambda: now[0])
    monkeypatch.setattr(sizing, "SHAPES", (SHALLOW, DEEP))
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(sizing, "DEFAULT_THREADS", 2)
    monkeypatch.setattr(runtime.devices, "DEFAULT_THREADS", 2)
    yield table
    torch.set_num_threads(1)  # the suite's count


def test_the_thread_count_whose_step_is_fastest_now_is_chosen(tmp_path, data_root, timed):
    settings = training.config.validate(config(tmp_path, data_root))
    data = train.prepare_data(settings)
    for seconds, fastest in ((0.005, 2), (0.02, 1)):  # idle, two threads are faster; busy, one is
        timed.update({(2, 1): 0.01, (2, 2): seconds})
        threads, why = sizing.choose_threads(settings, data, torch.device("cpu"))
        assert (threads, torch.get_num_threads()) == (fastest, fastest)
        assert why == f"the fastest when timed: 1 thread took 0.01 s a step, 2 threads took {seconds:.3g} s a step"
    assert sizing.choose_threads(settings.replaced({"train.threads": 2}), data, torch.device("cpu")) == \
        (2, "as train.threads names")


# The runs below train with the one thread timed faster, and the suite's machine may be busy
@pytest.mark.parametrize("seconds, shape", [
    ({(1, 1): 0.01, (1, 2): 0.02, (2, 1): 0.02}, DEEP),  # fast: the deeper shape gets enough steps
    ({(1, 1): 0.04, (1, 2): 0.08, (2, 1): 0.4}, SHALLOW),  # slow: too few steps for the deeper one
])
def test_a_budget_run_trains_the_shape_and_threads_that_are_predicted_to_learn_most_here(
        tmp_path, data_root, timed, monkeypatch, seconds, shape):
    timed.update(seconds)
    threads = 1
    printed = []
    monkeypatch.setattr(train, "write_line", printed.append)
    monkeypatch.setattr(training.budget, "MARGIN", AIM_AT_HALF)
    # a busy machine would have the run time other thread counts, whose sums round otherwise, or plan it again,
    # which no command repeats (tests/test_edges_clock.py): here the run keeps its first plan, to be repeated
    monkeypatch.setattr(training.threads, "SLOWER", math.inf)
    monkeypatch.setattr(training.budget.Budget, "replanned", lambda self, *args: (None, ""))
    monkeypatch.setattr(training.budget.Budget, "late", lambda self, *args: None)
    run_dir = tmp_path / "runs/sized"
    train.main(config(tmp_path, data_root, *BUDGET), run_dir, named=set())
    assert f"({shape} with {threads} thread{'s' * (threads > 1)}, sized to this machine)" in printed[0]
    assert printed[1].startswith(f"sized: {shape} should learn the most here, a best val loss of ")
    assert printed[1].endswith(f"threads: {threads}, the fastest when timed: 1 thread took {seconds[1, 1]:.3g} s a "
                               f"step, 2 threads took {seconds[1, 2]:.3g} s a step")
    recorded = torch.load(run_dir / "last.pt", weights_only=True)
    assert recorded["model_config"]["n_layer"] == shape.n_layer
    train_config = recorded["training"]["config"]["train"]
    assert (train_config["batch_size"], train_config["threads"]) == (shape.batch_size, threads)

    # the recorded values repeat the run exactly: the timed steps drew nothing from the run's generators
    steps = train_config["max_iters"]
    again = tmp_path / "runs/again"
    train.main(config(tmp_path, data_root, *HOLD, f"train.max_iters={steps}",
                      f"model.n_layer={shape.n_layer}", f"train.batch_size={shape.batch_size}",
                      f"train.threads={threads}"), again)
    assert scalars(again, "loss/train") == scalars(run_dir, "loss/train")
    repeated = torch.load(again / "last.pt", weights_only=True)
    assert all(torch.equal(repeated["model"][name], weight) for name, weight in recorded["model"].items())


@pytest.mark.parametrize("named, world_size, overrides, why", [
    ({"model.n_layer"}, 1, [], "model.n_layer named"),
    ({"train.batch_size", "model.n_embd"}, 1, [], "model.n_embd, train.batch_size named"),
    ({"train.max_iters"}, 1, ["train.max_iters=40"], "train.max_iters names the steps"),
    (set(), 2, [], "2 processes"),
    (set(), 1, ["train.size_to_host=false"], "not asked"),
])
def test_the_choice_is_off_where_the_command_makes_it(tmp_path, data_root, named, world_size, overrides, why):
    settings = training.config.validate(config(tmp_path, data_root, *BUDGET, *overrides))
    assert sizing.sizing(settings, named, world_size) == why
    assert sizing.sizing(settings, set(), 1) is None or overrides


def test_a_sized_run_resumes_with_the_shape_it_chose(tmp_path, data_root, timed, monkeypatch):
    timed.update({(1, 1): 0.01, (1, 2): 0.02, (2, 1): 0.02, (2, 2): 0.04})  # the resumed run times its threads
    monkeypatch.setattr(training.budget, "MARGIN", AIM_AT_HALF)
    # a busy machine would have the run time other thread counts, whose sums round otherwise, or plan it again,
    # which no command repeats (tests/test_edges_clock.py): here the run keeps its first plan, to be repeated
    monkeypatch.setattr(training.threads, "SLOWER", math.inf)
    monkeypatch.setattr(training.budget.Budget, "replanned", lambda self, *args: (None, ""))
    monkeypatch.setattr(training.budget.Budget, "late", lambda self, *args: None)
    run_dir = tmp_path / "runs/sized"
    train.main(config(tmp_path, data_root, *BUDGET), run_dir, named=set())
    first = torch.load(run_dir / "last.pt", weights_only=True)
    steps = first["training"]["config"]["train"]["max_iters"]
    chosen = first["model_config"]["n_layer"], first["training"]["config"]["train"]["batch_size"]
    # the time left decides the choice, and a busy machine leaves less: whichever it chose, resume with the other
    other = next(s for s in (SHALLOW, DEEP) if (s.n_layer, s.batch_size) != chosen)
    # composed with the other shape, which the command line does not name, the run resumes with the one it chose
    train.main(config(tmp_path, data_root, *HOLD, f"model.n_layer={other.n_layer}",
                      f"train.batch_size={other.batch_size}", f"train.resume={run_dir}",
                      f"train.max_iters={steps + 5}"),
               run_dir, named={"train.resume", "train.max_iters"})
    resumed = torch.load(run_dir / "last.pt", weights_only=True)
    assert resumed["training"]["step"] == steps + 5
    assert (resumed["model_config"]["n_layer"], resumed["training"]["config"]["train"]["batch_size"]) == chosen


def environment_without_threads() -> dict:
    return {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}


def test_train_py_times_its_threads_and_records_them(tmp_path, data_root):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, *data_overrides(data_root),
                             "train.max_iters=10", f"hydra.run.dir={run_dir}"], env=environment_without_threads(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    second = result.stdout.splitlines()[1]
    if os.cpu_count() == 1:
        assert second == "threads: 1, torch's default"
        return
    timed = re.fullmatch(r"threads: (\d+), the fastest when timed: 1 thread took ([\d.e-]+) s a step, 2 threads "
                         r"took ([\d.e-]+) s a step.*", second)
    assert timed, second
    threads, one, two = int(timed[1]), float(timed[2]), float(timed[3])
    assert threads == (1 if one <= two else 2)
    assert torch.load(run_dir / "last.pt", weights_only=True)["training"]["config"]["train"]["threads"] == threads


@pytest.mark.parametrize("override, message", [
    ("train.threads=0", "train.threads must be a positive integer, or null for the fastest now, got 0"),
    ("train.threads=two", "train.threads"),
])
def test_a_thread_count_that_is_no_count_is_one_line(tmp_path, override, message):
    result = subprocess.run([sys.executable, str(REPO / "train.py"), override, f"hydra.run.dir={tmp_path / 'r'}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1 and message in result.stderr
    assert not (tmp_path / "r").exists()


MAPPED_BYTES = """
import ctypes, sys, torch
from runtime.devices import keep_freed_memory

class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2: ten size_t counters
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory()
activations = torch.empty(4 << 20)  # 16 MiB, as a training step's largest
print(libc.mallinfo2().hblkhd)  # bytes held in memory mapped for single blocks, which free() unmaps
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, on Linux")
def test_kept_memory_holds_a_steps_tensors_in_the_heap_rather_than_in_their_own_mappings():
    """glibc's own accounting (mallinfo2): by default a 16 MiB tensor gets a mapping of its own, whose pages
    free() hands back and the next step faults in again; once freed memory is kept, it comes from the heap."""
    mapped = {}
    for mode in ("default", "keep"):
        result = subprocess.run([sys.executable, "-c", MAPPED_BYTES, mode], cwd=REPO, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        mapped[mode] = int(result.stdout)
    assert mapped["default"] >= 16 << 20 > mapped["keep"], mapped
