"""The engine's compiled pass (model/serving/compiled_rows.py): built once for a model's weights and a pool's shape,
it gives every request the logits of the eager pass up to float32's rounding, and keeps the engine batch-invariant
to the bit: a request's logits are those it gets alone, whatever runs beside it. An engine takes the code only
where check_invariance finds it so; serve.py takes it as --compile asks."""

import pytest
import torch

from model.serving.compiled_rows import CompiledRows, check_invariance
from model.serving.engine import Engine
from model.serving.request import Kept
from runtime.errors import UsageError
from runtime.compiled import engine_pass_path, has_engine_pass, load_or_compile_engine_pass
from server import options
from test_engine_invariance import arrivals
from test_serve_options import args
from tiny_models import random_model
from tolerance import assert_forward_close

SHAPE = dict(n_blocks=11, block_tokens=4, max_batch=6, chunk=5)  # 8 blocks hold a context: the busy engine preempts


def new_engine(model, compiled: CompiledRows | None) -> Engine:
    """An engine of SHAPE's pool, through the compiled pass (over its own pool) or eagerly (None)."""
    engine = Engine(model, **SHAPE)
    if compiled is not None:
        engine.passes = CompiledRows(compiled.runner, engine.pool)
    return engine


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A rotary model of one key/value head (block_size 32), and its engine's compiled pass, kept in a folder of
    its own."""
    folder = tmp_path_factory.mktemp("steps")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVGPT_CACHE_DIR", str(folder))
        model = random_model(block_size=32, n_embd=32, n_head=2, pos_emb="rope", n_kv_head=1)
        yield model, load_or_compile_engine_pass(Engine(model, **SHAPE)), folder


def run(engine: Engine, requests, kept: dict, scored=lambda name: True) -> None:
    """The requests (name, prompt, new tokens, _) added at once, and run; kept: each one's logits, of its prompt
    too where scored(name) (a scored prompt is computed whole, reading no cached block)."""
    for name, prompt, new, _ in requests:
        kept[name] = Kept(draws=True, prompt=scored(name))
        engine.add(name, prompt, new, kept=kept[name])
    list(engine.run())


@torch.no_grad()
def test_each_request_gets_the_logits_it_gets_alone_to_the_bit(compiled):
    """16 greedy requests, most after one of three prefixes, together on an engine that preempts and reads cached
    blocks; then each alone on an empty one."""
    model, passes, _ = compiled
    requests = [(name, prompt, new, None) for name, prompt, new, _ in arrivals(seed=3, n=16)]
    together, kept = new_engine(model, passes), {}
    run(together, requests, kept, scored=lambda name: name % 2 == 0)
    assert together.stats.preemptions and together.stats.reused_tokens
    for request in requests:
        mine, name = {}, request[0]
        run(new_engine(model, passes), [request], mine)
        assert torch.equal(torch.stack(kept[name].logits), torch.stack(mine[name].logits)), name
        if kept[name].prompt:
            assert torch.equal(torch.cat(kept[name].prompt_logits), torch.cat(mine[name].prompt_logits)), name


@torch.no_grad()
def test_the_compiled_pass_gives_the_eager_pass_logits_up_to_float32_rounding(compiled):
    """Every prompt position of 16 requests, scored together through each pass."""
    model, passes, _ = compiled
    requests = [(name, prompt, 0, None) for name, prompt, _, _ in arrivals(seed=4, n=16)]
    kept = {way: {} for way in ("compiled", "eager")}
    run(new_engine(model, passes), requests, kept["compiled"])
    run(new_engine(model, None), requests, kept["eager"])
    for name, *_ in requests:
        assert_forward_close(torch.cat(kept["compiled"][name].prompt_logits),
                             torch.cat(kept["eager"][name].prompt_logits), model, f"request {name}")


class CountedRows(CompiledRows):
    """A pass whose logits move by a rounding's worth with the count of rows it holds: rows that are not
    batch-invariant."""

    def run(self, ids, table, fed):
        logits = super().run(ids, table, fed)
        return logits * (1 + ids.size(0) * torch.finfo(torch.float32).eps)


@torch.no_grad()
def test_check_invariance_finds_rows_that_depend_on_the_count(compiled):
    model, passes, _ = compiled
    engine = new_engine(model, None)
    assert check_invariance(CompiledRows(passes.runner, engine.pool), engine.rows, model.config.vocab_size) is None
    counted = CountedRows(passes.runner, engine.pool)
    assert check_invariance(counted, engine.rows, model.config.vocab_size) == (
        "the first 1 rows' logits differ when 6 rows run together")


def test_the_pass_is_kept_for_these_weights_and_loaded_again_without_compiling(compiled, monkeypatch):
    model, _, folder = compiled
    monkeypatch.setenv("KVGPT_CACHE_DIR", str(folder))
    engine = Engine(model, **SHAPE)
    assert has_engine_pass(engine)
    monkeypatch.setattr("runtime.compiled.compile_package", lambda *a: pytest.fail("compiled again"))
    assert isinstance(load_or_compile_engine_pass(engine, say=pytest.fail), CompiledRows)
    other = random_model(seed=5, block_size=32, n_embd=32, n_head=2, pos_emb="rope", n_kv_head=1)
    assert engine_pass_path(Engine(other, **SHAPE)) != engine_pass_path(engine)
    assert not has_engine_pass(Engine(model, **{**SHAPE, "n_blocks": 12}))


@pytest.mark.parametrize("given", [{"precision": "bf16"}, {"kv_cache": "int8"}])
def test_serve_refuses_compile_where_its_pass_cannot_apply_and_by_default_serves_eagerly_there(given):
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in given.items()]
    parsed = options.build_parser().parse_args(["--compile", *flags])
    with pytest.raises(UsageError, match="^--compile builds the engine's pass for fp32 weights and a float pool, "
                                         "not --precision"):
        options.check_options(parsed)
    options.check_options(args(**given))  # without --compile, served
    engine = Engine(random_model(), n_blocks=4, block_tokens=4, int8=given.get("kv_cache") == "int8")
    options.compile_passes(args(**given), engine, threads=torch.get_num_threads())
    assert engine.passes is None


def test_serve_takes_the_kept_pass_by_default_and_none_with_no_compile(compiled, monkeypatch):
    model, _, folder = compiled
    monkeypatch.setenv("KVGPT_CACHE_DIR", str(folder))
    monkeypatch.setattr("runtime.compiled.compile_package", lambda *a: pytest.fail("compiled again"))
    for flags, expected in (([], CompiledRows), (["--compile"], CompiledRows), (["--no-compile"], type(None))):
        engine = Engine(model, **SHAPE)
        options.compile_passes(options.build_parser().parse_args(flags), engine, threads=torch.get_num_threads())
        assert type(engine.passes) is expected, flags
