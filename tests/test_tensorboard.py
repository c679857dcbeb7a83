"""What a person sees in TensorBoard, read from TensorBoard's own server over its HTTP data API: three tiny
trainings in one log directory: a single run, a sweep of two jobs (one of them with AdamW alone), and a run
crashed and resumed in its directory. The server reads the events with its Rust data server, as `tensorboard
--logdir runs` does where that is installed, and for a resumed run also with its Python loader, as it does
elsewhere."""

import html
import io
import json
import math
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.summary.writer import event_file_writer

import train
from data import CharVocab
from model import GPT
from model.measuring.attention_weights import attention_weights
from test_train import config
from runtime.checkpoint import load_model
import training.summaries
from tiny_models import random_model
from training.attention_maps import LabelledHeads, heads_in_a_grid
from training.summaries import Summaries

RESUMED = "2026-01-01_00-02-00"  # crashed in step 7, after its checkpoint at step 5, resumed from it and extended
RUNS = {"2026-01-01_00-00-00": ["optim.lr=1e-2", "train.precision=bf16"],
        "multirun/2026-01-01_00-01-00/0": ["optim.lr=5e-3"],
        # AdamW; the other runs have the cpu preset's Muon
        "multirun/2026-01-01_00-01-00/1": ["optim=adamw", "optim.lr=2e-3", "train.precision=fp32"],
        RESUMED: ["optim.lr=3e-3"]}
PROMPT = "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n"  # train.sample_prompt's default
BLOCK_SIZE = 16  # tests/test_train.py's tiny model
STEPS = 10  # evaluated at 0, 5 and 10
ADAMW_RUN = "multirun/2026-01-01_00-01-00/1"
SCALARS = {"loss/train", "loss/train_eval", "loss/val", "loss/val_best", "optim/grad_norm", "optim/lr",
           "perf/tokens_per_sec"}
MUON_LR = "optim/lr_muon"  # in every run but ADAMW_RUN
ATTENTION = {f"sample/attention/layer{layer}" for layer in range(2)}  # each layer's two heads in one image
HPARAMS = ["optim.name", "optim.lr", "optim.muon_lr", "train.max_iters", "model.n_layer", "model.n_embd",
           "model.n_head", "model.n_kv_head", "model.kv_share", "model.window_pattern", "model.local_window", "model.learned_sink",
           "model.kv_latent", "model.kv_latent_rope", "model.block_size", "model.pos_emb", "model.dropout", "model.bias", "optim.decay",
           "optim.min_lr", "optim.weight_decay", "optim.muon_weight_decay", "train.batch_size",
           "train.grad_accum_steps", "train.threads", "train.seed", "device", "precision"]
HPARAMS_SHOWN = 5  # the HParams dashboard shows the first five columns until a reader picks others
INTEGERS = ["model.n_layer", "model.n_embd", "model.n_head", "model.n_kv_head", "model.kv_share", "model.block_size", "train.batch_size",
            "train.grad_accum_steps", "train.max_iters", "train.threads", "train.seed"]
TRIAL_ID_SHOWN = 14  # characters of the HParams table's Trial ID column (10em wide) that a browser shows


