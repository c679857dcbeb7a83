"""The cache protocol (model/protocol.py: Cache): a cache written here from the protocol alone, keeping each layer's
keys and values in a Python list, decodes through generate and gives the text of full recomputation."""

import pytest
import torch

from model import GREEDY, Abilities, CachePass, Sampling, generate
from model.caches.factory import CACHES
from model.caches.ring import CacheShape
from model.decoding.aot_step import AotStep
from model.decoding.cached_text import CachedText
from tiny_models import BLOCK_SIZE, random_model, random_tokens


class ListView:
    """One layer of a ListCache during one pass."""

    def __init__(self, cache: "ListCache", i: int):
        self.cache, self.i = cache, i

    def update(self, k_new, v_new):
        keys, values = self.cache.layers.setdefault(self.i, ([], []))
        keys.append(k_new)
        values.append(v_new)
        return self.read()

    def read(self):
        keys, values = self.cache.layers[self.i]
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)


class ListCache:
    """Keys and values in lists of (B, n_kv, t, hs) chunks, one list per layer; it keeps every token it is fed."""

    abilities = Abilities(rolls_back=False, takes_padding=False, compiles=False)

    def __init__(self, batch_size: int):
        self.batch_size, self.layers, self.fed = batch_size, {}, 0

    def begin(self, t: int) -> CachePass:
        positions = torch.arange(self.fed, self.fed + t)
        self.fed += t
        return CachePass(positions, None, lambda i: ListView(self, i))  # mask None: the new tokens come last

    def reset(self, n_pad=None) -> None:
        self.layers, self.fed = {}, 0

    def longest_chunk(self) -> int:
        return BLOCK_SIZE

    def rollback(self, n: int) -> None:
        raise ValueError("a ListCache cannot roll back")

    def one_row(self) -> "ListCache":
        return ListCache(1)

    def fill_from(self, other: "ListCache") -> None:
        self.fed = other.fed
        self.layers = {i: tuple([t.expand(self.batch_size, -1, -1, -1) for t in kv] for kv in pair)
                       for i, pair in other.layers.items()}


@pytest.mark.parametrize("rows", ["one row", "three rows of one prompt", "three prompts"])
@pytest.mark.parametrize("design", [{}, dict(n_kv_head=1), dict(kv_share=2, n_layer=4)], ids=["mha", "mqa", "shared"])
def test_a_cache_written_from_the_protocol_alone_decodes_as_full_recomputation(rows, design):
    """Learned positions, past block_size: generate refills the toy cache as it refills the ring."""
    model = random_model(**design)
    prompt = random_tokens(1, 5).expand(3, -1) if rows == "three rows of one prompt" else \
        random_tokens(3 if rows == "three prompts" else 1, 5)
    new = 3 * BLOCK_SIZE
    cached = generate(model, prompt, new, sampling=GREEDY, cache=ListCache(prompt.size(0)))
    assert torch.equal(cached, generate(model, prompt, new, sampling=GREEDY, use_cache=False))


def test_a_rotary_model_decodes_through_it_within_block_size():
    """A rotary model's ring rolls past block_size; the toy keeps every token, so it serves one context."""
    model = random_model(pos_emb="rope")
    prompt, new = random_tokens(2, 4), BLOCK_SIZE - 4
    sampling = Sampling(temperature=0.9)
    cached = generate(model, prompt, new, sampling=sampling, generator=torch.Generator().manual_seed(1),
                      cache=ListCache(2))
    uncached = generate(model, prompt, new, sampling=sampling, generator=torch.Generator().manual_seed(1),
                        use_cache=False)
    assert torch.equal(cached, uncached)


def test_what_a_cache_can_do_is_read_from_its_record():
    """generate refuses compile and left padding for a cache whose record says it cannot take them, and the
    factory's names agree with their classes' records."""
    with pytest.raises(ValueError, match="decodes eagerly: drop compile"):
        generate(random_model(), random_tokens(1, 3), 2, cache=ListCache(1), compile=True)
    with pytest.raises(ValueError, match="cache holds 1 rows; this generation needs 2"):
        generate(random_model(), random_tokens(2, 3), 2, cache=ListCache(1))
    with pytest.raises(ValueError, match="n_pad: a ListCache takes no left padding"):
        generate(random_model(), random_tokens(2, 3), 2, cache=ListCache(2), n_pad=[0, 1])
    assert {name for name, (cls, _) in CACHES.items() if cls.abilities.budgeted} == {"window", "sinks", "h2o", "tova",
                                                                                      "merge"}
    assert {name for name, (cls, _) in CACHES.items() if cls.abilities.rolls_back} == {"float", "int8"}


