"""Eviction that merges (model/caches/merging.py): against its rule written out here, on random attention
scores and through a whole model; equal keys merged lose nothing; the full budget is the full cache."""

import math

import pytest
import torch
import torch.nn.functional as F

from model import GREEDY, generate
from model.attention import rotary
from model.caches.factory import new_cache
from model.caches.merging import new_merging_cache
from test_evicting_cache import RandomAttention, evict, token_by_token, turn
from test_sink_cache import cached_logits
from tiny_models import random_model, random_tokens
from tolerance import U, assert_forward_close, assert_within, attention_bound, gamma
from model.caches.factory import new_kv_cache


def turn_error(x) -> torch.Tensor:
    """The bound on a float32 turn's error, per channel (..., hd): cos or sin rounded, a product, a sum."""
    return gamma(3) * (x.abs() + x.abs().roll(x.size(-1) // 2, -1))


class MergingHead:
    """One row's key/value head, written out: each kept token's key, value, count of tokens it stands for, and the
    newest query's weight on it. Also each key's and value's bound on its float32 error (`error`, per channel)."""

    def __init__(self, budget: int, block: int):
        self.budget, self.block = budget, block
        self.key, self.value, self.count, self.weight, self.error = {}, {}, {}, {}, {}

    def add(self, p: int, key, value, key_error) -> None:
        """Token p comes. A full head first drops the token p would not see (block tokens back); else TOVA's least
        weight among all but the newest budget // 4, merged into the kept key of highest cosine similarity.
        key_error: the bound on its key's own error (the turn's rounding)."""
        if len(self.key) == self.budget:
            old = evict("merge", list(self.key), self.weight, self.budget, p - 1, self.block)
            k, v, n, (dk, dv) = self.key.pop(old), self.value.pop(old), self.count.pop(old), self.error.pop(old)
            if old > p - self.block:  # merged, unless it leaves the view
                host = max(self.key, key=lambda j: F.cosine_similarity(self.key[j], k, dim=0).item())
                m, (dk_host, dv_host) = self.count[host], self.error[host]
                # a mean's error: the means of the two errors, and its own 4 roundings (the cache's form, kept +
                # share (leaving - kept), rounds as often) of at most |kept| + |leaving| each
                self.error[host] = tuple((m * d_host + n * d) / (m + n) + 4 * U * (kept.abs() + leaving.abs())
                                         for d_host, d, kept, leaving in ((dk_host, dk, self.key[host], k),
                                                                          (dv_host, dv, self.value[host], v)))
                self.key[host] = (m * self.key[host] + n * k) / (m + n)
                self.value[host] = (m * self.value[host] + n * v) / (m + n)
                self.count[host] = m + n
        self.key[p], self.value[p], self.count[p], self.error[p] = key, value, 1, (key_error, torch.zeros_like(value))

    def attend(self, queries) -> torch.Tensor:
        """queries (group, hd) -> (group, hd): softmax(q kᵀ / √hd + log count) v; keeps the heads' mean weights."""
        kept = sorted(self.key)
        k, v = torch.stack([self.key[j] for j in kept]), torch.stack([self.value[j] for j in kept])
        bias = torch.tensor([float(self.count[j]) for j in kept]).log()
        w = (queries @ k.T / math.sqrt(k.size(-1)) + bias).softmax(dim=-1)  # (group, kept)
        self.weight = dict(zip(kept, w.mean(dim=0).tolist()))
        return w @ v

    def bound(self, queries, query_error) -> torch.Tensor:
        """attend's bound against the exact value: attention_bound over the kept keys and values and their errors."""
        kept = sorted(self.key)
        k, v, dk, dv = (torch.stack([part[j] for j in kept]) for part in
                        (self.key, self.value, {j: e[0] for j, e in self.error.items()},
                         {j: e[1] for j, e in self.error.items()}))
        bias = torch.tensor([float(self.count[j]) for j in kept]).log()
        return attention_bound(queries, k, v, dq=query_error, dk=dk, dv=dv, bias=bias)[0]


def cache_state(cache, layer: int, b: int, g: int) -> dict:
    """Token number -> count of the tokens a cache's head keeps."""
    tokens, counts = getattr(cache, f"token{layer}")[b, g], getattr(cache, f"count{layer}")[b, g]
    n = min(int(cache.pos), cache.max_len)
    return dict(zip(tokens[:n].tolist(), counts[:n].tolist()))


def test_on_random_attention_scores_each_head_keeps_merges_and_attends_as_the_rule_written_out():
    """One layer's view fed random queries, keys and values for 60 steps, past block_size: its output at every
    step, and each head's tokens and counts, equal the rule's."""
    model = random_model(pos_emb="rope", n_head=4, n_kv_head=2, n_embd=32)
    B, budget, hd, group = 3, 7, 8, 2
    cache = new_merging_cache(model, B, budget=budget)
    source = RandomAttention(4, 2, hd, seed=9)
    heads = {(b, g): MergingHead(budget, model.config.block_size) for b in range(B) for g in range(2)}
    merged = 0
    for p in range(60):
        q, k, v = source.next(B)
        cos, sin = (x.view(1, 1, 1, hd) for x in rotary(torch.tensor([p]), hd))
        view = cache.begin(1).layer(0)
        k_read, v_read = view.update(k * cos + k.roll(hd // 2, -1) * sin, v)
        y = view.attend(q * cos + q.roll(hd // 2, -1) * sin, k_read, v_read, None)
        for (b, g), head in heads.items():
            head.add(p, turn(k[b, g, 0], p, hd), v[b, g, 0], turn_error(k[b, g, 0]))
            queries = torch.stack([turn(q[b, h, 0], p, hd) for h in range(g * group, (g + 1) * group)])
            expected = head.attend(queries)
            # the cache and this rule each within head.bound of the exact value
            bound = 2 * head.bound(queries, turn_error(q[b, g * group:(g + 1) * group, 0]))
            assert_within(y[b, g * group:(g + 1) * group, 0], expected, bound, f"step {p}")
            assert cache_state(cache, 0, b, g) == head.count, f"step {p}"
            merged = max(merged, max(head.count.values()))
    assert merged > 2  # some slots stand for several tokens


def merging_reference(model, seq, budget: int):
    """Logits (B, T, vocab) of seq fed one token at a time, each layer's key/value head of each row a MergingHead;
    and the heads."""
    c = model.config
    B = seq.size(0)
    hd, group = c.n_embd // c.n_head, c.n_head // c.n_kv_head
    heads = {(b, layer, g): MergingHead(budget, c.block_size)
             for b in range(B) for layer in range(c.n_layer) for g in range(c.n_kv_head)}

    def attention(p, layer, q, k, v):
        y = torch.zeros(B, c.n_head, hd)
        for (b, at, g), head in heads.items():
            if at == layer:
                own = slice(g * group, (g + 1) * group)
                head.add(p, turn(k[b, g], p, hd), v[b, g], turn_error(k[b, g]))
                y[b, own] = head.attend(torch.stack([turn(query, p, hd) for query in q[b, own]]))
        return y

    return token_by_token(model, seq, attention), heads


@pytest.mark.parametrize("n_kv_head, budget, prompt_len", [(3, 6, 6), (1, 5, 3), (3, 5, 9)])
@torch.no_grad()
def test_a_model_decodes_as_the_rule_written_out_would(n_kv_head, budget, prompt_len):
    """Every step's logits over 3 x block_size tokens, the prompt prefilled in one chunk up to the budget (the rest
    one token at a time), and each row's, layer's and key/value head's tokens and counts at the end."""
    model = random_model(pos_emb="rope", n_kv_head=n_kv_head)
    c = model.config
    seq = random_tokens(2, 3 * c.block_size, seed=8)
    cache = new_merging_cache(model, 2, budget=budget)
    cached = cached_logits(model, seq, prompt_len, cache)
    reference, heads = merging_reference(model, seq[:, :-1], budget)
    assert_forward_close(cached, reference[:, prompt_len - 1:], model)
    assert {key: cache_state(cache, key[1], key[0], key[2]) for key in heads} == \
        {key: head.count for key, head in heads.items()}


def test_merging_tokens_whose_keys_are_equal_loses_nothing():
    """Three tokens with one key and different values, merged into one slot, weigh what they weigh apart: the
    output equals softmax attention over every token fed, written out."""
    model = random_model(pos_emb="rope", n_head=2, n_kv_head=1, n_embd=16)
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    keys[[2, 4]] = keys[0].clone()  # tokens 2 and 4 repeat token 0's key
    cache = new_merging_cache(model, 1, budget=4)
    for p in range(6):
        view = cache.begin(1).layer(0)
        if p >= 4:
            view.victim.fill_(2)  # token 2 leaves slot 2 for token 4, which leaves it for token 5
        k_read, v_read = view.update(keys[p].view(1, 1, 1, 8), values[p].view(1, 1, 1, 8))
        q = torch.randn(1, 2, 1, 8, generator=g)
        y = view.attend(q, k_read, v_read, None)
    assert cache_state(cache, 0, 0, 0) == {0: 3.0, 1: 1.0, 5: 1.0, 3: 1.0}  # token 0's slot holds 0, 2 and 4
    full = (q[0, :, 0] @ keys.T / math.sqrt(8)).softmax(dim=-1) @ values  # (2, 8): every token, none merged
    # equal in exact arithmetic. The cache: tokens 0, 1, 3 and 5, token 0's slot with the exact mean of values 0, 2
    # and 4 (its key is token 0's, unchanged: kept + share * 0), off by its two merges' roundings, and log 3
    v = values.double()
    first = (v[0] + v[2]) / 2
    merged_error = 4 * U * (v[0].abs() + v[2].abs()) * 2 / 3 + 4 * U * (first.abs() + v[4].abs())
    slots = [0, 1, 3, 5]
    kept = v[slots].clone()
    kept[0] = (v[0] + v[2] + v[4]) / 3
    dv = torch.zeros_like(kept)
    dv[0] = merged_error
    cache_bound = attention_bound(q[0, :, 0], keys[slots], kept, dv=dv, bias=torch.tensor([3.0, 1, 1, 1]).log())[0]
    assert_within(y[0, :, 0], full, cache_bound + attention_bound(q[0, :, 0], keys, values)[0])


@torch.no_grad()
def test_a_budget_that_holds_the_whole_context_is_the_full_cache():
    """block_size slots drop only what the full cache's ring drops, and merge nothing, also far past block_size."""
    model = random_model(pos_emb="rope", n_kv_head=1)
    block = model.config.block_size
    seq = random_tokens(2, 4 * block, seed=10)
    full = cached_logits(model, seq, 5, new_kv_cache(model, 2))
    assert_forward_close(cached_logits(model, seq, 5, new_cache(model, "merge", 2, budget=block)), full, model)
    prompt = seq[:, :4]
    assert torch.equal(generate(model, prompt, 3 * block, sampling=GREEDY,
                                cache=new_cache(model, "merge", 2, budget=block)),
                       generate(model, prompt, 3 * block, sampling=GREEDY))


def test_many_samples_of_one_prompt_decode_as_one_row_does():
    model = random_model(pos_emb="rope")
    prompt = random_tokens(1, 7, seed=11)
    alone = generate(model, prompt, 40, sampling=GREEDY, cache=new_merging_cache(model, 1, budget=6))
    shared = generate(model, prompt.expand(3, -1), 40, sampling=GREEDY, cache=new_merging_cache(model, 3, budget=6))
    assert torch.equal(shared, alone.expand(3, -1))


@pytest.mark.parametrize("overrides, budget, fragment", [
    (dict(), 6, "needs pos_emb=rope"),
    (dict(pos_emb="rope"), 1, "budget must be an integer from 2 to block_size=16, got 1"),
    (dict(pos_emb="rope"), 17, "got 17"),
])
def test_settings_that_cannot_work_are_refused(overrides, budget, fragment):
    with pytest.raises(ValueError, match=fragment):
        new_cache(random_model(**overrides), "merge", 1, budget=budget)