class Server:
    """`tensorboard --logdir` on a free loopback port, as a subprocess. load_fast: "auto" reads the event files with
    the Rust data server where it is installed, "false" with the Python loader."""

    def __init__(self, logdir: Path, load_fast: str = "auto"):
        self.log = tempfile.TemporaryFile("w+")  # a pipe nobody reads would stall the server once it filled
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{s.getsockname()[1]}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
             "--port", self.url.rsplit(":", 1)[1], "--reload_interval", "1", f"--load_fast={load_fast}"],
            stdout=self.log, stderr=self.log)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def get(self, path: str, **query):
        url = f"{self.url}/data/{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read()
        return body if query.get("blob_key") else json.loads(body)

    def post(self, path: str, request: dict):
        post = urllib.request.Request(f"{self.url}/data/{path}", data=json.dumps(request).encode(),
                                      headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(post, timeout=10) as response:
            return json.loads(response.read())

    def wait_until_loaded(self, runs: int, timeout: float = 60):
        """Until every run's last evaluation has been read (the server loads event files in the background)."""
        deadline, seen = time.monotonic() + timeout, "nothing"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"tensorboard exited: {self.output()}")
            try:
                tags = self.get("plugin/scalars/tags")
                seen = f"runs {sorted(tags)}"
                if len(tags) >= runs and all(
                        any(step == STEPS for _, step, _ in self.get("plugin/scalars/scalars", run=run, tag="loss/val"))
                        for run in tags if "loss/val" in tags[run]):
                    return
            except OSError as e:  # not listening yet
                seen = repr(e)
            time.sleep(0.5)
        raise AssertionError(f"tensorboard did not load {runs} runs in {timeout} s (last seen: {seen}); "
                             f"it said: {self.output()}")

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    """The runs, their attention maps drawn as grey grids whether or not matplotlib is installed."""
    tmp_path = tmp_path_factory.mktemp("tensorboard")
    logdir = tmp_path / "runs"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training.summaries, "MATPLOTLIB", False)
        for name, override in RUNS.items():
            overrides = [f"train.max_iters={STEPS}", "train.eval_interval=5", *override]
            if name == RESUMED:  # planned for fewer steps, crashed, and extended to STEPS when resumed
                crash_in_step_7(tmp_path, [*override, "train.max_iters=8", "train.eval_interval=5",
                                           "train.log_interval=1"], logdir / name)
                overrides.append(f"train.resume={logdir / name}")
            train.main(config(tmp_path, tmp_path / "data", *overrides), logdir / name)
    return logdir


def serve(logdir: Path, runs: int, load_fast: str = "auto"):
    server = Server(logdir, load_fast)
    try:
        server.wait_until_loaded(runs)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(logdir):
    yield from serve(logdir, len(RUNS))


@pytest.fixture(scope="module")
def python_loader(logdir):
    """The resumed run alone (its run shows as "."), read by TensorBoard's Python loader."""
    yield from serve(logdir / RESUMED, 1, load_fast="false")


def crash_in_step_7(tmp_path: Path, overrides: list[str], run_dir: Path):
    """Train until the forward pass of step 7 fails: steps 0-6 are logged (and the throughput after each), last.pt
    holds step 5."""
    forward, steps = GPT.forward, []

    def forward_failing_in_step_7(model, *args, **kwargs):
        steps.extend([None] if model.training else [])
        if len(steps) == 8:
            raise RuntimeError("the machine failed")
        return forward(model, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GPT, "forward", forward_failing_in_step_7)
        with pytest.raises(RuntimeError, match="the machine failed"):
            train.main(config(tmp_path, tmp_path / "data", *overrides), run_dir)


def test_a_life_started_in_the_second_the_last_one_did_sorts_after_it(tmp_path, monkeypatch):
    """TensorBoard reads a run's event files in the order of their names: the second each was opened, then a
    counter that need not sort (10 before 9), as when one process resumes a run at once, in a sweep or a test."""
    class Clock:  # stands still but for sleeping
        now = 1_800_000_000.25

        @classmethod
        def time(cls):
            return cls.now

        @classmethod
        def sleep(cls, seconds):
            cls.now += seconds

    monkeypatch.setattr(event_file_writer, "time", Clock)
    monkeypatch.setattr(training.summaries, "time", Clock)
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    lives = []
    for first_step in (0, 5, 9):
        before = set(tmp_path.iterdir())
        summaries = Summaries(tmp_path, "train: {}", first_step)
        summaries.close()
        (new,) = set(tmp_path.iterdir()) - before
        lives.append(new.name)
    assert sorted(lives) == lives


def test_one_run_per_training_run(server):
    assert sorted(server.get("runs")) == sorted(RUNS)


def test_a_resumed_run_goes_on_as_one_curve(server):
    """The points the crashed run logged past its checkpoint are dropped, and the resumed run draws them anew:
    every step once, in every chart (the best val loss, best.pt's, from the first evaluation after a step). The Rust
    data server drops a tag's points where the tag's steps go back."""
    for tag, steps in (("loss/train", list(range(STEPS))), ("loss/val", [0, 5, 10]), ("loss/val_best", [5, 10])):
        assert [step for _, step, _ in server.get("plugin/scalars/scalars", run=RESUMED, tag=tag)] == steps, tag
    walltimes = [walltime for walltime, _, _ in server.get("plugin/scalars/scalars", run=RESUMED, tag="loss/train")]
    assert walltimes == sorted(walltimes)  # steps 5 and 6 are the resumed run's, logged after the crashed run's 4
    shown = server.get("plugin/images/images", run=RESUMED, tag="sample/attention/layer0", sample=0)
    assert [image["step"] for image in shown] == [0, 5, 10]


