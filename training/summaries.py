"""What a run shows in TensorBoard: losses, learning rate, throughput, samples, attention maps, hparams.

The tags are named for TensorBoard's layout. The Time Series dashboard sorts tag groups (the part of a tag
before its first "/") by name and opens only the first two, so `loss` sorts first and `optim` second; the
attention images (under `sample`) sort after them. Custom Scalars draws the train and val losses on one chart, which no
other dashboard can: as a margin chart, whose line (val) and band (down to train) read apart at a glance where a
multiline chart draws each run's series in one colour, and which TensorBoard never smooths, so that the few
evaluations read as measured. Everything goes to the run's one event file, so that TensorBoard shows one run per run.
"""

import contextlib
import importlib.util
import math
import os
import threading
import time
from pathlib import Path

import torch
from google.protobuf.struct_pb2 import Value
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
from tensorboard.plugins.image import metadata as image_metadata
from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
from tensorboard.util.tensor_util import make_tensor_proto
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import image

from data import CharVocab
from model import GPT, Sampling, generate
from model.gpt import POSITIONS
from model.measuring.attention_weights import attention_weights
from runtime.devices import RESOLVED_PRECISIONS

from .attention_maps import LabelledHeads, heads_in_a_grid, shown
from .config import DECAYS, OPTIMIZERS

DEVICE_TYPES = ("cpu", "cuda", "mps")
# The HParams table's columns, in this order; it shows the first five at first (the optimiser, its learning
# rates, the steps they are scheduled over, the depth) and offers the others. TensorBoard orders columns by name,
# hence the numbered names.
HPARAMS = ("optim.name", "optim.lr", "optim.muon_lr", "train.max_iters", "model.n_layer", "model.n_embd",
           "model.n_head", "model.n_kv_head", "model.kv_share", "model.window_pattern",
           "model.local_window", "model.learned_sink", "model.kv_latent", "model.kv_latent_rope", "model.block_size", "model.pos_emb", "model.dropout",
           "model.bias", "optim.decay", "optim.min_lr", "optim.weight_decay", "optim.muon_weight_decay",
           "train.batch_size", "train.grad_accum_steps", "train.threads", "train.seed", "device", "precision")
# the string hparams' every possible value
CHOICES = {"optim.name": OPTIMIZERS, "optim.decay": DECAYS, "model.pos_emb": POSITIONS, "device": DEVICE_TYPES,
           "precision": tuple(RESOLVED_PRECISIONS.values())}  # precision: what train.precision resolved to
# The scalar tags that bench/curve.py reads back, too
TRAIN_LOSS = "loss/train"
TRAIN_EVAL_LOSS = "loss/train_eval"  # the train split, evaluated like val
VAL_LOSS = "loss/val"
VAL_BEST = "loss/val_best"
LR = "optim/lr"  # AdamW's: every parameter's under optim=adamw, the embeddings' and gains' under optim=muon
MUON_LR = "optim/lr_muon"  # Muon's, on the blocks' matrices (optim=muon only)
PLANNED_STEPS = "optim/planned_steps"  # a budget's plan: where it was fixed and each change after
METRICS = ((VAL_BEST, "val loss (best)"), (VAL_LOSS, "val loss (last)"))
LOSS_CHART = "val loss: the line; train loss: the band's other edge (at each evaluation, unsmoothed)"
ATTENTION = ("Attention of layer {layer}'s {n_head} heads (head 0 top left, then left to right and top to bottom, "
             "between grey bars) on the last {size} characters of train.sample_prompt (below, and in the text "
             "sample/attention). In each head row i is the query at position i, column j the key at position j; "
             "the upper triangle is black because a query never sees later keys. Each row is scaled to its own "
             "maximum, so white marks each query's strongest key, not an absolute weight. Where matplotlib is "
             "installed, the map has the characters along its axes and a colour bar.\n\n{characters}")
ATTENTION_FIGURE = ("Attention of layer {layer}'s {n_head} heads on the last {size} characters of train.sample_prompt "
                    "(below, and in the text sample/attention). In each head row i is the query, the character that "
                    "attends, and column j the key, the character attended to; the upper triangle is blank because "
                    "a query never sees later keys. Each row is scaled to its own maximum, so the brightest cell "
                    "marks each query's strongest key, not an absolute weight.\n\n{characters}")
MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None  # labels the maps where installed; not required


def report_thread_error(args: threading.ExceptHookArgs) -> None:
    """train.py's threading.excepthook. TensorBoard's writer thread, which writes the events in the background, keeps
    the error that stops it (a full disk, the run directory removed) and raises it again at the writer's next call
    or at its close, in the training's thread, where it ends the run in one line; reported here, as every thread's
    error is by default, it would add a traceback."""
    if not isinstance(args.thread, _AsyncWriterThread):
        threading.__excepthook__(args)


def as_code(text: str) -> str:
    """Text as a Markdown code block, which is how TensorBoard shows it verbatim."""
    return "\n".join("    " + line for line in text.splitlines())


