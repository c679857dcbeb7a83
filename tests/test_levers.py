"""The training levers (model/designs/levers.py): each against a forward written out here from the weights, and
through the KV cache against full recomputation."""

import math

import pytest
import torch
import torch.nn.functional as F

from model import GPT, GPTConfig
from model.caches.factory import new_kv_cache
from model.designs.layers import build_model
from model.designs.levers import LEVERS, LOGIT_CAP, MTP_WEIGHT

SHAPE = dict(vocab_size=11, block_size=16, n_head=2, n_embd=16, bias=False)


def config(levers, n_layer=3, **fields):
    return GPTConfig(**SHAPE, n_layer=n_layer, levers=list(levers), **fields)


def tokens(T=12, B=2):
    return torch.randint(0, SHAPE["vocab_size"], (B, T), generator=torch.Generator().manual_seed(5))


def trained_a_little(model):
    """Weights moved off their start, so that zeros and ones (zero_init, the skip weights) are not special."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def plain_twin(model):
    """A GPT without levers holding model's weights (those it has)."""
    twin = GPT(GPTConfig(**SHAPE, n_layer=model.config.n_layer, pos_emb=model.config.pos_emb)).eval()
    twin.load_state_dict(model.state_dict(), strict=False)
    return twin


def rms_norm(x, gain):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps) * gain


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("levers", [[name] for name in LEVERS] + [list(LEVERS)], ids=lambda v: "+".join(v))
def test_cached_steps_equal_the_whole_sequence_with_every_lever(levers, pos_emb):
    torch.manual_seed(0)
    model = trained_a_little(build_model(config(levers, pos_emb=pos_emb)))
    x = tokens()
    full = model(x)[0]
    cache = new_kv_cache(model, 2, 16)
    steps = [model.decode_step(x[:, :5], cache)] + [model.decode_step(x[:, t:t + 1], cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 4:], atol=1e-5, rtol=1e-5)


def test_relu2_squares_the_relu_of_the_mlp():
    model = trained_a_little(build_model(config(["relu2"])))
    mlp, x = model.blocks[0].mlp, torch.randn(2, 5, 16)
    written = F.linear(torch.clamp(F.linear(x, mlp.fc.weight), min=0) ** 2, mlp.proj.weight)
    torch.testing.assert_close(mlp(x), written)


def test_qk_norm_attends_with_normalised_queries_and_keys():
    model = trained_a_little(build_model(config(["qk_norm"])))
    attn, x = model.blocks[0].attn, torch.randn(2, 5, 16)
    q, k, v = F.linear(x, attn.qkv.weight).split(16, -1)
    heads = lambda t: t.view(2, 5, 2, 8).transpose(1, 2)  # noqa: E731
    q, k, v = rms_norm(heads(q), attn.q_norm.weight), rms_norm(heads(k), attn.k_norm.weight), heads(v)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(torch.ones(5, 5).triu(1).bool(), -math.inf)
    written = F.linear((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, 16), attn.out_proj.weight)
    torch.testing.assert_close(attn(x), written, atol=1e-6, rtol=1e-5)


def test_logit_cap_soft_caps_the_plain_logits():
    model = trained_a_little(build_model(config(["logit_cap"])))
    with torch.no_grad():
        model.lm_head.weight.mul_(400)  # logits past the cap, where tanh bends
    x, twin = tokens(), plain_twin(model)
    raw = twin(x)[0]
    assert raw.abs().max() > 2 * LOGIT_CAP
    torch.testing.assert_close(model(x)[0], LOGIT_CAP * torch.tanh(raw / LOGIT_CAP))
    torch.testing.assert_close(model(x, x)[1], F.cross_entropy(model(x)[0].flatten(0, 1), x.flatten()))


def test_zero_init_starts_the_residual_projections_at_zero_and_only_them():
    model = build_model(config(["zero_init"]))
    for block in model.blocks:
        assert not block.attn.out_proj.weight.any() and not block.mlp.proj.weight.any()
        assert block.attn.qkv.weight.std() > 0.01 and block.mlp.fc.weight.std() > 0.01
    x = tokens()  # every block adds nothing: the logits are the embeddings' alone
    h = model.wte(x) + model.wpe(torch.arange(12))
    torch.testing.assert_close(model.eval()(x)[0], model.lm_head(model.ln_f(h)))


@pytest.mark.parametrize("n_layer", [2, 3, 4])
def test_unet_adds_each_first_half_output_to_its_mirror_input(n_layer):
    model = trained_a_little(build_model(config(["unet"], n_layer=n_layer)))
    assert model.skip_weights.shape == (n_layer // 2,)
    x, blocks = tokens(), model.blocks
    h, outputs = model.wte(x) + model.wpe(torch.arange(12)), []
    for i in range(n_layer):
        mirror = n_layer - 1 - i
        if mirror < n_layer // 2:
            h = h + model.skip_weights[mirror] * outputs[mirror]
        h = blocks[i](h)
        outputs.append(h)
    torch.testing.assert_close(model(x)[0], model.lm_head(model.ln_f(h)))
    with torch.no_grad():
        model.skip_weights.zero_()
    torch.testing.assert_close(model(x)[0], plain_twin(model)(x)[0])


def test_mtp_adds_the_token_after_next_loss_in_training_only():
    model = trained_a_little(build_model(config(["mtp"])))
    x, y = tokens(), tokens().roll(1, -1)
    twin = plain_twin(model)
    h = twin.ln_f(twin.blocks[2](twin.blocks[1](twin.blocks[0](twin.wte(x) + twin.wpe(torch.arange(12))))))
    main = F.cross_entropy(twin.lm_head(h).flatten(0, 1), y.flatten())
    after_next = F.cross_entropy(twin.lm_head(model.mtp_head(h[:, :-1])).flatten(0, 1), y[:, 1:].flatten())
    torch.testing.assert_close(model(x, y)[1], main)  # eval: the loss that val reports
    model.train()
    torch.testing.assert_close(model(x, y)[1], main + MTP_WEIGHT * after_next)


@pytest.mark.parametrize("levers, fields, message", [
    (["relu3"], {}, "levers must be distinct names among relu2, qk_norm"),
    (["unet", "unet"], {}, "levers must be distinct names"),
    (["qk_norm"], {"n_kv_head": 1}, "the qk_norm lever applies to the plain attention only"),
])
def test_a_lever_that_cannot_apply_is_refused(levers, fields, message):
    with pytest.raises(ValueError, match=message):
        build_model(config(levers, **fields))


def test_a_gpt_built_directly_refuses_levers_it_would_ignore():
    with pytest.raises(ValueError, match="this config names a design or levers: build its model with build_model"):
        GPT(config(["relu2"]))