def test_a_resumed_run_drops_what_its_crashed_life_logged_past_the_checkpoint_in_every_tag(python_loader):
    """TensorBoard's Python loader drops them at the SessionLog START that the resumed life writes (purge_step), in
    every tag: also where the resumed run logs no point before the crashed run's last, as for the throughput, which
    the crashed run logged after each step, up to step 7, and the resumed run logs every 5 steps, at 10."""
    for tag, steps in (("loss/train", list(range(STEPS))), ("loss/val", [0, 5, 10]), ("loss/val_best", [5, 10]),
                       ("perf/tokens_per_sec", [1, 2, 3, 4, 10])):
        assert [step for _, step, _ in python_loader.get("plugin/scalars/scalars", run=".", tag=tag)] == steps, tag


def test_loss_group_opens_first_and_every_loss_starts_at_step_0(server):
    tags = server.get("plugin/scalars/tags")
    images = server.get("plugin/images/tags")
    for run in RUNS:
        assert set(tags[run]) == SCALARS | ({MUON_LR} if run != ADAMW_RUN else set())  # e.g. no lone hparams metric
        # Time Series sorts the tags by name, groups them by their first part, and opens the first two groups
        groups = list(dict.fromkeys(tag.split("/")[0] for tag in sorted({*tags[run], *images[run]})))
        assert groups[:2] == ["loss", "optim"]
        for tag in ("loss/train", "loss/val", "loss/train_eval"):
            points = server.get("plugin/scalars/scalars", run=run, tag=tag)
            assert points[0][1] == 0 and points[0][2] == pytest.approx(math.log(65), abs=0.15), tag


def test_each_step_has_its_own_wall_time(server):
    points = server.get("plugin/scalars/scalars", run="2026-01-01_00-00-00", tag="loss/train")
    assert [step for _, step, _ in points] == list(range(STEPS))
    walltimes = [walltime for walltime, _, _ in points]
    # a step takes milliseconds; steps logged together (every 5) at the time of logging would lie microseconds apart
    assert min(b - a for a, b in zip(walltimes, walltimes[1:])) > 5e-4, walltimes


def test_both_learning_rates_are_plotted(server):
    """AdamW's and, under Muon, Muon's, which follows the same schedule from its own peak (optim.muon_lr 0.02)."""
    for run, overrides in RUNS.items():
        adamw = server.get("plugin/scalars/scalars", run=run, tag="optim/lr")
        assert [step for _, step, _ in adamw] == list(range(STEPS))
        if run == ADAMW_RUN:
            assert MUON_LR not in server.get("plugin/scalars/tags")[run]
            continue
        muon = server.get("plugin/scalars/scalars", run=run, tag=MUON_LR)
        lr = float(dict(override.split("=") for override in overrides)["optim.lr"])
        assert [step for _, step, _ in muon] == list(range(STEPS))
        assert [value for _, _, value in muon] == pytest.approx([value * 0.02 / lr for _, _, value in adamw])


def test_custom_scalars_tell_val_from_train_at_a_glance(server):
    """A multiline chart draws all of a run's series in the run's one colour, told apart by marker shape alone: each
    matches one series of a run. Train and val share a margin chart: val its line, train the far edge of its band,
    their steps equal (the chart shows nothing otherwise); TensorBoard does not smooth margin charts."""
    charts = [chart for category in server.get("plugin/custom_scalars/layout")["category"]
              for chart in category["chart"]]
    tags = server.get("plugin/scalars/tags")
    for chart in charts:
        for run in RUNS:
            drawn = [tag for tag in tags[run]
                     if any(re.search(pattern, tag) for pattern in chart.get("multiline", {}).get("tag", []))]
            assert len(drawn) <= 1, (chart["title"], drawn)
    (loss,) = [chart for chart in charts if "margin" in chart]
    assert loss["margin"]["series"] == [{"value": "loss/val", "lower": "loss/train_eval", "upper": "loss/val"}]
    assert loss["title"].startswith("val loss: the line; train loss: the band")
    series = loss["margin"]["series"][0]
    for run in RUNS:  # what the chart asks for
        shown = server.get("plugin/custom_scalars/scalars", run=run,
                           tag="|".join(f"({re.escape(series[edge])})" for edge in ("value", "lower", "upper")))
        steps = {edge: [step for _, step, _ in shown["tag_to_events"][series[edge]]]
                 for edge in ("value", "lower", "upper")}
        assert steps == {"value": [0, 5, 10], "lower": [0, 5, 10], "upper": [0, 5, 10]}


