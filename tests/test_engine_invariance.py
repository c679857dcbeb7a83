"""Every pass of the engine is batch-invariant, prefill included: under a random schedule (shared prefixes, a pool
small enough to preempt, chunked prefill, cancellations, sampled requests beside greedy ones) each greedy request's
logits, at every prompt position and every draw, are those it gets alone on an empty engine, to the bit. For every
design the engine serves, float and int8 pools, fp32, bf16 and int8 weights; and every product of a pass is one
that RowsAlone computes a row at a time (model/serving/rowwise.py)."""

import random

import pytest
import torch
import torch.nn.functional as F

from model import GREEDY, Sampling
from model.decoding.quantize import to_precision
from model.serving.engine import Engine
from model.serving.request import Kept
from model.serving.rowwise import RowsAlone, RowsRoute, UnroutedProduct
from torch.utils._python_dispatch import TorchDispatchMode
from tiny_models import VOCAB, random_model

BLOCK = 32  # block_size: a shared prefix, a request's own prompt and its draws
# n_embd 32: int8 weights take the packed kernel, whose rows must be multiples of 16 wide
DESIGNS = {"plain": dict(), "rope-mqa": dict(pos_emb="rope", n_kv_head=1), "shared": dict(kv_share=2),
           "latent": dict(kv_latent=8), "latent-absorbed": dict(pos_emb="rope", kv_latent=8, kv_latent_rope=4,
                                                                 bias=False),
           "sink": dict(learned_sink=True, n_kv_head=1)}


def served_model(design: str, precision: str):
    return to_precision(random_model(block_size=BLOCK, n_embd=32, n_head=2, **DESIGNS[design]), precision)


