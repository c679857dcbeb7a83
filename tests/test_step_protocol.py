"""The Step protocol (model/protocol.py): what the compiled step, the captured step and the model's own
decode_step each do, and every parameter that takes a step typed with it."""

import ast
import inspect
import textwrap
import typing

import pytest

from model import GPT
from model.decoding.aot_step import AotStep
from model.decoding.cached_text import CachedText
from model.decoding.cuda_graph import CapturedStep
from model.decoding.generate import check_arguments, generate, generate_tokens, prefill
from model.protocol import DecodeStep, Step
from model.serving.conversation import Conversation
from model.serving.speculative import ModelDraft, speculative_generate
from sampling.modes import decoded_on
from sampling.setup import kept_or_compiled_step

METHODS = ("__call__", "decode_step", "greedy_steps", "fits", "takes")


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def attributes(cls) -> set[str]:
    """The names a class sets: at class level, and on self in __init__."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = set(vars(cls))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return names


@pytest.mark.parametrize("cls", [AotStep, CapturedStep])
def test_the_compiled_and_the_captured_step_each_do_what_step_names(cls):
    for name in METHODS:
        assert parameters(getattr(cls, name)) == parameters(getattr(Step, name)), (cls.__name__, name)
    assert {"cache", "tokens"} <= attributes(cls)


def test_the_models_own_decode_step_is_what_a_steps_decode_step_is():
    assert parameters(GPT.decode_step) == parameters(Step.decode_step)
    assert typing.get_type_hints(prefill)["step"] == DecodeStep | None


@pytest.mark.parametrize("function, name", [
    (generate, "step"), (generate_tokens, "step"), (check_arguments, "step"),
    (speculative_generate, "verify_pass"), (speculative_generate, "draft_step"), (ModelDraft.__init__, "step"),
    (Conversation.decode_through, "step"), (decoded_on, "step"), (kept_or_compiled_step, "return"),
], ids=lambda x: getattr(x, "__qualname__", x))
def test_every_parameter_that_takes_a_step_is_typed_with_step(function, name):
    assert typing.get_type_hints(function)[name] in (Step, Step | None)


def test_a_cached_texts_step_is_typed_with_step():
    init = ast.parse(textwrap.dedent(inspect.getsource(CachedText.__init__)))
    typed = {ast.unparse(node.target): ast.unparse(node.annotation) for node in ast.walk(init)
             if isinstance(node, ast.AnnAssign)}
    assert typed["self.compiled"] == "Step | None"
