"""Latent attention (kv_latent), local layers (window_pattern, local_window) and a learned sink, where they differ
from the other designs: the sink against torch's SDPA given the sink as one more key, the latent cache's size, the
plain cache, speculative decoding's rollbacks and the absorbed decoding of latents against recomputation, and
settings that cannot work. test_kv_designs.py runs each through every other cache path against a forward written
out from the weights."""

import copy

import pytest
import torch
import torch.nn.functional as F

from model import GREEDY, CausalSelfAttention, KVCache, generate, greedy_decode, kv_cache_bytes
from model.measuring.attention_weights import keeping_weights
from model.designs.latent import LatentAttention
from model.designs.learned_sink import sink_attention
from model.serving.speculative import PromptLookup, SpeculativeStats, speculative_generate
from test_kv_designs import DESIGNS, SHAPE, design_model, prefill, recorded_logits, reference_logits
from tiny_models import BLOCK_SIZE, random_model, random_tokens
from tolerance import assert_forward_close, assert_within, attention_bound
from model.caches.factory import new_kv_cache
from model.caches.ring import cache_shape

WINDOWED = [name for name, fields in DESIGNS.items() if "local_window" in fields]
HEAD_DIM = SHAPE["n_embd"] // SHAPE["n_head"]


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_sink_attention_equals_sdpa_with_the_sink_as_a_zero_value_key(n_kv_head):
    """A sink logit s is a key whose score is s and whose value is 0: SDPA over the keys and one such extra key,
    its score set through a float mask, gives the same output; rows that see no key get 0 (only the sink)."""
    torch.manual_seed(0)
    B, nh, T_q, T_k, hs = 2, 4, 3, 7, 6
    q, k, v = torch.randn(B, nh, T_q, hs), torch.randn(B, n_kv_head, T_k, hs), torch.randn(B, n_kv_head, T_k, hs)
    sink = torch.tensor([-2.0, 0.0, 1.0, 3.0])
    mask = torch.rand(B, 1, T_q, T_k) > 0.3
    mask[1, :, 0] = False  # a query that sees no key
    y, weights = sink_attention(q, k, v, mask, sink)
    zero = torch.zeros(B, n_kv_head, 1, hs)
    k_sink, v_sink = torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2)  # q · 0 = 0, plus the sink as a bias
    bias = torch.cat([torch.zeros(B, nh, T_q, T_k).masked_fill(~mask, float("-inf")),
                      sink.view(1, nh, 1, 1).expand(B, nh, T_q, 1)], dim=-1)
    expected = F.scaled_dot_product_attention(q, k_sink, v_sink, attn_mask=bias, enable_gqa=n_kv_head < nh)
    assert_within(y, expected, 2 * attention_bound(q, k, v, mask, sink=sink)[0])  # two float32 evaluations
    assert torch.equal(y[1, :, 0], torch.zeros(nh, hs))
    assert (weights.sum(-1) < 1).all()  # the sink takes its share of every row