def arrivals(seed: int, n: int) -> list[tuple]:
    """n requests: (name, prompt, new tokens, sampling or None for greedy), most after one of three prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(5, 14))] for _ in range(3)]
    out = []
    for i in range(n):
        own = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
        prompt = (rng.choice(prefixes) if rng.random() < 0.7 else []) + own
        sampling = Sampling(temperature=0.8) if rng.random() < 0.3 else None
        out.append((i, prompt, rng.randrange(1, min(10, BLOCK - len(prompt)) + 1), sampling))
    return out


def alone(model, prompt, new, int8: bool) -> Kept:
    """The request alone on an empty engine: its logits at every prompt position and draw."""
    engine = Engine(model, n_blocks=BLOCK, block_tokens=4, int8=int8)
    kept = Kept(draws=True, prompt=True)
    engine.add(0, prompt, new, kept=kept)
    list(engine.run())
    return kept


def busy(model, schedule, int8: bool, seed: int) -> tuple[dict, Engine]:
    """The requests under a random schedule: arriving between steps, some cancelled, each greedy one scored at
    every position every other time (a scored prompt is computed whole; the rest read cached blocks)."""
    rng = random.Random(seed)
    engine = Engine(model, n_blocks=11, block_tokens=4, max_batch=6, chunk=5, int8=int8)  # 8 hold a context
    kept, requests, pending = {}, {}, list(schedule)
    while pending or engine.waiting or engine.running:
        while pending and (rng.random() < 0.5 or not (engine.waiting or engine.running)):
            name, prompt, new, sampling = pending.pop(0)
            kept[name] = Kept(draws=True, prompt=sampling is None and name % 2 == 0)
            requests[name] = engine.add(name, prompt, new, sampling=sampling, kept=kept[name],
                                        generator=torch.Generator().manual_seed(name) if sampling else None)
        if rng.random() < 0.04 and (engine.running or engine.waiting):
            victim = rng.choice(engine.running + list(engine.waiting))
            engine.cancel(victim)
            del kept[victim.name]
        if engine.waiting or engine.running:
            engine.step()
    return kept, engine


@pytest.mark.parametrize("int8_pool", [False, True], ids=["float-pool", "int8-pool"])
@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("design", DESIGNS)
@torch.no_grad()
def test_each_greedy_request_gets_the_logits_it_gets_alone_to_the_bit(design, precision, int8_pool):
    model = served_model(design, precision)
    schedule = arrivals(seed=len(design), n=16)
    kept, engine = busy(model, schedule, int8_pool, seed=1)
    assert engine.stats.preemptions and engine.stats.reused_tokens  # the schedule preempted and read cached blocks
    checked = 0
    for name, prompt, new, sampling in schedule:
        if sampling is None and name in kept:
            reference = alone(model, prompt, new, int8_pool)
            assert torch.equal(torch.stack(kept[name].logits), torch.stack(reference.logits)), name
            if kept[name].prompt:
                assert torch.equal(torch.cat(kept[name].prompt_logits), torch.cat(reference.prompt_logits)), name
            checked += 1
    assert checked >= 5


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("design", DESIGNS)
@torch.no_grad()
def test_every_product_of_a_pass_is_computed_a_row_at_a_time(design, precision):
    """A pass of many rows gives each row the bits of that row's pass alone; RowsAlone raises on any product it
    does not route, so a pass that called one would fail here."""
    model = served_model(design, precision)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [7, 6, 5], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2]]
    together = Engine(model, n_blocks=BLOCK, block_tokens=4, chunk=BLOCK)
    kept = [Kept(prompt=True) for _ in prompts]
    for i, prompt in enumerate(prompts):
        together.add(i, prompt, 0, kept=kept[i])
    list(together.run())
    for prompt, mine in zip(prompts, kept):
        assert torch.equal(torch.cat(mine.prompt_logits), torch.cat(alone(model, prompt, 0, False).prompt_logits))


class Products(TorchDispatchMode):
    """Records each matrix product that reaches torch's kernels: its name and the rows of its first operand."""

    BATCHED = {"bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math"}
    ROWS = {"mm", "addmm", "mv", "addmv", "dot", "vdot", "_weight_int8pack_mm"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in self.BATCHED | self.ROWS:
            self.seen.append((name, 1 if name in self.BATCHED else args[1 if name.startswith("add") else 0].size(0)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("design", DESIGNS)
@torch.no_grad()
def test_no_kernel_of_a_pass_multiplies_two_rows_in_one_matrix(design, precision):
    """Whatever a product's kernel does with its rows, RowsAlone hands it one row at a time: every matrix product
    that reaches a kernel during a pass of many rows is batched (a matrix per row) or has a single row."""
    model = served_model(design, precision)
    engine = Engine(model, n_blocks=BLOCK, block_tokens=4, chunk=BLOCK)
    for i, prompt in enumerate([[1, 2, 3, 4, 5, 6, 7], [7, 6, 5]]):
        engine.add(i, prompt, 2)
    with Products() as products:
        list(engine.run())
    assert products.seen and all(rows == 1 for _, rows in products.seen), sorted(set(products.seen))


def test_rows_alone_refuses_a_product_it_cannot_split_into_rows():
    x, w = torch.randn(3, 8), torch.randn(8, 4)
    rows = torch.cat([torch.einsum("ij,jk->ik", x[i:i + 1], w) for i in range(3)])  # each row its own matrix
    with RowsAlone():
        for product in (lambda: x @ w, lambda: torch.mm(x, w), lambda: x.matmul(w), lambda: torch.addmm(w[0], x, w),
                        lambda: torch.einsum("ij,ik->jk", x, x), lambda: x[:, None] @ w):
            with pytest.raises(UnroutedProduct):
                product()
        routed, batched = torch.einsum("ij,jk->ik", x, w), x[:, None] @ w[None]
    assert torch.equal(routed, rows) and torch.equal(batched[:, 0], rows)


@pytest.mark.parametrize("design, precision, int8, mode_free", [
    ("plain", "fp32", False, True), ("rope-mqa", "bf16", False, True), ("latent", "fp32", False, True),  # nn.Linear
    ("plain", "fp32", True, False),  # an int8 pool attends by matmuls
    ("latent-absorbed", "fp32", False, False), ("sink", "fp32", False, False),  # einsums; a sink's own attention
    ("plain", "int8", False, False)])  # the int8 weights' packed kernel
@torch.no_grad()
def test_later_passes_run_with_no_mode_only_when_the_first_routed_nothing_but_the_linears(design, precision, int8,
                                                                                          mode_free):
    """After its first pass the engine drops RowsAlone's mode when that pass's products were all its nn.Linear
    modules', and keeps it otherwise. The texts and logits are the same either way (the tests above)."""
    engine = Engine(served_model(design, precision), n_blocks=BLOCK, block_tokens=4, int8=int8)
    engine.add(0, [1, 2, 3], 3)
    list(engine.run())
    assert engine.route.mode_free is mode_free


@torch.no_grad()
def test_a_linear_called_outside_its_module_keeps_the_mode():
    """F.linear on a module's weight, called without the module, is no swap's to catch: the route keeps the mode,
    and the rows stay apart."""
    class Direct(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.lin(x) + F.linear(x, self.lin.weight)

    model, x = Direct(), torch.randn(5, 8)
    route = RowsRoute(model)
    for _ in range(2):
        with route.alone(), Products() as products:
            model(x)
        assert not route.mode_free and all(rows == 1 for _, rows in products.seen)
    with RowsAlone():
        under_mode = model.lin(x)
    through_module = RowsRoute(model.lin)
    for _ in range(2):  # the first pass under the mode, the second with no mode
        with through_module.alone(), Products() as products:
            y = model.lin(x)
        assert all(rows == 1 for _, rows in products.seen) and torch.equal(y, under_mode)
    assert through_module.mode_free
