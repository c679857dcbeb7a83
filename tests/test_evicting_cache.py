"""Eviction under a slot budget (model/caches/evicting.py): H2O and TOVA against their rules written out here,
on random attention scores and through a whole model decoding far past its budget; the full budget against the
full cache; the settings that cannot work."""

import math

import pytest
import torch
import torch.nn.functional as F

from model import GREEDY, generate
from model.attention import rotary
from model.caches.evicting import new_evicting_cache
from test_sink_cache import cached_logits
from tiny_models import random_model, random_tokens
from tolerance import assert_forward_close
from model.caches.factory import new_kv_cache


def evict(policy: str, kept: list[int], score: dict[int, float], budget: int, newest: int, block: int) -> int:
    """The token a full head drops before token newest + 1 comes: one that token would not see (block tokens back),
    else the least score among all but the newest budget // 2 tokens for h2o (its total weight), budget // 4 for
    merge, none for tova (their newest query's weight)."""
    leaving = [j for j in kept if j <= newest + 1 - block]
    if leaving:
        return leaving[0]
    protected = {"h2o": budget // 2, "merge": budget // 4}.get(policy, 0)
    return min((j for j in kept if j <= newest - protected), key=lambda j: score[j])


def observe(policy: str, score: dict[int, float], weights: dict[int, float]) -> None:
    for j, w in weights.items():
        score[j] = score.get(j, 0.0) + w if policy == "h2o" else w


def turn(v, position, hd):
    """v (..., hd) turned to position: channel pair (i, i + hd/2) by position * 10000^(-2i/hd)."""
    angle = position * 10_000.0 ** -(torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    cos, sin = angle.cos().float(), angle.sin().float()
    a, b = v[..., :hd // 2], v[..., hd // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def token_by_token(model, seq, attention):
    """Logits (B, T, vocab) of seq fed one token at a time, each layer's attention written out by
    attention(p, layer, q (B, nh, hd), k (B, n_kv, hd), v (B, n_kv, hd)) -> (B, nh, hd), given the token's
    projections before rotary positions turn them."""
    c = model.config
    B, T = seq.shape
    hd = c.n_embd // c.n_head
    kv_width = c.n_kv_head * hd
    logits = []
    for p in range(T):
        x = model.wte(seq[:, p])  # (B, C)
        for layer, block in enumerate(model.blocks):
            out = F.linear(block.ln_1(x), block.attn.qkv.weight, block.attn.qkv.bias)
            q = out[:, :c.n_embd].view(B, c.n_head, hd)
            k = out[:, c.n_embd:c.n_embd + kv_width].view(B, c.n_kv_head, hd)
            v = out[:, c.n_embd + kv_width:].view(B, c.n_kv_head, hd)
            x = x + block.attn.out_proj(attention(p, layer, q, k, v).reshape(B, c.n_embd))
            x = x + block.mlp(block.ln_2(x))
        logits.append(model.lm_head(model.ln_f(x)))
    return torch.stack(logits, dim=1)


def eviction_reference(model, seq, policy: str, budget: int):
    """Logits (B, T, vocab) of seq fed one token at a time, each layer's key/value head of each row keeping its own
    tokens by the policy, at their own positions. Also each (row, layer, head)'s kept tokens at the end."""
    c = model.config
    B = seq.size(0)
    hd, group = c.n_embd // c.n_head, c.n_head // c.n_kv_head
    keys = [[] for _ in model.blocks]  # per layer, token j's raw keys (B, n_kv, hd) and values
    values = [[] for _ in model.blocks]
    kept = {(b, layer, g): [] for b in range(B) for layer in range(c.n_layer) for g in range(c.n_kv_head)}
    score = {key: {} for key in kept}

    def attention(p, layer, q, k_new, v_new):
        keys[layer].append(k_new)
        values[layer].append(v_new)
        y = torch.zeros(B, c.n_head, hd)
        for b in range(B):
            for g in range(c.n_kv_head):
                own = kept[b, layer, g]
                if len(own) == budget:
                    own.remove(evict(policy, own, score[b, layer, g], budget, p - 1, c.block_size))
                own.append(p)
                seen = sorted(own)
                k = torch.stack([turn(keys[layer][j][b, g], j, hd) for j in seen])
                v = torch.stack([values[layer][j][b, g] for j in seen])
                mean = torch.zeros(len(seen))
                for head in range(g * group, (g + 1) * group):
                    w = (k @ turn(q[b, head], p, hd) / math.sqrt(hd)).softmax(dim=-1)
                    y[b, head] = w @ v
                    mean += w / group
                observe(policy, score[b, layer, g], dict(zip(seen, mean.tolist())))
        return y

    return token_by_token(model, seq, attention), {key: sorted(own) for key, own in kept.items()}


def kept_tokens(cache, B, n_layer, n_kv_head) -> dict:
    return {(b, layer, g): sorted(getattr(cache, f"token{layer}")[b, g].tolist())
            for b in range(B) for layer in range(n_layer) for g in range(n_kv_head)}


@pytest.mark.parametrize("policy", ["h2o", "tova"])
@pytest.mark.parametrize("n_kv_head, budget, prompt_len", [(3, 6, 6), (1, 5, 3)])
@torch.no_grad()
def test_each_head_keeps_what_the_policy_written_out_keeps_and_decodes_as_it_would(policy, n_kv_head, budget,
                                                                                   prompt_len):
    """Every step's logits over 3 x block_size tokens, the prompt prefilled in one chunk (which fills the cache, or
    not), and each row's, layer's and key/value head's tokens at the end."""
    model = random_model(pos_emb="rope", n_kv_head=n_kv_head)
    c = model.config
    seq = random_tokens(2, 3 * c.block_size, seed=8)
    cache = new_evicting_cache(model, 2, policy=policy, budget=budget)
    cached = cached_logits(model, seq, prompt_len, cache)
    reference, kept = eviction_reference(model, seq[:, :-1], policy, budget)
    assert_forward_close(cached, reference[:, prompt_len - 1:], model)
    assert kept_tokens(cache, 2, c.n_layer, n_kv_head) == kept
    if n_kv_head > 1 or policy == "tova":
        assert len({tuple(own) for own in kept.values()}) > 1  # the heads keep different tokens


class RandomAttention:
    """Stands in for a model: one layer's random queries, keys and values, large enough for uneven weights."""

    def __init__(self, n_head, n_kv_head, hd, seed):
        self.generator = torch.Generator().manual_seed(seed)
        self.n_head, self.n_kv_head, self.hd = n_head, n_kv_head, hd

    def next(self, B):
        q = 3 * torch.randn(B, self.n_head, 1, self.hd, generator=self.generator)
        k, v = (3 * torch.randn(B, self.n_kv_head, 1, self.hd, generator=self.generator) for _ in range(2))
        return q, k, v


@pytest.mark.parametrize("policy", ["h2o", "tova"])
def test_on_random_attention_scores_each_head_keeps_the_tokens_the_rule_keeps(policy):
    """One layer's view fed random queries, keys and values for 60 steps, past block_size; the rule applied to the
    weights written out keeps the same tokens at every step."""
    model = random_model(pos_emb="rope", n_head=4, n_kv_head=2, n_embd=32)
    B, budget, hd, group = 3, 7, 8, 2
    cache = new_evicting_cache(model, B, policy=policy, budget=budget)
    source = RandomAttention(4, 2, hd, seed=9)
    raw_keys = []
    kept = {(b, g): [] for b in range(B) for g in range(2)}
    score = {key: {} for key in kept}
    for p in range(60):
        q, k, v = source.next(B)
        raw_keys.append(k)
        positions = torch.tensor([p])
        cos, sin = (x.view(1, 1, 1, hd) for x in rotary(positions, hd))
        view = cache.begin(1).layer(0)
        k_read, v_read = view.update(k * cos + k.roll(hd // 2, -1) * sin, v)
        view.attend(q * cos + q.roll(hd // 2, -1) * sin, k_read, v_read, None)
        for (b, g), own in kept.items():
            if len(own) == budget:
                own.remove(evict(policy, own, score[b, g], budget, p - 1, model.config.block_size))
            own.append(p)
            seen = sorted(own)
            keys = torch.stack([turn(raw_keys[j][b, g, 0], j, hd) for j in seen])
            mean = sum((keys @ turn(q[b, g * group + h, 0], p, hd) / math.sqrt(hd)).softmax(-1)
                       for h in range(group)) / group
            observe(policy, score[b, g], dict(zip(seen, mean.tolist())))
        assert {key: sorted(cache.token0[key[0], key[1], :len(own)].tolist()) for key, own in kept.items()} == \
            {key: sorted(own) for key, own in kept.items()}, f"step {p}"


@pytest.mark.parametrize("policy", ["h2o", "tova"])
@torch.no_grad()
def test_a_budget_that_holds_the_whole_context_is_the_full_cache(policy):
    """block_size slots keep every token the full cache's ring sees, also far past block_size."""
    model = random_model(pos_emb="rope", n_kv_head=1)
    block = model.config.block_size
    seq = random_tokens(2, 4 * block, seed=10)
    full = cached_logits(model, seq, 5, new_kv_cache(model, 2))
    evicting = cached_logits(model, seq, 5, new_evicting_cache(model, 2, policy=policy, budget=block))
    assert_forward_close(evicting, full, model)
    prompt = seq[:, :4]
    assert torch.equal(generate(model, prompt, 3 * block, sampling=GREEDY,
                                cache=new_evicting_cache(model, 2, policy=policy, budget=block)),
                       generate(model, prompt, 3 * block, sampling=GREEDY))


def test_many_samples_of_one_prompt_decode_as_one_row_does():
    model = random_model(pos_emb="rope")
    prompt = random_tokens(1, 7, seed=11)
    alone = generate(model, prompt, 40, sampling=GREEDY, cache=new_evicting_cache(model, 1, policy="h2o", budget=6))
    shared = generate(model, prompt.expand(3, -1), 40, sampling=GREEDY,
                      cache=new_evicting_cache(model, 3, policy="h2o", budget=6))
    assert torch.equal(shared, alone.expand(3, -1))


@pytest.mark.parametrize("overrides, kwargs, fragment", [
    (dict(pos_emb="rope"), dict(policy="lru", budget=6), "unknown eviction policy 'lru': choose one of h2o, tova"),
    (dict(), dict(policy="h2o", budget=6), "needs pos_emb=rope"),
    (dict(pos_emb="rope", kv_share=2), dict(policy="h2o", budget=6), "plain or grouped attention"),
    (dict(pos_emb="rope"), dict(policy="tova", budget=1), "budget must be an integer from 2 to block_size=16"),
    (dict(pos_emb="rope"), dict(policy="tova", budget=17), "got 17"),
])
def test_settings_that_cannot_work_are_refused(overrides, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        new_evicting_cache(random_model(**overrides), 1, **kwargs)


def test_padding_rollback_and_compile_are_refused():
    model = random_model(pos_emb="rope")
    with pytest.raises(ValueError, match="no left padding"):
        generate(model, random_tokens(2, 5), 3, cache=new_evicting_cache(model, 2, policy="h2o", budget=6),
                 n_pad=[0, 2])
    cache = new_evicting_cache(model, 1, policy="tova", budget=6)
    model.decode_step(random_tokens(1, 5), cache)
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback(1)
    with pytest.raises(ValueError, match="decodes eagerly"):
        generate(model, random_tokens(1, 5), 3, cache=cache, compile=True)