def test_the_new_designs_do_change_the_model():
    """A local layer and a sink each change the logits of a model with the same other weights."""
    seq = random_tokens(2, BLOCK_SIZE)
    plain = random_model(**SHAPE)
    for design in ("local", "sink"):
        model = design_model(design, "learned")
        model.load_state_dict({**model.state_dict(), **plain.state_dict()}, strict=False)
        assert (model(seq)[0] - plain(seq)[0]).abs().max() > 1e-2, design


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("design", WINDOWED)
def test_the_plain_cache_of_greedy_decode_serves_local_layers_by_their_band(design, pos_emb):
    """greedy_decode's plain KVCache holds block_size slots in order for every layer: a local layer reads only its
    band of them. Every step's logits equal the written-out forward's, and greedy_decode follows their argmax."""
    model = design_model(design, pos_emb)
    seq = random_tokens(2, BLOCK_SIZE, seed=1)
    cache = KVCache(**cache_shape(model, 2))
    logits = [model.decode_step(seq[:, :4], cache)] + [model.decode_step(seq[:, t:t + 1], cache)
                                                       for t in range(4, BLOCK_SIZE)]
    assert_forward_close(torch.stack(logits, dim=1), reference_logits(model, seq)[:, 3:], model)
    greedy = greedy_decode(model, seq[:, :4], BLOCK_SIZE - 4)
    assert torch.equal(greedy[:, 4:], reference_logits(model, greedy)[:, 3:-1].argmax(-1))


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("design", ["local-sink-gqa", "local-mqa-share2", "mla-local-sink"])
def test_speculative_rollbacks_of_local_rings_keep_greedy_text_equal_to_generate(design, pos_emb):
    """A draft proposes, the model verifies k + 1 tokens at once and rolls both caches back past the rejected ones:
    the local layers' short rings (local_window + k slots) roll back exactly, so the text is generate's."""
    model = design_model(design, pos_emb)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    prompt = random_tokens(1, 9, seed=3)
    n = 3 * BLOCK_SIZE + 5
    plain = generate(model, prompt, n, sampling=GREEDY)[0, 9:].tolist()
    for k in (1, 3, 6):
        stats = SpeculativeStats()
        ids = torch.cat(list(speculative_generate(model, prompt, n, draft=draft, k=k, stats=stats))).tolist()
        assert ids == plain, f"k={k}"
        assert 0 < stats.accepted < stats.drafted  # some rounds rolled back