def by_position(text: str) -> str:
    """text under its positions, one column per character, as Markdown's verbatim block: a newline shows as ↵,
    other characters that print nothing as ·."""
    tens = "".join(f"{position:<10}" for position in range(0, len(text), 10)).rstrip()
    units = "".join(str(position % 10) for position in range(len(text)))
    return as_code("\n".join((tens, units, "".join(map(shown, text)))))


def hparam_name(key: str) -> str:
    """"optim.lr" -> "02 optim.lr": TensorBoard sorts the columns by this name and shows the key."""
    return f"{HPARAMS.index(key) + 1:02d} {key}"


def trial_name(run_dir: str, runs_dir: str) -> str:
    """The HParams table's Trial ID, of which a browser shows about 14 characters: the run directory's path under
    runs_dir read from its end, so that the part that differs comes first: runs/multirun/2026-11-23_06-12-34/0 ->
    "0 / 06-12-34_2026-11-23 / multirun". Reversing again gives the path back, so no two runs share a name."""
    parts = Path(os.path.relpath(run_dir, runs_dir)).parts
    return " / ".join("_".join(reversed(part.split("_"))) for part in reversed(parts))


def hparams_summary(tag: str, data: plugin_data_pb2.HParamsPluginData) -> Summary:
    return Summary(value=[Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data))])


def described_image(tag: str, pixels: torch.Tensor, description: str) -> Summary:
    """An image, grey (H, W) in [0, 1] or RGB (H, W, 3) of uint8, with a description, which TensorBoard shows
    beside it."""
    png = image(tag, pixels, dataformats="HW" if pixels.dim() == 2 else "HWC").value[0].image  # add_image takes none
    return Summary(value=[Summary.Value(
        tag=tag, metadata=image_metadata.create_summary_metadata(tag, description),
        tensor=make_tensor_proto([str(png.width).encode(), str(png.height).encode(), png.encoded_image_string]))])


def after_earlier_lives(run_dir: Path) -> None:
    """Return once a new event file in run_dir would sort after those there. TensorBoard reads a run's event files
    in the order of their names (a later file is a later life), and a name starts with the second the file was
    opened, then the host, the process id and a counter, which need not sort (counter 10 sorts before 9): a life
    that starts within the second the last one opened its file, as a resume in the same process can, waits for
    the next second."""
    seconds = []
    for path in Path(run_dir).glob("events.out.tfevents.*"):
        with contextlib.suppress(ValueError, IndexError):
            seconds.append(int(path.name.split(".")[3]))
    while seconds and time.time() < max(seconds) + 1:
        time.sleep(max(seconds) + 1 - time.time())


