"""Training levers from modded-nanogpt's speedruns, switched on by name in GPTConfig.levers (model.levers=[relu2]):

- relu2: the MLP's activation is ReLU squared, not GELU.
- qk_norm: each head's queries and keys are RMS-normalised, with a learned gain, before rotary positions.
- logit_cap: the logits are soft-capped, LOGIT_CAP * tanh(logits / LOGIT_CAP).
- zero_init: the residual projections (attention's out_proj, the MLP's proj) start at zero.
- unet: U-net skips: each block of the first half hands its output to its mirror in the second half, weighted.
- mtp: in training, an auxiliary loss (weight MTP_WEIGHT) predicts the token after next from the same hidden state.

None changes what the KV cache holds: keys are normalised before they are cached, and the rest is outside attention.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import CausalSelfAttention, causal_mask, rotary, rotate
from ..gpt import GPT, MLP, GPTConfig

LEVERS = ("relu2", "qk_norm", "logit_cap", "zero_init", "unet", "mtp")
LOGIT_CAP = 15.0  # modded-nanogpt's
MTP_WEIGHT = 0.3


def check_levers(config: GPTConfig) -> None:
    """A ValueError naming a lever that does not exist, or one that cannot apply to this config."""
    unknown = [name for name in config.levers if name not in LEVERS]
    if unknown or len(set(config.levers)) < len(config.levers):
        raise ValueError(f"levers must be distinct names among {', '.join(LEVERS)}, got {list(config.levers)}")
    if "qk_norm" in config.levers and not config.plain_attention:
        raise ValueError("the qk_norm lever applies to the plain attention only: drop the design's fields, or the lever")


class ReLU2MLP(MLP):
    def forward(self, x):
        return self.dropout(self.proj(F.relu(self.fc(x)).square()))


class QKNormAttention(CausalSelfAttention):
    """Queries and keys RMS-normalised per head, so that no logit grows past √head_dim times the gains."""

    def __init__(self, config, kv_layer: int):
        super().__init__(config, kv_layer)
        self.q_norm, self.k_norm = nn.RMSNorm(config.head_dim), nn.RMSNorm(config.head_dim)

    def project(self, x, rope, kv):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).split(self.widths, -1))
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        if kv is not None:
            k, v = kv.update(k, v)
        return q, k, v


class LeverGPT(GPT):
    """The GPT with config.levers switched on; the attention layers are the plain ones, or a design's."""

    def __init__(self, config: GPTConfig, attention: list[nn.Module] | None = None):
        levers = set(config.levers)
        if "qk_norm" in levers:
            attention = [QKNormAttention(config, kv_layer=i) for i in range(config.n_layer)]
        super().__init__(config, attention)
        for block in self.blocks:
            if "relu2" in levers:
                block.mlp = ReLU2MLP(config)
        self.mtp_head = nn.Linear(config.n_embd, config.n_embd, bias=False) if "mtp" in levers else None
        # one weight per skip, as many skips as blocks in the first half
        self.skip_weights = nn.Parameter(torch.ones(config.n_layer // 2)) if "unet" in levers else None
        self.apply(self._init_weights)
        for block in self.blocks:  # GPT's residual scaling, or zeros
            for proj in (block.attn.out_proj, block.mlp.proj):
                if "zero_init" in levers:
                    nn.init.zeros_(proj.weight)
                else:
                    nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def logits(self, h):
        logits = self.lm_head(h)
        return LOGIT_CAP * torch.tanh(logits / LOGIT_CAP) if "logit_cap" in self.config.levers else logits

    def forward(self, idx, targets=None, *, cache=None):
        h = self._trunk(idx, cache)  # (B, T, C)
        logits, loss = self.logits(h), None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
            if self.mtp_head is not None and self.training:  # position t also predicts token t + 2
                after_next = self.logits(self.mtp_head(h[:, :-1]))
                loss = loss + MTP_WEIGHT * F.cross_entropy(after_next.reshape(-1, after_next.size(-1)),
                                                           targets[:, 1:].reshape(-1))
        return logits, loss

    def decode_step(self, idx, cache):
        return self.logits(self._trunk(idx, cache)[:, -1])

    def _trunk(self, idx, cache=None):
        """GPT's trunk, with U-net skips when the unet lever is on."""
        if self.skip_weights is None:
            return super()._trunk(idx, cache)
        B, T = idx.shape
        c = self.config
        if self.wpe is not None and cache is None and T > c.block_size:
            raise ValueError(f"{T} tokens, but learned positions stop at block_size={c.block_size}: "
                             f"feed the last {c.block_size} at most")
        step = cache.begin(T) if cache is not None else None
        pos, attn_mask = (step.positions, step.mask) if step else (torch.arange(T, device=idx.device), None)
        if step is None and T > c.block_size:
            attn_mask = causal_mask(T, T, idx.device, reach=c.block_size)
        x = self.wte(idx)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(pos)
        else:
            rope = rotary(pos, self.blocks[0].attn.rotary_dim)
        x = self.drop(x)
        n, half, skips = len(self.blocks), len(self.skip_weights), []
        for i, block in enumerate(self.blocks):
            if i >= n - half:  # the second half: the mirror block's output joins the input
                x = x + self.skip_weights[n - 1 - i] * skips.pop()
            x = block(x, attn_mask, rope, step.layer(block.attn.kv_layer) if step else None)
            if i < half:
                skips.append(x)
        return self.ln_f(x)
