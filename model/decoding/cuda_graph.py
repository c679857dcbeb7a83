"""What capturing adds to the one-token step on a GPU: the step's kernels recorded once as a CUDA graph, then
replayed at every step with one launch. A small model's step launches a hundred small kernels; launching them,
not running them, is what an eager step waits for.

A graph replays fixed memory: the token it reads, the cache it writes and the logits it gives live where they
were when it was captured. So a CapturedStep owns its input and its output, and serves the one cache it was
captured over (its `cache`). That cache reads every slot through its mask (model/caches/ring.py), and its
positions and mask come from its own counter on the device, so nothing in the step reads back to the host
(tests/test_capture_ready.py proves that on the CPU). Resetting, refilling or rolling back the cache writes the
same tensors, so the graph goes on serving it.

    cache = new_kv_cache(model, batch_size)                     # on the GPU
    step = CapturedStep(model, cache)
    ids = generate(model, prompt, 500, cache=cache, step=step)  # every one-token step replays the graph

CapturedStep(model, text_cache(model, k), tokens=k + 1) records a graph for each pass of 1 to k + 1 tokens:
speculative decoding's verification, whose drafts may be shorter than k (model/serving/speculative.py).
"""

import torch


def record(run, inputs: list[torch.Tensor], writes: list[torch.Tensor], pool=None, warm_ups: int = 2):
    """run(*inputs) recorded as a CUDA graph: (graph, its output). The graph reads `inputs` where they are and
    writes `writes` in place; warming up runs it for real, so `writes` are put back as they were before capture.
    pool: a memory pool shared with other graphs, whose outputs the next replay of any of them overwrites."""
    saved = [t.clone() for t in writes]
    side = torch.cuda.Stream()  # warm-ups on a side stream, as capture asks: allocations, library handles
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(warm_ups):
            run(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    for mine, before in zip(writes, saved):
        mine.copy_(before)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, pool=pool):  # recorded, not run: `writes` stay as they are
        output = run(*inputs)
    return graph, output


class CapturedStep:
    """model(idx, cache=cache) for passes of 1 to `tokens` tokens per row through `cache`, each length captured as
    a CUDA graph: a Step (step.py). A call returns the graph's own logits tensor, which the next replay overwrites:
    read it first."""

    def __init__(self, model, cache, tokens: int = 1):
        if cache.device.type != "cuda":
            raise ValueError(f"a CUDA graph records a step on a CUDA device, and the cache is on {cache.device.type}")
        if not cache.abilities.compiles:
            raise ValueError(f"a {type(cache).__name__} decodes eagerly: its step cannot be captured")
        self.cache, self.tokens = cache, tokens
        pool = torch.cuda.graph_pool_handle()  # one pool: only one graph's logits are read at a time
        self.graphs = {}  # tokens per row -> (graph, its input idx (B, t), its logits (B, t, vocab_size))
        for t in range(1, tokens + 1):
            idx = torch.zeros(cache.batch_size, t, dtype=torch.long, device=cache.device)
            graph, logits = record(lambda idx: model(idx, cache=cache)[0], [idx], list(cache.buffers()), pool)
            self.graphs[t] = graph, idx, logits

    def fits(self, cache, tokens: int = 1) -> bool:
        """Whether this step serves passes of `tokens` tokens per row through `cache`: its own cache only."""
        return cache is self.cache and self.takes(tokens)

    def takes(self, tokens: int) -> bool:
        return 1 <= tokens <= self.tokens

    def __call__(self, idx, cache):
        """idx (B, t), t from 1 to tokens -> logits (B, t, vocab_size), as model(idx, cache=cache)[0] gives them."""
        graph, graph_idx, logits = self.graphs[idx.size(1)]
        graph_idx.copy_(idx)
        graph.replay()
        return logits

    def decode_step(self, idx, cache):
        """The last position's logits (B, vocab_size), as GPT.decode_step gives them."""
        return self(idx, cache)[:, -1]

    def greedy_steps(self, idx, cache, n: int):
        """n greedy one-token steps from idx (B, 1) -> the tokens drawn (B, n), each fed back as the next input."""
        drawn = [idx]
        for _ in range(n):
            drawn.append(self.decode_step(drawn[-1], cache).argmax(-1, keepdim=True))
        return torch.cat(drawn[1:], dim=1)
