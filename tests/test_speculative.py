"""Speculative decoding: greedy text equal to plain cached greedy decoding, sampled tokens with exactly the model's
distribution, caches rolled back to exactly what a fresh prefill gives, one model pass per round."""

import copy

import pytest
import torch

import model.serving.speculative as speculative
from model import GPT, GREEDY, Sampling, build_model, generate
from model.decoding.cached_text import CachedText
from model.gpt import POSITIONS
from model.serving.ngram_draft import NGramTable
from model.serving.speculative import PromptLookup, SpeculativeStats, speculative_generate
from tiny_models import BLOCK_SIZE, VOCAB, random_model, random_tokens, tiny_config
from tolerance import assert_forward_close
from model.caches.factory import new_kv_cache

PROMPT_LEN = 5
NEW_TOKENS = 3 * BLOCK_SIZE + 5  # inside block_size at first, then well past it


def perturbed(model: GPT, scale: float, seed: int = 1) -> GPT:
    """The model with noise on its weights: a draft that agrees with it on some tokens only."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return draft


def make_draft(kind: str, model: GPT, pos_emb: str):
    if kind == "same":
        return model
    if kind == "unrelated":  # another shape and the other position kind: a shorter block, so it refills or rolls
        other = POSITIONS[1 - POSITIONS.index(pos_emb)]
        return random_model(seed=7, pos_emb=other, block_size=BLOCK_SIZE // 2, n_layer=1)
    if kind == "perturbed":
        return perturbed(model, 0.03)
    if kind == "ngram":  # counts of the model's own text from another prompt: it agrees with the model at times
        text = generate(model, random_tokens(1, 1, seed=5), 500, sampling=Sampling(temperature=0.3),
                        generator=torch.Generator().manual_seed(5))
        return NGramTable(text, VOCAB, order=3, min_count=2)
    return PromptLookup()


def speculative_ids(model, prompt, n, **kwargs) -> list[int]:
    return torch.cat(list(speculative_generate(model, prompt, n, **kwargs))).tolist()


@pytest.mark.parametrize("pos_emb", POSITIONS)
@pytest.mark.parametrize("kind", ["same", "unrelated", "perturbed", "lookup", "ngram"])
def test_greedy_speculative_text_equals_plain_cached_greedy_text(pos_emb, kind):
    model = random_model(seed=0, pos_emb=pos_emb)
    prompt = random_tokens(1, PROMPT_LEN, seed=3)
    plain = generate(model, prompt, NEW_TOKENS, sampling=GREEDY)[0, PROMPT_LEN:].tolist()
    draft = make_draft(kind, model, pos_emb)
    for k in (1, 2, 4, 8):
        stats = SpeculativeStats()
        assert speculative_ids(model, prompt, NEW_TOKENS, draft=draft, k=k, stats=stats) == plain, f"k={k}"
        assert stats.new_tokens == NEW_TOKENS
        # each draft does what its name says
        if kind == "same":
            assert stats.acceptance_rate == 1.0 and stats.tokens_per_pass > 1 + k / 2
        elif kind == "unrelated":
            assert stats.acceptance_rate < 0.3
        elif kind == "perturbed":
            assert 0.2 < stats.acceptance_rate < 1.0
        elif kind == "ngram":  # better than a uniform guess, not always right
            assert 1 / VOCAB < stats.acceptance_rate < 1.0
        else:
            assert stats.drafted > 0 and stats.accepted > 0


@pytest.mark.parametrize("keep", [1, 5, BLOCK_SIZE])
def test_greedy_speculative_text_follows_any_keep_of_learned_positions(keep):
    model = random_model(seed=0)
    prompt = random_tokens(1, PROMPT_LEN, seed=3)
    plain = generate(model, prompt, NEW_TOKENS, sampling=GREEDY, keep=keep)[0, PROMPT_LEN:].tolist()
    for k in (1, 4):
        assert speculative_ids(model, prompt, NEW_TOKENS, draft=model, k=k, keep=keep) == plain


def test_a_prompt_longer_than_the_block_is_read_as_generate_reads_it():
    for pos_emb in POSITIONS:
        model = random_model(seed=0, pos_emb=pos_emb)
        prompt = random_tokens(1, 2 * BLOCK_SIZE + 3, seed=4)
        plain = generate(model, prompt, 20, sampling=GREEDY)[0, prompt.size(1):].tolist()
        assert speculative_ids(model, prompt, 20, draft=perturbed(model, 0.1), k=4) == plain


# --- sampling keeps the model's distribution -------------------------------------------------------------------

SMALL = dict(vocab_size=3, n_layer=1, n_head=2, n_embd=8)
SIGNIFICANCE = 1e-3  # a correct sampler fails this test with probability 0.001 (the seed is fixed: it never does)
N_SAMPLES = 400
MODEL_SEED, DRAFT_SEED, PROMPT = 24, 29, torch.tensor([[2]])  # a one-token prompt: no prefill, fast
LOOKUP_PROMPT = torch.tensor([[2, 0, 1, 2]])  # prompt lookup proposes the 0 that followed the earlier 2
# counts whose q after PROMPT (0.6, 0.3, 0.1 after a 2) and after each next token differ from the model's p
NGRAM_TEXT = [2, 0, 0, 2, 0, 1, 2, 0, 0, 2, 1, 0, 2, 0, 2, 2, 1, 1, 0, 2, 0, 2, 1, 0, 2, 0, 1, 2, 0, 0, 2]


def distribution_test_draft(kind: str):
    """(draft, prompt) for the distribution tests."""
    if kind == "model":
        return peaked_model(DRAFT_SEED), PROMPT
    if kind == "ngram":
        return NGramTable(NGRAM_TEXT, SMALL["vocab_size"], order=1, min_count=1), PROMPT
    return PromptLookup(), LOOKUP_PROMPT


def peaked_model(seed: int) -> GPT:
    """A one-layer model over 3 tokens, with weights large enough that its distributions differ from another
    seed's. MODEL_SEED and DRAFT_SEED were picked so that a rule that draws from p on a rejection is far from p
    (N_SAMPLES * sum (r - p)^2 / p = 98 for the first token's distribution r), while after PROMPT each of the 9
    two-token outcomes keeps a probability of at least 0.032 (13 expected in 400)."""
    torch.manual_seed(seed)
    model = build_model(tiny_config(**SMALL))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    return model.eval()


@torch.no_grad()
def exact_joint(model: GPT, prompt: torch.Tensor, n: int, sampling: Sampling) -> torch.Tensor:
    """P(first n tokens) for every sequence of n tokens, (vocab^n,), from full forwards over prompt + sequence."""
    V, T = model.config.vocab_size, prompt.size(1)
    seqs = torch.cartesian_prod(*[torch.arange(V)] * n).view(-1, n)  # (V^n, n), last token fastest
    logits = model(torch.cat([prompt.expand(len(seqs), -1), seqs], dim=1))[0][:, T - 1:T - 1 + n]
    probs = sampling.probs(logits.reshape(-1, V)).view(len(seqs), n, V)
    return probs.gather(-1, seqs[..., None]).squeeze(-1).prod(dim=-1)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probs, pooling the cells expected fewer than 5 times."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].sum(dim=0, keepdim=True).double()])
    expected = torch.cat([expected[~small], expected[small].sum(dim=0, keepdim=True)])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), statistic / 2))


def sampled_counts(model, draft, prompt, n, k, sampling) -> torch.Tensor:
    V = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(V ** n, dtype=torch.long)
    for _ in range(N_SAMPLES):
        ids = speculative_ids(model, prompt, n, draft=draft, k=k, sampling=sampling, generator=generator)
        counts[sum(t * V ** (n - 1 - i) for i, t in enumerate(ids))] += 1
    return counts


@pytest.mark.parametrize("draft_kind, sampling", [
    ("model", Sampling(temperature=1.0)),
    ("model", Sampling(temperature=0.7, top_k=2, top_p=0.9)),  # each filter drops a token of p and of q
    ("lookup", Sampling(temperature=1.0)),
    ("ngram", Sampling(temperature=1.0)),
    ("ngram", Sampling(temperature=0.7, top_k=2, top_p=0.9)),
], ids=["model", "model-filtered", "lookup", "ngram", "ngram-filtered"])
def test_speculative_sampling_keeps_the_model_distribution(draft_kind, sampling):
    model = peaked_model(MODEL_SEED)
    draft, prompt = distribution_test_draft(draft_kind)
    p_value = chi_square_p_value(sampled_counts(model, draft, prompt, 2, 1, sampling),
                                 exact_joint(model, prompt, 2, sampling))
    assert p_value > SIGNIFICANCE


@pytest.mark.parametrize("draft_kind", ["model", "ngram"])
def test_three_tokens_from_two_drafts_per_pass_keep_the_model_distribution(draft_kind):
    model, sampling = peaked_model(MODEL_SEED), Sampling(temperature=1.0)
    draft, prompt = distribution_test_draft(draft_kind)
    counts = sampled_counts(model, draft, prompt, 3, 2, sampling)
    assert chi_square_p_value(counts, exact_joint(model, prompt, 3, sampling)) > SIGNIFICANCE


def draw_from_p_on_rejection(logits, proposals, q, sampling, generator, verify=speculative.verify):
    """A wrong rule: on a rejection, draw from the model's p rather than from max(p - q, 0)."""
    kept, token = verify(logits, proposals, q, sampling, generator)
    if kept < len(proposals):
        token = int(torch.multinomial(sampling.probs(logits[kept:kept + 1])[0], 1, generator=generator))
    return kept, token


@pytest.mark.parametrize("wrong_rule", ["always_accept", "p_on_rejection"])
def test_the_distribution_test_fails_for_a_wrong_acceptance_rule(wrong_rule, monkeypatch):
    """The test above has the power to see a wrong rule, with the same samples and significance level."""
    if wrong_rule == "always_accept":
        monkeypatch.setattr(speculative, "acceptance_probability", lambda p, q: torch.tensor(1.0))
    else:
        monkeypatch.setattr(speculative, "verify", draw_from_p_on_rejection)
    model, prompt, sampling = peaked_model(MODEL_SEED), PROMPT, Sampling(temperature=1.0)
    counts = sampled_counts(model, peaked_model(DRAFT_SEED), prompt, 2, 1, sampling)
    assert chi_square_p_value(counts, exact_joint(model, prompt, 2, sampling)) < SIGNIFICANCE


# --- the caches after every verification, and one model pass per round -------------------------------------------

def fresh_cache(model: GPT, tokens: list[int], start: int):
    """The cache a fresh prefill of tokens[start:] gives: one chunk up to the ring's size, then a token at a time,
    as generate reads a long prompt. Returns (cache, where token i is: its slot)."""
    cache = new_kv_cache(model, 1)
    ids = torch.tensor([tokens[start:]])
    first = min(ids.size(1), cache.max_len)
    model.decode_step(ids[:, :first], cache)
    for i in range(first, ids.size(1)):
        model.decode_step(ids[:, i:i + 1], cache)
    return cache, lambda i: (i - start) % cache.max_len


def assert_holds_a_fresh_prefill(text: CachedText, accepted: list[int], model: GPT) -> None:
    """Every slot that the next token fed can see holds what a fresh prefill of the accepted text by `model` (the
    text's, or a copy) gives."""
    fed, start = text.fed, text.start
    assert fed < len(accepted) and text.tokens[:fed] == accepted[:fed]
    reference, slot_of = fresh_cache(model, accepted[:fed], start)
    cache = text.cache
    for i in range(max(start, fed - cache.reach + 1), fed):
        mine, theirs = (i - start) % cache.max_len, slot_of(i)
        for layer, (k, v) in enumerate(zip(cache.k, cache.v, strict=True)):
            # written by passes of other lengths: two float32 forwards up to this layer
            assert_forward_close(k[:, :, mine], reference.k[layer][:, :, theirs], model, f"key of token {i}")
            assert_forward_close(v[:, :, mine], reference.v[layer][:, :, theirs], model, f"value of token {i}")


@pytest.mark.parametrize("pos_emb", POSITIONS)
@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=1.0)], ids=["greedy", "sampled"])
def test_after_every_verification_both_caches_hold_a_fresh_prefill_and_one_pass_was_made(pos_emb, sampling,
                                                                                       monkeypatch):
    model = random_model(seed=0, pos_emb=pos_emb)
    draft, twin = perturbed(model, 0.03), copy.deepcopy(model)  # the twin makes the reference caches, unhooked
    texts = []  # the model's CachedText and the draft's, as speculative_generate makes them
    make = CachedText.__init__
    monkeypatch.setattr(CachedText, "__init__", lambda self, *a, **kw: (make(self, *a, **kw), texts.append(self))[0])
    passes = []
    model.blocks[0].register_forward_hook(lambda module, args, out: passes.append(args[0].size(1)))
    prompt = random_tokens(1, PROMPT_LEN, seed=3)
    k, stats = 4, SpeculativeStats()
    accepted = prompt[0].tolist()
    passes_per_round, starts = [], []
    steps = speculative_generate(model, prompt, NEW_TOKENS, draft=draft, k=k, sampling=sampling,
                                 generator=torch.Generator().manual_seed(0), stats=stats)
    for next_id in steps:
        accepted.append(int(next_id))
        target, draft_text = sorted(texts, key=lambda t: t.model is draft)
        if passes:  # the first token of a round: the passes since the last round's tokens
            passes_per_round.append(len(passes))
            starts.append(target.start)
            passes.clear()
        assert target.tokens[:len(accepted)] == accepted
        if len(target.tokens) > len(accepted):  # the round's other tokens are still to come
            continue
        assert target.fed == len(accepted) - 1  # all but the newest
        assert_holds_a_fresh_prefill(target, accepted, twin)
        assert_holds_a_fresh_prefill(draft_text, accepted, draft)
    assert stats.passes == len(passes_per_round) and 0 < stats.accepted < stats.drafted
    assert stats.new_tokens == NEW_TOKENS == len(accepted) - PROMPT_LEN
    # one pass per round; the first also reads the prompt, and a learned-position model's rounds whose context
    # jumped forward first refill it (where generate refills too)
    jumps = [now != before for before, now in zip(starts, starts[1:])]
    assert passes_per_round == [2] + [2 if jump else 1 for jump in jumps]
    assert any(jumps) == (pos_emb == "learned")


