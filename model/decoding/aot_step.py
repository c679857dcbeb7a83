"""What compiling ahead of time adds to the one-token step: a cached pass of the model traced once by torch.export
and built into C++ by AOTInductor, so that a step runs with no Python between its operations.

torch.compile (generate's compile=True) checks its guards and runs a Python wrapper at every call. For a model
this small that costs about what its arithmetic does (docs/benchmarks.md). Here the step is exported with the
cache's tensors as inputs, which the compiled step updates in place, as the eager step does. Attention is
written as products and sums (attention_in_loops), which inductor fuses into the step's own loops. It reads the
cache's filled slots only, counted inside the step, so a cache not yet full costs what it holds, not max_len.

A shared step reads the model's weights where they are (user-managed constants): it serves every model of its
shape and precision, and it sees a later load_state_dict. A packed step (AotStep's packed=True) was compiled
with the weights frozen in and laid out for the CPU's matrix kernels (runtime/compiled.py: BUILDS): the
fastest, for that model's weights alone.

    program = export_step(model, cache)
    package = torch._inductor.aoti_compile_and_package(program)   # sampling/compiled_step.py keeps it on disk
    step = AotStep({1: load_package(package)}, model, cache)
    ids = generate(model, prompt, 500, cache=cache, step=step)     # one-token steps through the compiled step

export_step(model, cache, tokens=k) compiles a pass of 1 to k tokens per row instead, the count an input of the
compiled code: a prompt's chunks, and speculative decoding's verification (model/serving/speculative.py), whose
drafts may be fewer. An AotStep of up to k tokens holds that pass beside the one-token pass, which decodes.
"""

import warnings
from contextlib import contextmanager

import torch
import torch.nn as nn


def cache_tensors(cache) -> list[tuple[str, torch.Tensor]]:
    """The cache's state, (name, tensor) in a fixed order: what the compiled step takes after the tokens."""
    return list(cache.named_buffers())


def swap_buffers(module: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Put tensors in place of module's buffers of those (dotted) names; return the buffers they replaced."""
    replaced = {}
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        buffers = module.get_submodule(owner)._buffers
        replaced[name], buffers[leaf] = buffers[leaf], tensor
    return replaced


class CacheAsInputs(nn.Module):
    """model(idx, cache=cache)'s logits, with each row's likeliest next token written into picked (B, 1) and the
    cache's tensors passed in, so that export traces them as inputs the step updates in place, not as constants
    it may fold. The pass reads the cache's filled slots only (RingKVCache.read_filled)."""

    def __init__(self, model, cache):
        super().__init__()
        self.model = model
        self.cache = [cache]  # in a list: not a submodule, so that its buffers are no constants of the step
        self.names = [name for name, _ in cache_tensors(cache)]

    def forward(self, idx, picked, *tensors):
        cache = self.cache[0]
        own = swap_buffers(cache, dict(zip(self.names, tensors)))
        cache.read_filled(True)
        try:
            logits = self.model(idx, cache=cache)[0]  # (B, T, vocab_size)
            picked.copy_(logits[:, -1].argmax(-1, keepdim=True))  # greedy decoding's next tokens, picked in the step
            return logits
        finally:
            cache.read_filled(False)
            swap_buffers(cache, own)


def check_step_cache(cache) -> None:
    if not cache.abilities.compiles:
        raise ValueError(f"a {type(cache).__name__} decodes eagerly: its steps cannot be compiled")


@torch.no_grad()
def export_step(model, cache, tokens: int = 1) -> torch.export.ExportedProgram:
    """A cached pass of 1 to `tokens` tokens per row for caches shaped like `cache`, traced by torch.export."""
    if model.training:
        raise ValueError("model is in training mode: call model.eval() before exporting its decoding step")
    check_step_cache(cache)
    idx = torch.zeros(cache.batch_size, tokens, dtype=torch.long, device=cache.device)
    picked = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=cache.device)
    tensors = tuple(t for _, t in cache_tensors(cache))
    count = {1: torch.export.Dim("tokens", min=1, max=tokens)} if tokens > 1 else None  # an input, not a constant
    with quiet_tracing():
        program = torch.export.export(CacheAsInputs(model, cache), (idx, picked, *tensors),
                                      dynamic_shapes=(count, None, (None,) * len(tensors)))
        return program.run_decompositions({torch.ops.aten.scaled_dot_product_attention.default: attention_in_loops})