def hparams_table(server) -> tuple[dict, dict, list]:
    """What the HParams dashboard asks for: the columns (by name), their types, and one row per session group."""
    experiment = server.post("plugin/hparams/experiment", {"experimentName": ""})
    assert [info["displayName"] for info in experiment["hparamInfos"]] == HPARAMS  # shown in this order
    assert [(m["name"]["tag"], m["displayName"]) for m in experiment["metricInfos"]] == \
           [("loss/val_best", "val loss (best)"), ("loss/val", "val loss (last)")]
    names = {info["displayName"]: info["name"] for info in experiment["hparamInfos"]}
    types = {info["displayName"]: info["type"] for info in experiment["hparamInfos"]}
    groups = server.post("plugin/hparams/session_groups", {
        "experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                                                  "STATUS_RUNNING"],
        "colParams": [{"hparam": info["name"]} for info in experiment["hparamInfos"]] +
                     [{"metric": m["name"]} for m in experiment["metricInfos"]],
        "aggregationType": "AGGREGATION_AVG", "startIndex": 0, "sliceSize": 10})["sessionGroups"]
    assert len(groups) == len(RUNS)
    return names, types, groups


def test_hparams_columns_and_metrics(server):
    names, types, groups = hparams_table(server)
    assert "train.max_iters" in list(names)[:HPARAMS_SHOWN]  # shown at first: runs of different lengths differ
    assert types["model.bias"] == "DATA_TYPE_BOOL" and types["device"] == "DATA_TYPE_STRING"
    assert types["optim.lr"] == "DATA_TYPE_FLOAT64"
    for group in groups:
        (session,) = group["sessions"]
        hparams = group["hparams"]
        assert session["status"] == "STATUS_SUCCESS"
        assert hparams[names["model.bias"]] is False and hparams[names["device"]] == "cpu"  # typed; the device used
        val = [value for _, _, value in server.get("plugin/scalars/scalars", run=session["name"], tag="loss/val")]
        metrics = {m["name"]["tag"]: m["value"] for m in session["metricValues"]}
        assert metrics == {"loss/val_best": pytest.approx(min(val)), "loss/val": pytest.approx(val[-1])}
    assert sorted(g["hparams"][names["optim.lr"]] for g in groups) == [2e-3, 3e-3, 5e-3, 1e-2]  # one row per run
    precisions = {g["sessions"][0]["name"]: g["hparams"][names["precision"]] for g in groups}
    assert precisions["2026-01-01_00-00-00"] == "bf16" and precisions[ADAMW_RUN] == "fp32"  # as resolved


def test_hparams_integers_shown_as_integers(server):
    """The table shows a number to five digits (2 as 2.0000) and a string as it is."""
    names, types, groups = hparams_table(server)
    assert {key: types[key] for key in INTEGERS} == {key: "DATA_TYPE_STRING" for key in INTEGERS}
    for group in groups:
        hparams = group["hparams"]
        assert hparams[names["model.n_layer"]] == "2" and hparams[names["model.n_embd"]] == "32"
        # an extended run's row keeps the plan of its first life: TensorBoard keeps the first settings logged
        steps = 8 if group["sessions"][0]["name"] == RESUMED else STEPS
        assert hparams[names["train.max_iters"]] == str(steps) and hparams[names["train.seed"]] == "1337"
        assert hparams[names["train.threads"]] == "1"  # the count the run trained with (the suite's one thread)