def test_a_draft_equal_to_the_model_needs_one_pass_per_k_plus_1_tokens():
    model = random_model(seed=0, pos_emb="rope")
    draft = copy.deepcopy(model)
    calls = []
    model.blocks[0].register_forward_hook(lambda *_: calls.append(1))
    n, k = 45, 4
    speculative_ids(model, random_tokens(1, PROMPT_LEN), n, draft=draft, k=k)
    assert len(calls) == 1 + n // (k + 1)  # the prompt, then k + 1 tokens per pass


# --- the ring's rollback, and arguments that cannot work ---------------------------------------------------------

def test_a_wrapped_ring_refuses_to_roll_back_past_what_it_still_holds():
    model = random_model(seed=0, pos_emb="rope")
    cache = new_kv_cache(model, 1, max_len=BLOCK_SIZE + 2)
    model.decode_step(random_tokens(1, BLOCK_SIZE + 2), cache)
    cache.rollback(3)  # not yet wrapped: anything goes
    model.decode_step(random_tokens(1, 3), cache)
    model.decode_step(random_tokens(1, 3), cache)  # wrapped
    cache.rollback(3)  # max_len - window + 1: the oldest key overwritten was out of view
    model.decode_step(random_tokens(1, 3), cache)
    with pytest.raises(ValueError, match="cannot roll back 4 tokens of a ring of 18 slots that has wrapped"):
        cache.rollback(4)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(k=0), "k, the tokens drafted per model pass, must be an integer >= 1, got 0"),
    (dict(k=True), "got True"),
    (dict(k=2.0), "got 2.0"),
    (dict(draft=random_model(seed=1, vocab_size=VOCAB + 1)), "draft has a vocabulary of 14 tokens, the model 13"),
    (dict(draft="lookup"), "draft must be a GPT with the model's vocabulary, an NGramTable or PromptLookup(), got str"),
    (dict(draft=NGramTable([0, 1], VOCAB + 1)), "draft counts 14 tokens, the model has 13"),
    (dict(draft=random_model(seed=1).train()), "draft is in training mode"),
    (dict(idx=random_tokens(2, 4)), "speculative decoding decodes one row: idx has 2 rows"),
    (dict(idx=torch.tensor([[VOCAB]])), "outside the vocabulary"),
    (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
])
def test_arguments_that_cannot_work_are_value_errors_naming_them(kwargs, fragment):
    model = random_model(seed=0)
    args = {**dict(idx=random_tokens(1, 4), max_new_tokens=5, draft=PromptLookup(), k=2), **kwargs}
    idx, n = args.pop("idx"), args.pop("max_new_tokens")
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        next(speculative_generate(model, idx, n, **args))


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    lookup = PromptLookup(max_ngram=2)
    assert lookup.propose([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == ([4, 5, 1], None)  # the latest "1 2"
    assert lookup.propose([7, 1, 2, 8, 3, 2], 2) == ([8, 3], None)  # no earlier "3 2": the latest "2"
    assert lookup.propose([1, 2, 3], 4) == ([], None)  # nothing repeats
    assert lookup.propose([5, 1, 2, 1, 2], 5) == ([1, 2, 1, 2, 1], None)  # a repeat two tokens long goes on
    with pytest.raises(ValueError, match="max_ngram must be an integer >= 1"):
        PromptLookup(max_ngram=0)


# --- long texts: the work a pass does does not grow with the whole text ------------------------------------------

def lookup_by_definition(tokens: list[int], k: int, max_ngram: int) -> list[int]:
    """PromptLookup's rule, scanning the text: the tokens after the latest earlier occurrence of its last n tokens
    (n from max_ngram down to 1) that ends before its last token, the copy running on into itself."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == tokens[-n:]:
                proposals = tokens[end:end + k]
                while len(proposals) < k:
                    proposals.append(proposals[len(proposals) - (len(tokens) - end)])
                return proposals
    return []


@pytest.mark.parametrize("max_ngram", [1, 3])
def test_prompt_lookup_proposes_by_its_definition_as_the_text_grows_is_cut_back_and_changes(max_ngram):
    """The lookup reads a text once, extending its index as the text grows; a text cut back or replaced is indexed
    afresh. Every proposal equals the rule applied to the whole text."""
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, 4, (30,), generator=g).tolist()
    lookup = PromptLookup(max_ngram)
    for step in range(60):
        k = 1 + step % 4
        assert lookup.propose(text, k) == ([t for t in lookup_by_definition(text, k, max_ngram)], None), step
        if step % 7 == 6:
            text = text[:len(text) - 5]  # rejected drafts
        elif step % 13 == 12:
            text = torch.randint(0, 4, (10,), generator=g).tolist()  # another text
        else:
            text = text + torch.randint(0, 4, (2,), generator=g).tolist()


def tokens_fed(monkeypatch) -> list[int]:
    """Count the tokens every forward pass of any GPT feeds, by row."""
    fed, trunk = [], GPT._trunk

    def counting(self, idx, *args, **kwargs):
        fed.append(idx.size(1))
        return trunk(self, idx, *args, **kwargs)

    monkeypatch.setattr(GPT, "_trunk", counting)
    return fed


@pytest.mark.parametrize("draft", ["lookup", "model"])
def test_a_rotary_model_continues_a_long_prompt_from_the_tokens_that_can_still_matter(monkeypatch, draft):
    """Past n_layer * (block_size - 1) + 1 tokens, nothing earlier changes the next token: speculative decoding
    feeds no more of a long prompt than generate does, and gives generate's text."""
    model = random_model(pos_emb="rope")
    span = model.config.n_layer * (model.config.block_size - 1) + 1
    prompt = random_tokens(1, 40 * span, seed=3)
    expected = generate(model, prompt, 12, sampling=GREEDY)[0, prompt.size(1):].tolist()
    fed = tokens_fed(monkeypatch)
    proposer = PromptLookup() if draft == "lookup" else random_model(seed=1, pos_emb="rope")
    made = [int(t) for t in speculative_generate(model, prompt, 12, draft=proposer, k=3)]
    assert made == expected
    assert sum(fed) <= (2 if draft == "model" else 1) * (span + 12 * 4), sum(fed)  # not 40 spans


def test_a_conversation_with_a_rotary_model_reads_a_long_line_from_the_tokens_that_can_still_matter(monkeypatch):
    from model.serving.conversation import Conversation
    model = random_model(pos_emb="rope")
    span = model.config.n_layer * (model.config.block_size - 1) + 1
    line = random_tokens(1, 30 * span, seed=4)[0].tolist()
    expected = generate(model, torch.tensor([line]), 8, sampling=GREEDY)[0, len(line):].tolist()
    fed = tokens_fed(monkeypatch)
    assert list(Conversation(model).reply(line, 8)) == expected
    assert sum(fed) <= span + 8, sum(fed)


# --- the n-gram draft -------------------------------------------------------------------------------------------

def followers_written_out(text: list[int], context: list[int], vocab: int, order: int, min_count: int):
    """The n-gram draft's q by its definition: what followed the longest ending of context (at most order tokens)
    that occurred at least min_count times in text, counted and normalised."""
    for n in range(min(order, len(context)), -1, -1):
        ending = context[len(context) - n:]
        followers = [text[i + n] for i in range(len(text) - n) if text[i:i + n] == ending]
        if n == 0 or len(followers) >= min_count:
            return torch.bincount(torch.tensor(followers), minlength=vocab).float() / len(followers)


@pytest.mark.parametrize("order, min_count", [(0, 1), (2, 1), (3, 2), (4, 3)])
def test_the_ngram_draft_gives_the_counts_that_followed_the_longest_ending_seen_often_enough(order, min_count):
    vocab = 4
    text = torch.randint(0, vocab, (300,), generator=torch.Generator().manual_seed(order)).tolist()
    table = NGramTable(text, vocab, order=order, min_count=min_count)
    contexts = [[], [1], text[:7], text[100:110], [3, 3, 3, 3, 3], [0, 1, 2, 3, 0, 1]]
    for context in contexts:
        torch.testing.assert_close(table.distribution(context),
                                   followers_written_out(text, context, vocab, order, min_count),
                                   msg=f"context {context}")


@pytest.mark.parametrize("order", [1, 3])
def test_the_ngram_draft_draws_each_proposal_from_q_after_its_text_met_before_or_new(order):
    """Round after round, on a text whose contexts recur: each proposal's q is the definition's after the text and
    the proposals before it, whether the draft has looked that context up before or not."""
    from model.serving.ngram_draft import NGramDraft
    vocab, min_count, g = 4, 2, torch.Generator().manual_seed(1)
    text = torch.randint(0, vocab, (300,), generator=g).tolist()
    draft = NGramDraft(NGramTable(text, vocab, order=order, min_count=min_count), Sampling(temperature=1.0), g,
                       "cpu")
    tokens = text[:5]
    for _ in range(40):
        proposals, q = draft.propose(tokens, 3)
        for i, row in enumerate(q):
            torch.testing.assert_close(row, followers_written_out(text, tokens + proposals[:i], vocab, order,
                                                                  min_count), msg=f"after {tokens + proposals[:i]}")
        tokens = tokens + proposals[:1] + [int(torch.randint(0, vocab, (), generator=g))]  # one kept, one the model's


def test_the_ngram_draft_proposes_its_likeliest_tokens_when_greedy_and_draws_from_q_when_sampling():
    from model.serving.ngram_draft import NGramDraft
    table = NGramTable([0, 1, 2] * 10, 3, order=2)
    assert NGramDraft(table, GREEDY, None, "cpu").propose([2, 0], 4) == ([1, 2, 0, 1], None)
    proposals, q = NGramDraft(table, Sampling(temperature=1.0), torch.Generator().manual_seed(0),
                              "cpu").propose([2, 0], 2)
    assert proposals == [1, 2]  # the text never varies: q is a point mass
    torch.testing.assert_close(q, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))
