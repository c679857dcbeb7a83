"""What a person sees in TensorBoard, read from TensorBoard's own server over its HTTP data API: three tiny
trainings in one log directory: a single run, a sweep of two jobs (one of them with AdamW alone), and a run
crashed and resumed in its directory. The server reads the events with its Rust data server, as `tensorboard
--logdir runs` does where that is installed, and for a resumed run also with its Python loader, as it does
elsewhere."""

import json
import math
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

import train
from model import GPT
from test_train import config

RESUMED = "2026-01-01_00-02-00"  # crashed in step 7, after its checkpoint at step 5, and resumed from it
RUNS = {"2026-01-01_00-00-00": ["optim.lr=1e-2"], "multirun/2026-01-01_00-01-00/0": ["optim.lr=5e-3"],
        "multirun/2026-01-01_00-01-00/1": ["optim=adamw", "optim.lr=2e-3"],  # the others: the cpu preset's Muon
        RESUMED: ["optim.lr=3e-3"]}
STEPS = 10  # evaluated at 0, 5 and 10
SCALARS = {"loss/train", "loss/train_eval", "loss/val", "loss/val_best", "optim/grad_norm", "optim/lr",
           "perf/tokens_per_sec"}
ATTENTION = {f"sample/attention/layer{layer}/head{head}" for layer in range(2) for head in range(2)}
HPARAMS = ["optim.name", "optim.lr", "optim.muon_lr", "model.n_layer", "model.n_embd", "model.n_head",
           "model.block_size", "model.pos_emb", "model.dropout", "model.bias", "optim.decay", "optim.min_lr", "optim.weight_decay",
           "optim.muon_weight_decay", "train.batch_size", "train.grad_accum_steps", "train.max_iters", "train.seed",
           "device"]
INTEGERS = ["model.n_layer", "model.n_embd", "model.n_head", "model.block_size", "train.batch_size",
            "train.grad_accum_steps", "train.max_iters", "train.seed"]
TRIAL_ID_SHOWN = 14  # characters of the HParams table's Trial ID column (10em wide) that a browser shows


class Server:
    """`tensorboard --logdir` on a free loopback port, as a subprocess. load_fast: "auto" reads the event files with
    the Rust data server where it is installed, "false" with the Python loader."""

    def __init__(self, logdir: Path, load_fast: str = "auto"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{s.getsockname()[1]}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
             "--port", self.url.rsplit(":", 1)[1], "--reload_interval", "1", f"--load_fast={load_fast}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"tensorboard exited: {self.process.stderr.read()}")
            try:
                tags = self.get("plugin/scalars/tags")
                if len(tags) >= runs and all(
                        any(step == STEPS for _, step, _ in self.get("plugin/scalars/scalars", run=run, tag="loss/val"))
                        for run in tags if "loss/val" in tags[run]):
                    return
            except OSError:  # not listening yet
                pass
            time.sleep(0.5)
        raise AssertionError(f"tensorboard did not load {runs} runs in {timeout} s")

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stderr.close()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("tensorboard")
    logdir = tmp_path / "runs"
    for name, override in RUNS.items():
        overrides = [f"train.max_iters={STEPS}", "train.eval_interval=5", *override]
        if name == RESUMED:
            crash_in_step_7(tmp_path, overrides + ["train.log_interval=1"], logdir / name)
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
    (layer0head0,) = [tag for tag in ATTENTION if tag.endswith("layer0/head0")]
    shown = server.get("plugin/images/images", run=RESUMED, tag=layer0head0, sample=0)
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
        assert set(tags[run]) == SCALARS  # nothing else, e.g. no lone hparams metric
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


def test_train_and_val_loss_share_a_custom_scalars_chart(server):
    charts = [chart for category in server.get("plugin/custom_scalars/layout")["category"]
              for chart in category["chart"]]
    shared = [chart for chart in charts
              if all(any(re.search(pattern, tag) for pattern in chart.get("multiline", {}).get("tag", []))
                     for tag in ("loss/train", "loss/val"))]
    assert shared, charts


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


def test_hparams_integers_shown_as_integers(server):
    """The table shows a number to five digits (2 as 2.0000) and a string as it is."""
    names, types, groups = hparams_table(server)
    assert {key: types[key] for key in INTEGERS} == {key: "DATA_TYPE_STRING" for key in INTEGERS}
    for group in groups:
        hparams = group["hparams"]
        assert hparams[names["model.n_layer"]] == "2" and hparams[names["model.n_embd"]] == "32"
        assert hparams[names["train.max_iters"]] == str(STEPS) and hparams[names["train.seed"]] == "1337"


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


def test_attention_images_one_per_head_with_their_layout_explained(server):
    images = server.get("plugin/images/tags")
    for run in RUNS:
        assert set(images[run]) == ATTENTION
        for tag in ATTENTION:
            assert "Row i is the query" in images[run][tag]["description"]
    (layer0head1,) = [tag for tag in ATTENTION if tag.endswith("layer0/head1")]
    shown = server.get("plugin/images/images", run="2026-01-01_00-00-00", tag=layer0head1, sample=0)
    assert [image["step"] for image in shown] == [0, 5, 10]
    png = server.get("plugin/images/individualImage", blob_key=shown[-1]["query"].split("blob_key=")[1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (16, 16)  # block_size square