def attention_in_loops(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention written as products and sums, which inductor fuses into the step's own loops:
    for the few queries of a step, SDPA's kernel costs more to set up than its arithmetic does. As in SDPA's own
    kernel, the softmax divides once per output, after the sum over keys, not once per key. q (..., T_q, hs),
    k and v (..., T_k, hs) -> (..., T_q, hs)."""
    if dropout_p:
        raise ValueError("a compiled step decodes: it applies no dropout")
    if enable_gqa and k.size(-3) != q.size(-3):  # each key/value head serves its group of query heads
        k, v = (t.repeat_interleave(q.size(-3) // t.size(-3), dim=-3) for t in (k, v))
    scores = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) * (q.size(-1) ** -0.5 if scale is None else scale)
    if is_causal:  # SDPA's rule: aligned top-left
        attn_mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -torch.inf) if attn_mask.dtype == torch.bool else scores + attn_mask
    # unnormalized; a query that may attend nothing has every score -inf, so its weights and total are NaN
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))  # (..., T_q, T_k)
    total = weights.sum(-1, keepdim=True)
    out = (weights.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)
    return torch.where(total > 0, out / total, 0.0)  # such a query reads zeros, as in SDPA


@contextmanager
def quiet_tracing():
    """Hide the FutureWarning that torch's own export and compile code raises about an API it deprecates."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        yield


def load_package(package) -> torch._C._aoti.AOTIModelPackageLoader:
    """A compiled package's code (package: a path), loaded by the loader that torch._inductor.aoti_load_package
    builds, without importing torch's compiler first: that import alone costs about a second of start-up."""
    return torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)


def step_signature(cache) -> list[tuple[str, tuple, torch.dtype]]:
    """What a cache must match to go through a compiled step: each tensor's name, shape and dtype."""
    return [(name, tuple(t.shape), t.dtype) for name, t in cache_tensors(cache)]


class AotStep:
    """Loaded compiled passes, bound to the model's weights, that keep the Step protocol (step.py): step(idx, cache)
    is model(idx, cache=cache)[0] for idx (B, 1 to tokens) and a cache shaped like the one they were exported with;
    step.decode_step is model.decode_step. runners: the most tokens each pass takes -> its compiled code. Code built
    for one token alone runs faster than code built for a range of counts (docs/benchmarks.md), so a step of more
    tokens holds both: the one-token pass decodes, the other takes the longer passes (prefill, verification)."""

    cache = None  # the one cache a step serves; None: any cache shaped like the one it was exported with

    def __init__(self, runners: dict[int, torch._C._aoti.AOTIModelPackageLoader], model, cache,
                 packed: bool = False):
        self.runners, self.model, self.signature = runners, model, step_signature(cache)
        self.tokens = max(runners)
        # the last cache stepped through, its tensors in the step's order, and where its first tensor is held
        self.read = (None, [], {}, None)
        if packed:  # the weights were frozen into the step when it was compiled: it reads none of the model's
            return
        weights = {f"model.{name}": t for name, t in [*model.named_parameters(remove_duplicate=False),
                                                      *model.named_buffers(remove_duplicate=False)]}
        for runner in runners.values():
            names = runner.get_constant_fqns()
            missing = [name for name in names if name not in weights]
            if missing:
                raise ValueError(f"the compiled step reads {', '.join(missing[:3])}, which this model lacks: it was "
                                 f"compiled for another model")
            # user-managed: the step reads the model's own tensors, never a copy of them. The arguments after the
            # tensors: use_inductor_constants, check_full_update, user_managed, allow_h2d_copy.
            runner.load_constants({name: weights[name] for name in names}, False, True, True, False)

    def fits(self, cache, tokens: int = 1) -> bool:
        """Whether this step takes passes of `tokens` tokens per row through `cache`."""
        return self.takes(tokens) and step_signature(cache) == self.signature

    def takes(self, tokens: int) -> bool:
        """Whether this step takes passes of `tokens` tokens per row through the caches it fits."""
        return 1 <= tokens <= self.tokens

    def __call__(self, idx, cache):
        """idx (B, T), T from 1 to tokens -> logits (B, T, vocab_size): the step's own tensor, which its next pass
        overwrites (its buffers are kept between passes): read it first."""
        runner = self.runners.get(idx.size(1), self.runners[self.tokens])
        # contiguous: the step was built for rows of tokens side by side, not slices of longer sequences
        return runner.boxed_run([idx.contiguous(), idx.new_empty(idx.size(0), 1), *self.tensors(cache)])[0]

    def tensors(self, cache) -> list[torch.Tensor]:
        """The cache's tensors in the order the step takes them, listed once per cache: caches write them in place.
        A cache moved or converted (Module.to) holds new tensors, its first one among them, and is listed again."""
        last, tensors, buffers, first = self.read
        if cache is not last or buffers.get(first) is not tensors[0]:
            owner, _, first = self.signature[0][0].rpartition(".")
            self.read = cache, [t for _, t in cache_tensors(cache)], cache.get_submodule(owner)._buffers, first
        return self.read[1]

    def decode_step(self, idx, cache):
        """The last position's logits (B, vocab_size), as GPT.decode_step gives them."""
        return self(idx, cache)[:, -1]

    def greedy_steps(self, idx, cache, n: int):
        """n greedy one-token steps from idx (B, 1) -> the tokens drawn (B, n). Each step writes each row's likeliest
        token into drawn's next row, which the step after it reads: between two steps runs only this loop."""
        drawn = idx.new_empty(n + 1, idx.size(0), 1)
        drawn[0] = idx
        run, tensors, rows = self.runners[1].boxed_run, self.tensors(cache), drawn.unbind(0)
        for i in range(n):
            run([rows[i], rows[i + 1], *tensors])
        return drawn[1:, :, 0].t()