def test_hparams_show_the_optimiser_and_only_the_learning_rates_it_uses(server):
    names, _, groups = hparams_table(server)
    shown = {group["sessions"][0]["name"]: group["hparams"] for group in groups}
    muon = {names["optim.name"]: "muon", names["optim.muon_lr"]: 0.02, names["optim.muon_weight_decay"]: 0.1}
    assert {run: {name: hparams.get(name) for name in muon} for run, hparams in shown.items()} == {
        "2026-01-01_00-00-00": muon, "multirun/2026-01-01_00-01-00/0": muon, RESUMED: muon,
        "multirun/2026-01-01_00-01-00/1": {names["optim.name"]: "adamw", names["optim.muon_lr"]: None,
                                           names["optim.muon_weight_decay"]: None}}  # blank: AdamW has no such rate
    assert shown["multirun/2026-01-01_00-01-00/1"][names["optim.lr"]] == 2e-3


def test_hparams_trial_ids_differ_in_what_the_table_shows(server):
    _, _, groups = hparams_table(server)
    assert sorted(group["sessions"][0]["name"] for group in groups) == sorted(RUNS)  # each group one run
    shown = [group["name"][:TRIAL_ID_SHOWN] for group in groups]
    assert len(set(shown)) == len(RUNS), shown


def test_config_text_is_the_config_the_run_used(server):
    (entry,) = server.get("plugin/text/text", run="2026-01-01_00-00-00", tag="config/text_summary")
    assert "vocab_size: 65" in entry["text"] and "???" not in entry["text"]  # the corpus's 65 characters


def test_attention_images_one_per_layer_with_the_characters_beside_them(server, logdir):
    """Each layer's two heads side by side, a grey bar between them, each cell a square of pixels holding its weight
    scaled to the row's maximum, as the model in last.pt (step 10) computes them; the characters at each position
    in the image's description, and in a text logged once."""
    images = server.get("plugin/images/tags")
    context = PROMPT[-BLOCK_SIZE:]
    for run in RUNS:
        assert set(images[run]) == ATTENTION
        for tag in ATTENTION:
            assert "head 0 top left" in images[run][tag]["description"]
            assert "art thou Romeo?↵" in images[run][tag]["description"]
    run = "2026-01-01_00-00-00"
    texts = server.get("plugin/text/text", run=run, tag="sample/attention/text_summary")
    assert [text["step"] for text in texts] == [0]
    assert "0         10\n0123456789012345\n" + context.replace("\n", "↵") in html.unescape(texts[-1]["text"])

    model, vocab, _ = load_model(logdir / run / "last.pt")
    with torch.no_grad():
        weights = attention_weights(model, torch.tensor([vocab.encode(context)]))
    cell, bar = 256 // BLOCK_SIZE, 256 // BLOCK_SIZE  # 16 pixels a cell; bars as wide
    for layer in range(2):
        shown = server.get("plugin/images/images", run=run, tag=f"sample/attention/layer{layer}", sample=0)
        assert [image["step"] for image in shown] == [0, 5, 10]
        png = server.get("plugin/images/individualImage", blob_key=shown[-1]["query"].split("blob_key=")[1])
        rgb = torch.tensor(np.asarray(Image.open(io.BytesIO(png))), dtype=torch.float32) / 255  # (H, W, 3)
        assert rgb.shape == (BLOCK_SIZE * cell, 2 * BLOCK_SIZE * cell + bar, 3)
        pixels = rgb[..., 0]
        assert (rgb == pixels[..., None]).all()  # grey
        left, gap, right = pixels.split([BLOCK_SIZE * cell, bar, BLOCK_SIZE * cell], dim=1)
        assert (gap == 127 / 255).all()
        for head, pixels in enumerate((left, right)):
            expected = weights[layer][0, head] / weights[layer][0, head].amax(dim=-1, keepdim=True)
            cells = pixels.unfold(0, cell, cell).unfold(1, cell, cell)  # (T, T, cell, cell)
            assert (cells == cells[..., :1, :1]).all()  # every cell one value
            torch.testing.assert_close(cells[..., 0, 0], expected, atol=1 / 255, rtol=0)  # 8 bits a pixel


