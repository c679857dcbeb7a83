"""The benchmarks' pictures: a --plot that could not be written, or a run whose points could not all be measured,
is refused in one line, status 2, before any run; what a picture shows is read from the run itself (the plans from
its events, cache bytes from the cache); and, where matplotlib is installed, each picture is drawn into a PNG. No
test here needs matplotlib to run."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.curve import read_curve, read_plans
from bench.kv_designs import TRAINED, bytes_per_token, train_run
from bench.per_token import step_seconds
from bench.train_quality import picture_run
from model import kv_cache_bytes_per_token
from model.caches.lowbit import lowbit_cache_bytes
from programs import ENV, REPO, assert_one_line_error
from tiny_models import random_model
from training.summaries import Summaries

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow

NO_MATPLOTLIB = "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n"


def bench(script: str, *args: str, cwd: Path, env=ENV) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script, args, fragments", [
    ("per_token.py", ["--plot", "picture.jpg"], ["--plot", "picture.jpg is not a .png file name"]),
    ("per_token.py", ["--plot", "missing/picture.png"], ["--plot", "no folder missing to write picture.png in"]),
    ("per_token.py", ["--plot", "folder.png"], ["--plot", "folder.png is a folder"]),
    ("kv_designs.py", ["train", "--plot", "picture.svg"], ["--plot", "not a .png file name"]),
    ("train_quality.py", ["--plot", "missing/picture.png"], ["--plot", "no folder missing"]),
    ("train_quality.py", ["--load-from", "none", "60", "60"], ["--load-from names one value twice"]),
    ("train_quality.py", ["--load-from", "soon"], ["--load-from", "must be none or a number of seconds", "'soon'"]),
    ("kv_designs.py", ["train", "--designs", "int4", "--train-overrides", "model.window_pattern=LG",
                       "model.local_window=8"], ["--designs int4", "low-bit KV cache serves layers that attend"]),
    ("kv_designs.py", ["train", "--designs", "mha", "int2", "--train-overrides", "model.block_size=100"],
     ["--designs int2", "divides the cache's 100 slots"]),
])
def test_a_picture_that_cannot_be_drawn_is_refused_before_any_run(tmp_path, script, args, fragments):
    (tmp_path / "folder.png").mkdir()
    result = bench(script, *args, cwd=tmp_path)
    result.stderr = result.stderr.replace(f"{script} train: ", f"{script}: ")  # argparse names the subcommand too
    assert_one_line_error(result, script, *fragments)
    assert result.stdout == "" and [p.name for p in tmp_path.iterdir()] == ["folder.png"]


@pytest.mark.parametrize("script, args", [("per_token.py", []), ("kv_designs.py", ["train"]),
                                          ("train_quality.py", [])])
def test_without_matplotlib_a_picture_is_refused_with_what_to_install(tmp_path, script, args):
    hidden = tmp_path / "hidden" / "matplotlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(NO_MATPLOTLIB)
    result = bench(script, *args, "--plot", "picture.png", cwd=tmp_path,
                   env={**ENV, "PYTHONPATH": str(hidden.parent)})
    result.stderr = result.stderr.replace(f"{script} train: ", f"{script}: ")
    assert_one_line_error(result, script, "--plot", "matplotlib", "pip install -r requirements-bench.txt")
    assert result.stdout == "" and not (tmp_path / "picture.png").exists()


def test_the_plans_are_read_back_from_the_runs_events_with_their_wall_times(tmp_path):
    summaries = Summaries(tmp_path, "{}")
    summaries.evaluation(0, {"val": 4.2, "train": 4.2}, float("inf"))
    before = time.time()
    summaries.train_steps(1, [4.0], [1.0], [(1e-3,)], [before], 100.0)
    summaries.plan(40, 900)
    summaries.plan(300, 850)
    summaries.evaluation(300, {"val": 2.0, "train": 1.9}, 2.0)
    summaries.close()
    plans = read_plans(tmp_path)
    assert [(p["step"], p["steps"]) for p in plans] == [(40, 900), (300, 850)]
    assert before <= plans[0]["wall_time"] <= plans[1]["wall_time"] <= read_curve(tmp_path)[-1]["wall_time"]
    drawn = picture_run({"name": "preset", "seed": 1, "start": before - 10, "load": 60.0, "plans": plans,
                         "curve": read_curve(tmp_path)}, seeds=1)
    assert drawn["label"] == "preset, one core busy from 60 s" and drawn["val"] == pytest.approx([4.2, 2.0])
    assert [steps for _, steps in drawn["plans"]] == [900, 850] and all(s >= 10 for s, _ in drawn["plans"])


def test_the_designs_are_measured_on_the_text_their_runs_trained_on_wherever_the_bench_runs(tmp_path, monkeypatch):
    """kv_designs.py runs train.py in the repository: the val text it measures is prepared there, not in its cwd."""
    import bench.configs
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench.configs, "prepare_shakespeare", lambda folder: folder)
    assert bench.configs.shakespeare() == REPO / "datasets" / "tiny_shakespeare"


def test_a_run_of_fixed_length_has_no_plans(tmp_path):
    summaries = Summaries(tmp_path, "{}")
    summaries.evaluation(0, {"val": 4.2, "train": 4.2}, float("inf"))
    summaries.close()
    assert read_plans(tmp_path) == []


@pytest.mark.parametrize("key", TRAINED)
def test_each_design_and_cache_is_drawn_at_the_bytes_its_formula_gives(key):
    """The bytes a made cache holds, per token of a full context, against the formulas (model/caches/)."""
    _, overrides, cache = TRAINED[key]
    settings = dict(o.removeprefix("model.").split("=") for o in overrides)
    settings = {k: int(v) if v.isdigit() else v == "true" if v in ("true", "false") else v for k, v in settings.items()}
    if "local_window" in settings:
        settings.update(window_pattern="LG", local_window=4)  # the tiny model's 2 layers, one of them local
    model = random_model(n_head=4, n_embd=32, **settings)
    bits = {"int4": 4, "int2": 2}.get(cache)
    formula = (lowbit_cache_bytes(model.config, bits) / model.config.block_size if bits else
               kv_cache_bytes_per_token(model.config, torch.int8 if cache == "int8" else torch.float32))
    assert bytes_per_token(model, cache) == formula


def test_each_step_is_timed_alone_through_the_cache_or_a_whole_forward_past_block_size():
    model = random_model()
    positions = 2 * model.config.block_size + 3
    for use_cache in (True, False):
        calls = {"forward": 0, "decode_step": 0}
        for name in calls:
            def counted(*args, _name=name, _method=getattr(model, name), **kwargs):
                calls[_name] += 1
                return _method(*args, **kwargs)
            setattr(model, name, counted)
        seconds = step_seconds(model, positions, use_cache)
        assert len(seconds) == positions and min(seconds) > 0
        if use_cache:
            assert calls["forward"] == 0 and calls["decode_step"] >= positions
        else:
            assert calls == {"forward": positions, "decode_step": 0}
        del model.forward, model.decode_step


def test_each_picture_is_drawn_into_a_png(tmp_path):
    """Where matplotlib is installed: the three pictures, drawn from made-up figures, are PNG files."""
    pytest.importorskip("matplotlib")
    from bench import plots
    plots.cache_buys(tmp_path / "a.png", [1, 2, 3], [[1e-3] * 3, [2e-3] * 3], [[1e-3, 2e-3, 3e-3]] * 2, 1e-4, 2,
                     "past it", "title", "caption")
    points = [dict(label=k, bytes=b, loss=l, low=l - 0.01, high=l + 0.01, cache=c)
              for k, b, l, c in (("mha", 4096, 1.5, False), ("mqa", 1024, 1.52, False), ("int8", 1152, 1.5, True))]
    plots.designs(tmp_path / "b.png", points, 1, "title", "caption")
    runs = [dict(label="idle", seconds=[5, 100, 200], val=[4.2, 2.0, 1.5], plans=[(90, 900), (150, 850)], load=None),
            dict(label="busy", seconds=[5, 100, 200], val=[4.2, 2.1, 1.6], plans=[], load=60.0)]
    plots.training(tmp_path / "c.png", runs, "title", "caption")
    for name in ("a.png", "b.png", "c.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "b.png", "c.png"]  # no temporary left


def drawn(monkeypatch, draw, *args):
    """The figure a plots function draws, kept open and laid out instead of saved."""
    pytest.importorskip("matplotlib")
    from bench import plots
    figures = []
    monkeypatch.setattr(plots, "save", lambda fig, path: figures.append(fig))
    getattr(plots, draw)(Path("unused.png"), *args)
    figures[0].canvas.draw()
    return figures[0], figures[0].axes[0]


def test_the_designs_picture_draws_each_points_spread_over_seeds_as_a_bar(monkeypatch):
    points = [dict(label=k, bytes=b, loss=l, low=l - d, high=l + 2 * d, cache=c) for k, b, l, d, c in
              (("mha", 4096, 1.515, 0.004, False), ("mqa", 1024, 1.522, 0.006, False), ("int8", 1152, 1.515, 0.004,
                                                                                         True))]
    fig, ax = drawn(monkeypatch, "designs", points, 3, "title", "caption")
    bars = {}  # (bytes, loss) of each point: its bar's lowest and highest loss
    for container in ax.containers:
        data, _, bar_lines = container.lines  # the points, the caps, the bars (none without a spread)
        for segments in bar_lines:
            for (x, y), segment in zip(data.get_xydata(), segments.get_segments()):
                bars[x, y] = (segment[:, 1].min(), segment[:, 1].max())
    assert bars == {(p["bytes"], p["loss"]): pytest.approx((p["low"], p["high"])) for p in points}
    assert ax.get_legend().get_title().get_text() == "median of 3 seeds, bar: min-max"
    low, high = ax.get_ylim()
    assert all(low < p["low"] and p["high"] < high for p in points)


def five_minutes() -> list[dict]:
    """Runs shaped like docs/images/five_minutes.png's: an untrained loss far above the rest, plans close together."""
    seconds = [25, 31, 55, 82, 107, 132, 157, 182, 207, 232, 257, 290]
    val = [4.17, 1.96, 1.79, 1.72, 1.66, 1.66, 1.63, 1.61, 1.57, 1.55, 1.52, 1.48]
    return [dict(label="cpu preset, idle", seconds=[s + 3 for s in seconds], val=[v + 0.01 for v in val],
                 plans=[(147, 1940)], load=None),
            dict(label="cpu preset, one core busy from 60 s", seconds=seconds, val=val, plans=[(138, 1796)], load=60),
            dict(label="cpu preset, one core busy from 170 s", seconds=[s + 2 for s in seconds],
                 val=[v - 0.005 for v in val], plans=[(147, 2237), (172, 2171), (175, 1857), (188, 2000)], load=170)]