@pytest.mark.parametrize("overrides, fragment", [
    (dict(window_pattern="LXG", local_window=3), "window_pattern must be letters L (local) and G (global)"),
    (dict(window_pattern="", local_window=3), "window_pattern must be letters"),
    (dict(window_pattern="LG"), "local_window must be an integer in [1, block_size - 1 = 15], got None"),
    (dict(window_pattern="LG", local_window=16), "got 16"),
    (dict(window_pattern="LG", local_window=True), "got True"),
    (dict(local_window=4), "local_window applies to local layers, and window_pattern 'G' has none"),
    (dict(window_pattern="L", local_window=4), "makes every layer local: give at least one G"),
    (dict(window_pattern="LG", local_window=4, kv_share=2), "kv_share 2 groups layers that window_pattern 'LG' "
                                                            "makes local and global"),
    (dict(learned_sink=1), "learned_sink must be true or false, got 1"),
    (dict(kv_latent=0), "kv_latent must be an integer of at least 1, got 0"),
    (dict(kv_latent_rope=4), "kv_latent_rope applies to multi-head latent attention: give kv_latent"),
    (dict(kv_latent=8, kv_latent_rope=4), "kv_latent_rope is the width of a rotary key, and pos_emb is learned"),
    (dict(kv_latent=8, pos_emb="rope"), "needs kv_latent_rope, the width of its rotary key: an even integer of at "
                                        "least 2, got 0"),
    (dict(kv_latent=8, pos_emb="rope", kv_latent_rope=3), "got 3"),
    (dict(kv_latent=7), "kv_latent \\+ kv_latent_rope = 7 must be even"),
    (dict(kv_latent=8, n_kv_head=2), "kv_latent replaces the key/value heads: it does not combine with n_kv_head"),
    (dict(kv_latent=8, kv_share=2), "it does not combine with n_kv_head or kv_share"),
])
def test_latent_window_and_sink_settings_that_cannot_work_are_refused(overrides, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        random_model(**SHAPE, **overrides)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_a_latent_cache_holds_the_latent_and_the_rotary_key_and_nothing_else(pos_emb, dtype):
    """Per token and layer: kv_latent values, and kv_latent_rope more with rotary positions, whatever n_head is
    (int8: a byte each, and a float32 scale for each of the two halves). A latent of 2 * head_dim holds what
    multi-query attention's one key and one value hold."""
    rope = dict(kv_latent_rope=4) if pos_emb == "rope" else {}
    model = random_model(**SHAPE, kv_latent=2 * HEAD_DIM, pos_emb=pos_emb, **rope)
    cache = new_kv_cache(model, 3, dtype=dtype)
    width = 2 * HEAD_DIM + (4 if pos_emb == "rope" else 0)
    per_token = width * dtype.itemsize + (2 * 4 if dtype == torch.int8 else 0)
    assert cache.nbytes == 3 * BLOCK_SIZE * SHAPE["n_layer"] * per_token == 3 * kv_cache_bytes(model.config, dtype)
    mqa = random_model(**SHAPE, n_kv_head=1, pos_emb=pos_emb)
    if pos_emb == "learned":
        assert cache.nbytes == new_kv_cache(mqa, 3, dtype=dtype).nbytes


def test_a_cache_made_without_local_rings_is_refused_for_a_model_with_local_layers():
    model = design_model("local", "rope")
    plain = random_model(**SHAPE, pos_emb="rope")
    with pytest.raises(ValueError, match="another model shape .* local window None"):
        generate(model, random_tokens(1, 3), 2, cache=new_kv_cache(plain, 1))


def test_a_prompt_longer_than_the_local_window_is_fed_in_chunks_the_rings_take():
    """decode_step refuses a chunk that a local ring cannot hold, naming the figures; generate feeds such a prompt
    in chunks, and its logits are those of a full forward."""
    model = design_model("local", "learned")
    prompt = random_tokens(2, 12, seed=4)
    with pytest.raises(ValueError, match="a chunk of 12 tokens must fit in the cache before it first wraps \\(5 slots"):
        model.decode_step(prompt, new_kv_cache(model, 2))
    out = generate(model, prompt, 3, sampling=GREEDY)
    assert torch.equal(out, generate(model, prompt, 3, sampling=GREEDY, use_cache=False))
    assert torch.equal(out[:, 12], model(prompt)[0][:, -1].argmax(-1))
    same = prompt[:1].expand(3, -1)  # read once at batch 1, then copied to every row
    assert torch.equal(generate(model, same, 3, sampling=GREEDY), out[:1].expand(3, -1))


class CountingStep:
    """A stand-in for a compiled one-token step (aot_step.AotStep's decode_step, greedy_steps and fits): the eager
    step, counted."""

    cache = None  # it serves any cache, not one of its own
    tokens = 1

    def __init__(self, model):
        self.decode, self.passes = model.decode_step, 0

    def fits(self, cache):
        return True

    def decode_step(self, idx, cache):
        assert idx.size(1) == 1
        self.passes += 1
        return self.decode(idx, cache)

    def greedy_steps(self, idx, cache, n):
        drawn = [idx]
        for _ in range(n):
            drawn.append(self.decode_step(drawn[-1], cache).argmax(-1, keepdim=True))
        return torch.cat(drawn[1:], dim=1)


def test_past_block_size_a_refill_that_local_rings_take_a_token_at_a_time_goes_through_the_step(monkeypatch):
    """Learned positions refill the cache past block_size; a local ring, once full, takes one token a pass. Those
    passes go through the one-token step given (the compiled one in sample.py), not the eager model: only the
    refills' first chunks run eagerly. The text is the eager one."""
    model = design_model("local", "learned")
    prompt, new = random_tokens(1, 4, seed=11), 3 * BLOCK_SIZE
    eager = []
    decode = model.decode_step
    monkeypatch.setattr(model, "decode_step", lambda idx, cache: eager.append(idx.size(1)) or decode(idx, cache))
    step = CountingStep(model)
    step.decode = decode
    text = generate(model, prompt, new, sampling=GREEDY, cache=new_kv_cache(model, 1), step=step)
    assert torch.equal(text, generate(model, prompt, new, sampling=GREEDY, use_cache=False))
    assert 1 not in eager and step.passes > new  # the refills' one-token passes too
    assert len(eager) >= 3  # the prompt and at least two refills, each one chunk


class CountingPass(CountingStep):
    """A stand-in for a compiled pass of up to `tokens` tokens (aot_step.AotStep's call, takes and fits)."""

    def __init__(self, model, tokens: int):
        super().__init__(model)
        self.model, self.tokens = model, tokens

    def fits(self, cache, tokens: int = 1):
        return self.takes(tokens)

    def takes(self, tokens: int) -> bool:
        return 1 <= tokens <= self.tokens

    def __call__(self, idx, cache):
        self.passes += 1
        return self.model(idx, cache=cache)[0]

    def decode_step(self, idx, cache):
        return self(idx, cache)[:, -1]


@pytest.mark.parametrize("prompt_len", [5, 9])
def test_a_prompt_of_at_most_the_steps_tokens_goes_through_the_step(monkeypatch, prompt_len):
    """generate feeds a prompt that fits one pass of the step given (the compiled step in sample.py takes up to
    block_size tokens) through the step, and a longer one eagerly; greedy text is the eager one."""
    model = random_model(seed=3)
    prompt, new = random_tokens(1, prompt_len, seed=13), BLOCK_SIZE // 2
    eager = []
    decode = model.decode_step
    monkeypatch.setattr(model, "decode_step", lambda idx, cache: eager.append(idx.size(1)) or decode(idx, cache))
    step = CountingPass(model, 8)
    text = generate(model, prompt, new, sampling=GREEDY, cache=new_kv_cache(model, 1), step=step)
    assert torch.equal(text, generate(model, prompt, new, sampling=GREEDY, use_cache=False))
    assert eager == ([] if prompt_len <= step.tokens else [prompt_len])
    assert step.passes == new - 1 + (prompt_len <= step.tokens)


def test_speculative_refills_that_local_rings_take_in_short_passes_go_through_the_compiled_pass(monkeypatch):
    """Speculative decoding's text (model/decoding/cached_text.py) refills learned positions as generate does. A local
    ring with room for k + 1 more tokens than its window then takes k + 1 a pass: those passes go through the
    compiled pass given, and greedy text is plain greedy text."""
    model = design_model("local-sink-gqa", "learned")  # a window of 3: a refill of 7 tokens takes several passes
    prompt, new, k = random_tokens(1, 4, seed=12), 3 * BLOCK_SIZE, 1
    eager = []
    decode = model.decode_step
    monkeypatch.setattr(model, "decode_step", lambda idx, cache: eager.append(idx.size(1)) or decode(idx, cache))
    verify = CountingPass(model, k + 1)
    verify.decode = decode
    tokens = speculative_generate(model, prompt, new, draft=PromptLookup(), k=k, verify_pass=verify)
    assert torch.equal(torch.cat([prompt[0], *tokens]), generate(model, prompt, new, sampling=GREEDY,
                                                                 use_cache=False)[0])
    assert eager and all(n > k + 1 for n in eager) and verify.passes  # what the pass takes, it ran


def test_attention_maps_of_a_sink_model_keep_the_logits_and_leave_the_sink_its_share():
    """TensorBoard's attention maps (model/measuring/attention_weights.py) swap in an explicit attention: with a sink it
    must be the sink's, giving the forward's own logits and rows that sum to less than 1."""
    model = design_model("local-sink-gqa", "rope")
    seq = random_tokens(2, BLOCK_SIZE, seed=2)
    with keeping_weights(model) as weights:
        logits = model(seq)[0]
    assert_forward_close(logits, model(seq)[0], model)
    assert len(weights) == SHAPE["n_layer"] and all((w.sum(-1) < 1).all() for w in weights)


@pytest.mark.parametrize("read_all_slots", [False, True], ids=["filled slots", "all slots, masked"])
def test_a_padded_one_row_cache_copied_to_every_row_keeps_its_local_rings_padding(read_all_slots):
    """fill_from copies both rings and what each knows of the rows' padding: every row then decodes as the padded
    row would, past block_size."""
    model = design_model("local-sink-gqa", "rope")
    prompt = random_tokens(1, 3, seed=6)  # two of padding, still in the local rings of 3 slots
    one = new_kv_cache(model, 1, read_all_slots=read_all_slots)
    one.reset(torch.tensor([2]))
    prefill(model, prompt, one)
    three = new_kv_cache(model, 3, read_all_slots=read_all_slots)
    three.fill_from(one)
    seq = torch.cat([prompt, random_tokens(1, 2 * BLOCK_SIZE, seed=7)], dim=1)
    steps = torch.stack([model.decode_step(seq[:, t:t + 1].expand(3, 1), three) for t in range(3, seq.size(1))], 1)
    reference = reference_logits(model, seq, torch.tensor([2]))[:, 3:]
    assert_forward_close(steps, reference.expand(3, -1, -1), model)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("design", ["mla", "mla-local-sink"])
def test_decoding_with_absorbed_up_projections_equals_the_naive_expansion(design, pos_emb, monkeypatch):
    """Decoding reads the cached latents through the queries and the output (the absorbed form); the naive form
    projects every cached latent up to keys and values. Both give the same logits at every step, past block_size."""
    model = design_model(design, pos_emb)
    assert all(block.attn.up.bias is None for block in model.blocks)  # the absorbed form's condition
    prompt, n_pad = random_tokens(2, 7, seed=8), [0, 3]
    absorbed = torch.stack(recorded_logits(model, monkeypatch, idx=prompt, max_new_tokens=2 * BLOCK_SIZE,
                                           sampling=GREEDY, n_pad=n_pad)[1])
    monkeypatch.setattr(LatentAttention, "forward", CausalSelfAttention.forward)  # the naive expansion throughout
    naive = torch.stack(recorded_logits(model, monkeypatch, idx=prompt, max_new_tokens=2 * BLOCK_SIZE,
                                        sampling=GREEDY, n_pad=n_pad)[1])
    assert_forward_close(absorbed, naive, model)


def test_latent_attention_with_biases_decodes_by_the_naive_expansion():
    """A bias in the up-projection adds q · b to every score, which the absorbed form leaves out: with biases,
    decoding expands the latents, and its logits are the written-out forward's."""
    model = random_model(**SHAPE, kv_latent=8, pos_emb="rope", kv_latent_rope=4, learned_sink=True)
    with torch.no_grad():  # biases that matter (they start at 0), and sinks that make q · b matter too
        for block in model.blocks:
            block.attn.up.bias.normal_(0.0, 0.5)
            block.attn.sink.normal_(0.0, 2.0)
    seq = random_tokens(2, BLOCK_SIZE, seed=9)
    cache = new_kv_cache(model, 2)
    steps = [model.decode_step(seq[:, t:t + 1], cache) for t in range(BLOCK_SIZE)]
    assert_forward_close(torch.stack(steps, 1), reference_logits(model, seq), model)


def test_a_compiled_step_of_the_new_designs_equals_the_eager_one_past_block_size(monkeypatch):
    """torch.compile runs the one-token step of latent attention, local layers and a sink through both rings, every
    slot read through its mask: the logits of every step equal the eager step's, with ragged rows, past block_size.
    (test_kv_designs.py compiles them over the int8 cache too.)"""
    model = design_model("mla-local-sink", "rope")
    prompt, n_pad = random_tokens(2, 7, seed=10), [0, 3]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    kwargs = dict(idx=prompt, max_new_tokens=2 * BLOCK_SIZE, sampling=GREEDY, n_pad=n_pad)
    compiled = torch.stack(recorded_logits(model, monkeypatch, compile=True, **kwargs)[1])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the step did go through the compiler
    eager = torch.stack(recorded_logits(model, monkeypatch, **kwargs)[1])
    assert_forward_close(compiled, eager, model)
