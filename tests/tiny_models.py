"""Tiny GPTs for the tests: random ones with pronounced attention, and briefly trained ones."""

from types import SimpleNamespace

import numpy as np
import torch

from model import GPT, GPTConfig, build_model

BLOCK_SIZE, VOCAB = 16, 13


def tiny_config(**overrides) -> GPTConfig:
    return GPTConfig(**{"vocab_size": VOCAB, "block_size": BLOCK_SIZE, "n_layer": 2, "n_head": 3, "n_embd": 24,
                        **overrides})


def random_model(seed=0, **overrides) -> GPT:
    """A tiny GPT in eval mode with weights well above GPT-2's 0.02 init, so that attention is far from
    uniform and every token of the context moves the logits (at 0.02 it mostly echoes the last token)."""
    torch.manual_seed(seed)
    model = build_model(tiny_config(**overrides))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return model.eval()


def trained_on(vocab, rarest: str) -> SimpleNamespace:
    """What build_checkpoint records of a run's text (a PreparedData's source, sha256 and training split): every
    character of vocab three times, but rarest once, so that an export names rarest bos, eos and unk."""
    text = rarest + vocab.chars.replace(rarest, "") * 3
    return SimpleNamespace(source="corpus.txt", sha256="0123456789abcdef" * 4,
                           train=np.array(vocab.encode(text), dtype=np.uint16))


def random_tokens(*shape, seed=0) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def train_briefly(model: GPT, text: torch.Tensor, steps: int, batch_size: int, lr: float = 1e-2) -> list[float]:
    """Adam steps on random windows of `text` (1-D token ids), so that the model's output depends on its
    context; returns the training losses. The model is left in train mode."""
    block_size = model.config.block_size
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    model.train()
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(text) - block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([text[s:s + block_size] for s in starts])
        y = torch.stack([text[s + 1:s + block_size + 1] for s in starts])
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