def test_the_training_picture_holds_every_curve_and_keeps_its_words_apart(monkeypatch):
    runs = five_minutes()
    fig, ax = drawn(monkeypatch, "training", runs, "title", "caption")
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    lines = [line for line in ax.get_lines() if len(line.get_xdata()) and line.get_linestyle() != ":"]
    points = [(x, y) for line in lines for x, y in line.get_xydata()]
    assert len(points) == sum(len(r["val"]) - 1 + len(r["plans"]) for r in runs)  # all but each untrained loss
    assert all(x0 <= x <= x1 and y0 <= y <= y1 for x, y in points)
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    words = [t.get_window_extent(renderer) for t in ax.texts if t.get_visible() and t.get_text()]
    assert not any(a.overlaps(b) for i, a in enumerate(words) for b in words[i + 1:])
    assert not any(legend.overlaps(w) for w in words)
    assert not any(legend.contains(*ax.transData.transform(p)) for p in points)
    assert ax.get_legend().get_title().get_text() == "not drawn: step 0, val 4.17-4.18"


def test_a_designs_run_is_reused_once_trained_to_its_end_and_one_stopped_part_way_goes_on(tmp_path, monkeypatch):
    """A run stopped part-way already has a best.pt: measuring it as trained would compare designs at unequal steps."""
    import bench.kv_designs
    commands = []
    monkeypatch.setattr(bench.kv_designs.subprocess, "run",
                        lambda command, **_: commands.append(command) or subprocess.CompletedProcess(command, 0))
    for name, step in (("preset-seed1", 1000), ("preset-seed2", 95)):  # trained to its end; stopped at step 95
        (tmp_path / name).mkdir()
        (tmp_path / name / "best.pt").write_bytes(b"")
        torch.save({"training": {"step": step, "since_best": 0, "config": {"train": {"max_iters": 1000}}}},
                   tmp_path / name / "last.pt")
    ran = {seed: train_run([], seed, tmp_path, ["train.max_iters=1000"]) for seed in (1, 2, 3)}
    assert ran[1] == (tmp_path / "preset-seed1", None) and ran[2] == (tmp_path / "preset-seed2", None)
    assert ran[3][0] == tmp_path / "preset-seed3" and ran[3][1] >= 0  # trained here, whole: its seconds
    resumed, fresh = commands
    assert resumed[-1] == f"train.resume={tmp_path / 'preset-seed2'}" and "train.seed=2" in resumed
    assert "train.seed=3" in fresh and not any(a.startswith("train.resume=") for a in fresh)