class SlidingListCache(ListCache):
    """The toy, with a mask that shows each query its last BLOCK_SIZE keys: it slides, as the ring does."""

    abilities = Abilities(rolls_back=False, takes_padding=False, compiles=False, slides=True)

    def begin(self, t: int) -> CachePass:
        positions, _, layer = super().begin(t)
        keys = torch.arange(self.fed)
        mask = (keys <= positions[:, None]) & (keys > positions[:, None] - BLOCK_SIZE)  # (t, T_k)
        return CachePass(positions, mask[None, None], layer)


def test_a_rotary_model_decodes_past_block_size_through_a_cache_that_slides_and_is_refused_one_that_does_not():
    """generate cannot refill a rotary model's cache as the ring rolls: a cache that keeps every token serves one
    context of block_size + 1 tokens, and one token more is refused; a cache that slides decodes on."""
    model = random_model(pos_emb="rope")
    prompt = random_tokens(2, 4)
    within = BLOCK_SIZE + 1 - prompt.size(1)
    for cache, new in ((ListCache(2), within), (SlidingListCache(2), 3 * BLOCK_SIZE)):
        cached = generate(model, prompt, new, sampling=GREEDY, cache=cache)
        assert torch.equal(cached, generate(model, prompt, new, sampling=GREEDY, use_cache=False))
    with pytest.raises(ValueError, match=f"a ListCache does not slide .* ask for at most {within} new tokens"):
        generate(model, prompt, within + 1, sampling=GREEDY, cache=ListCache(2))


class BudgetListCache(ListCache):
    """The toy, saying that it keeps a budget of its own choosing."""

    abilities = Abilities(rolls_back=False, takes_padding=False, compiles=False, budgeted=True)


def test_what_a_cache_of_ones_own_cannot_take_is_a_value_error_naming_the_argument():
    """keep with a budget, a compiled step with a cache that decodes eagerly, a CachedText over a cache it was not
    made for: each a ValueError, never an AttributeError from inside."""
    model = random_model()
    with pytest.raises(ValueError, match="a BudgetListCache keeps its own tokens: drop keep"):
        generate(model, random_tokens(1, 3), 2, cache=BudgetListCache(1), keep=4)
    step = AotStep.__new__(AotStep)  # any step: the cache's abilities refuse it first
    with pytest.raises(ValueError, match="a ListCache decodes eagerly: drop step"):
        generate(model, random_tokens(1, 3), 2, cache=ListCache(1), step=step)
    with pytest.raises(ValueError, match="cache must be text_cache"):
        CachedText(model, cache=ListCache(1))


class ShapedListCache(ListCache):
    """The toy, saying its shape as the project's caches do."""

    def __init__(self, batch_size: int, shape: CacheShape):
        super().__init__(batch_size)
        self.shape = shape


def test_a_cache_that_says_its_shape_is_checked_against_the_model_whatever_its_class():
    """generate reads a cache's shape, never its class: the toy that says the model's shape decodes, and one that
    says another layer count, a local window, integer keys or too few slots is refused as the project's are."""
    model = random_model()
    c = model.config
    shape = CacheShape(c.n_kv_layer, *c.kv_cache_heads, c.block_size, None, c.block_size, torch.float32)
    prompt = random_tokens(1, 3)
    cached = generate(model, prompt, 4, sampling=GREEDY, cache=ShapedListCache(1, shape))
    assert torch.equal(cached, generate(model, prompt, 4, sampling=GREEDY, use_cache=False))
    for other, message in ((dict(n_kv_layer=c.n_kv_layer + 1), "another model shape"),
                           (dict(local_window=4), "local window 4"),
                           (dict(dtype=torch.int8), "cache holds torch.int8"),
                           (dict(max_len=c.block_size - 1), f"1 rows of {c.block_size - 1} tokens")):
        with pytest.raises(ValueError, match=message):
            generate(model, prompt, 4, cache=ShapedListCache(1, shape._replace(**other)))
