"""What a run shows in TensorBoard: losses, learning rate, throughput, samples, attention maps, hparams."""

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.tensorboard import SummaryWriter

from data import CharVocab
from model import GPT, Sampling, generate

from .config import flatten


def as_code(text: str) -> str:
    """Text as a Markdown code block, which is how TensorBoard shows it verbatim."""
    return "\n".join("    " + line for line in text.splitlines())


class Summaries:
    """The run's TensorBoard events, written by one process."""

    def __init__(self, run_dir: Path, config_yaml: str):
        self.writer = SummaryWriter(str(run_dir))
        self.writer.add_text("config", as_code(config_yaml))

    def train_steps(self, first_step: int, losses: list, grad_norms: list, lrs: list, tokens_per_sec: float):
        for i, (loss, norm, lr) in enumerate(zip(losses, grad_norms, lrs)):
            self.writer.add_scalar("train/loss", loss, first_step + i)
            self.writer.add_scalar("train/grad_norm", norm, first_step + i)
            self.writer.add_scalar("train/lr", lr, first_step + i)
        self.writer.add_scalar("perf/tokens_per_sec", tokens_per_sec, first_step + len(losses))

    def evaluation(self, step: int, losses: dict[str, float]):
        self.writer.add_scalar("val/loss", losses["val"], step)
        self.writer.add_scalar("train/eval_loss", losses["train"], step)

    @torch.no_grad()
    def sample_and_attention(self, model: GPT, vocab: CharVocab, prompt: torch.Tensor, n_tokens: int, seed: int,
                             step: int):
        """A sample continuing the prompt (KV-cache generation, fixed seed) and each layer's attention on it."""
        model.eval()
        generator = torch.Generator(prompt.device).manual_seed(seed)  # leaves the training RNG untouched
        ids = generate(model, prompt, n_tokens, sampling=Sampling(), generator=generator)
        self.writer.add_text("sample", as_code(vocab.decode(ids[0].tolist())), step)
        context = prompt[:, -model.config.block_size:]
        for layer, weights in enumerate(model.attention_weights(context)):  # (1, n_head, T, T)
            # each query's strongest key white; the heads side by side with a white line between them
            heads = weights[0] / weights[0].amax(dim=-1, keepdim=True)
            image = torch.cat([F.pad(head, (0, 1), value=1.0) for head in heads], dim=1)
            self.writer.add_image(f"attention/layer_{layer}", image.float().cpu(), step, dataformats="HW")
        model.train()

    def hparams(self, config: dict, val_loss: float | None):
        if val_loss is None:  # stopped before the first evaluation: no result to show
            return
        hparams = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in flatten(config).items()}
        self.writer.add_hparams(hparams, {"hparam/val_loss": val_loss}, run_name=".")  # ".": the run's own directory

    def close(self):
        self.writer.close()