def test_five_heads_fill_a_grid_of_three_columns_in_reading_order():
    weights = torch.rand(5, 4, 4)
    image = heads_in_a_grid(weights)
    cell, bar = 64, 64  # 256 pixels a head
    assert image.shape == (2 * 256 + bar, 3 * 256 + 2 * bar)
    grey = torch.ones_like(image, dtype=torch.bool)
    for head, (row, column) in enumerate([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]):
        top, left = row * (256 + bar), column * (256 + bar)
        expected = (weights[head] / weights[head].amax(dim=1, keepdim=True)).repeat_interleave(cell, 0)
        torch.testing.assert_close(image[top:top + 256, left:left + 256], expected.repeat_interleave(cell, 1))
        grey[top:top + 256, left:left + 256] = False
    assert (image[grey] == 0.5).all()  # the bars, and the sixth place, which no head fills


def logged_attention(run_dir: Path) -> dict[str, tuple[np.ndarray, str]]:
    """A tiny model's attention maps as Summaries logs them at one evaluation: each tag's RGB pixels and
    description."""
    vocab = CharVocab.from_text("abcdefghijk \n")  # tiny_models' 13 tokens
    summaries = Summaries(run_dir, "{}")
    summaries.sample_and_attention(random_model(), vocab, torch.tensor([vocab.encode("a bad cab\nhid")]), 4, 0, 0)
    summaries.close()
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    events.Reload()
    tags = [tag for tag in events.Tags()["tensors"] if tag.startswith("sample/attention/layer")]
    png = {tag: events.Tensors(tag)[0].tensor_proto.string_val[2] for tag in tags}  # width, height, the PNG
    return {tag: (np.asarray(Image.open(io.BytesIO(png[tag])).convert("RGB")),
                  events.SummaryMetadata(tag).summary_description) for tag in tags}


def test_without_matplotlib_each_map_is_a_grey_grid_whose_description_names_the_axes(tmp_path, monkeypatch):
    monkeypatch.setattr(training.summaries, "MATPLOTLIB", False)
    images = logged_attention(tmp_path)
    assert set(images) == ATTENTION
    for pixels, description in images.values():
        assert (pixels == pixels[..., :1]).all()  # grey
        assert "row i is the query" in description and "column j the key" in description
        assert "Where matplotlib is installed, the map has the characters along its axes" in description


def test_with_matplotlib_each_map_is_a_labelled_figure_in_colour(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(training.summaries, "MATPLOTLIB", True)
    images = logged_attention(tmp_path)
    assert set(images) == ATTENTION
    for pixels, description in images.values():
        assert (pixels != pixels[..., :1]).any()  # in colour
        assert "row i is the query, the character that attends" in description


def test_a_labelled_frame_paints_each_heads_map_into_its_box_and_keeps_its_labels_and_colour_bar():
    """Each cell of each head's box shows its weight, scaled to its row's maximum, in the colour bar's colour;
    later keys are white. Outside the boxes the frame stays as drawn: the characters and the colour bar."""
    pytest.importorskip("matplotlib")
    text = PROMPT[:BLOCK_SIZE]  # JULIET:↵O Romeo,
    weights = torch.rand(3, BLOCK_SIZE, BLOCK_SIZE, generator=torch.Generator().manual_seed(0)).tril()
    frame = LabelledHeads(3, text)
    image, other = frame(weights), frame(weights.flip(0))
    assert image.dtype == torch.uint8 and image.shape == frame.frame.shape and image.shape[-1] == 3
    shades = (weights / weights.amax(dim=-1, keepdim=True) * 255).round().long()
    outside = torch.ones(image.shape[:2], dtype=torch.bool)
    for head, (top, left, bottom, right) in enumerate(frame.boxes):
        outside[top:bottom, left:right] = False
        for i in range(BLOCK_SIZE):
            for j in range(BLOCK_SIZE):
                y = top + int((i + 0.5) * (bottom - top) / BLOCK_SIZE)
                x = left + int((j + 0.5) * (right - left) / BLOCK_SIZE)
                want = frame.colours[shades[head, i, j]] if j <= i else torch.full((3,), 255, dtype=torch.uint8)
                assert torch.equal(image[y, x], want), (head, i, j)
    assert torch.equal(image[outside], other[outside])  # only the boxes are painted again
    top, left, bottom, _ = frame.boxes[0]
    assert (image[top:bottom, :left] < 128).any()  # the characters and the axis's name, left of the first head
    for end in (frame.colours[0], frame.colours[255]):  # the colour bar, from 0 to its row's maximum
        assert ((image[outside].int() - end.int()).abs() <= 2).all(dim=-1).any()