class Summaries:
    """The run's TensorBoard events, written by one process."""

    def __init__(self, run_dir: Path, config_yaml: str, first_step: int = 0):
        """first_step: the step the run starts from, 0 or the resumed step. Every life of a run marks its start
        there (purge_step writes a SessionLog START), so that TensorBoard's Python loader (--load_fast=false, or
        where its Rust data server is not installed) drops what earlier lives logged there and after, in every tag,
        and the run's curves go on as one. That loader takes a run's first START for its beginning, so a new run
        writes one too. The Rust data server reads no SessionLog: it drops a tag's points where the tag's steps go
        back."""
        after_earlier_lives(run_dir)
        self.writer = SummaryWriter(str(run_dir), purge_step=first_step)
        self.first_step = first_step
        self.frames = {}  # (n_head, text) -> its LabelledHeads, drawn at the first evaluation
        self.writer.add_text("config", as_code(config_yaml))
        self.writer.add_custom_scalars({  # one series a chart: a multiline chart draws a run's series in one colour
            "loss": {LOSS_CHART: ["Margin", [VAL_LOSS, TRAIN_EVAL_LOSS, VAL_LOSS]]},  # the line, the band's edges
            "optim": {"AdamW's learning rate": ["Multiline", [f"^{LR}$"]],
                      "Muon's learning rate": ["Multiline", [f"^{MUON_LR}$"]]}})

    def train_steps(self, first_step: int, losses: list, grad_norms: list, lrs: list[tuple], walltimes: list,
                    tokens_per_sec: float):
        """Each step's values at the time that step finished. lrs: each step's learning rates, AdamW's and (with
        optim=muon) Muon's, in the order of training/optim.py's make_optimizers."""
        for i, (loss, norm, step_lrs, walltime) in enumerate(zip(losses, grad_norms, lrs, walltimes)):
            self.writer.add_scalar(TRAIN_LOSS, loss, first_step + i, walltime)
            self.writer.add_scalar("optim/grad_norm", norm, first_step + i, walltime)
            for tag, lr in zip((LR, MUON_LR), step_lrs):
                self.writer.add_scalar(tag, lr, first_step + i, walltime)
        self.writer.add_scalar("perf/tokens_per_sec", tokens_per_sec, first_step + len(losses), walltimes[-1])

    def plan(self, step: int, steps: int):
        """A budget's plan at `step`: the run now ends at step `steps`."""
        self.writer.add_scalar(PLANNED_STEPS, steps, step)

    def threads(self, step: int, threads: int):
        """The thread count the steps from `step` on take, chosen again (training/threads.py)."""
        self.writer.add_scalar("perf/threads", threads, step)

    def evaluation(self, step: int, losses: dict[str, float], best_val_loss: float):
        self.writer.add_scalar(VAL_LOSS, losses["val"], step)
        self.writer.add_scalar(TRAIN_EVAL_LOSS, losses["train"], step)  # the same batches at every evaluation
        if math.isfinite(best_val_loss):  # inf until best.pt exists: weights never trained are no candidate
            self.writer.add_scalar(VAL_BEST, best_val_loss, step)

    @torch.no_grad()
    def sample_and_attention(self, model: GPT, vocab: CharVocab, prompt: torch.Tensor, n_tokens: int, seed: int,
                             step: int):
        """A sample continuing the prompt (KV-cache generation, fixed seed), and each layer's attention on it, its
        heads in one image, with the characters at each position beside it: a labelled figure where matplotlib is
        installed, else a grey grid (heads_in_a_grid)."""
        model.eval()
        generator = torch.Generator(prompt.device).manual_seed(seed)  # leaves the training RNG untouched
        ids = generate(model, prompt, n_tokens, sampling=Sampling(), generator=generator)
        self.writer.add_text("sample", as_code(vocab.decode(ids[0].tolist())), step)
        context = prompt[:, -model.config.block_size:]
        text = vocab.decode(context[0].tolist())
        characters = by_position(text)
        if step == self.first_step:  # the same at every evaluation
            self.writer.add_text("sample/attention", characters, step)
        for layer, weights in enumerate(attention_weights(model, context)):  # (1, n_head, T, T)
            pixels = self.labelled(weights.shape[1], text)(weights[0]) if MATPLOTLIB else heads_in_a_grid(weights[0])
            description = (ATTENTION_FIGURE if MATPLOTLIB else ATTENTION).format(
                layer=layer, n_head=weights.shape[1], size=context.shape[1], characters=characters)
            self.writer.file_writer.add_summary(
                described_image(f"sample/attention/layer{layer}", pixels, description), step)
        model.train()

    def labelled(self, n_head: int, text: str) -> LabelledHeads:
        """The frame for n_head heads on text, drawn once."""
        if (n_head, text) not in self.frames:
            self.frames[n_head, text] = LabelledHeads(n_head, text)
        return self.frames[n_head, text]

    def start_session(self, config: dict, device_type: str, precision: str):
        """The HParams dashboard's row for this run: its settings now, its metrics read from loss/val_best
        and loss/val as they are logged. The table shows every number to five digits (4 as 4.0000), so integers
        go as strings; a muon_ setting is left blank under AdamW, which does not use it."""
        flat = {"device": device_type, "precision": precision,
                **{f"{section}.{key}": value for section in ("model", "optim", "train")
                   for key, value in config[section].items()}}
        infos, values = [], {}
        for key in HPARAMS:
            name, value = hparam_name(key), flat[key]
            info = api_pb2.HParamInfo(name=name, display_name=key)
            if isinstance(value, bool):
                info.type = api_pb2.DATA_TYPE_BOOL
                info.domain_discrete.extend([False, True])
                value = Value(bool_value=value)
            elif isinstance(value, str):  # a setting without fixed choices (window_pattern) gets no domain
                info.type = api_pb2.DATA_TYPE_STRING
                info.domain_discrete.extend(CHOICES.get(key, ()))
                value = Value(string_value=value)
            elif value is None or isinstance(value, int):  # no domain: the dashboard filters it by a regular expression
                info.type = api_pb2.DATA_TYPE_STRING
                value = Value(string_value="none" if value is None else str(value))
            else:  # no interval: any run's value passes the dashboard's filter
                info.type = api_pb2.DATA_TYPE_FLOAT64
                value = Value(number_value=value)
            infos.append(info)
            if not key.startswith("optim.muon_") or flat["optim.name"] == "muon":
                values[name] = value
        metrics = [api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag), display_name=shown)
                   for tag, shown in METRICS]
        experiment = api_pb2.Experiment(hparam_infos=infos, metric_infos=metrics)
        start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time(),
                                                 group_name=trial_name(self.writer.log_dir, config["runs_dir"]))
        for name, value in values.items():
            start.hparams[name].CopyFrom(value)
        for tag, data in ((metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=experiment)),
                          (metadata.SESSION_START_INFO_TAG,
                           plugin_data_pb2.HParamsPluginData(session_start_info=start))):
            self.writer.file_writer.add_summary(hparams_summary(tag, data))

    def end_session(self, status: int):
        """status: api_pb2.STATUS_SUCCESS or STATUS_FAILURE (diverged)."""
        end = plugin_data_pb2.SessionEndInfo(status=status, end_time_secs=time.time())
        self.writer.file_writer.add_summary(
            hparams_summary(metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=end)))

    def close(self):
        self.writer.close()
