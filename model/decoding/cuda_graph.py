"""What capturing adds to the one-token step on a GPU: the step's kernels recorded once as a CUDA graph, then
replayed at every step with one launch. A small model's step launches a hundred small kernels; launching them,
not running them, is what an eager step waits for.

A graph replays fixed memory: the token it reads, the cache it writes and the logits it gives live where they
were when it was captured. So a CapturedStep owns its input and its output, and serves the one cache it was
captured over. That cache reads every slot through its mask (model/decoding/ring_cache.py), and its positions and
mask come from its own counter on the device, so nothing in the step reads back to the host
(tests/test_capture_ready.py proves that on the CPU). Resetting or refilling the cache writes the same tensors, so
the graph goes on serving it.

    cache = new_kv_cache(model, batch_size)                     # on the GPU
    step = CapturedStep(model, cache)
    ids = generate(model, prompt, 500, cache=cache, step=step)  # every one-token step replays the graph
"""

import torch


class CapturedStep:
    """model.decode_step for one token per row through `cache`, captured as a CUDA graph. decode_step(idx, cache)
    returns the graph's own logits tensor, which the next replay overwrites: read it before the next step."""

    tokens = 1  # the tokens per row a pass takes

    def __init__(self, model, cache, warm_ups: int = 2):
        if cache.device.type != "cuda":
            raise ValueError(f"a CUDA graph records a step on a CUDA device, and the cache is on {cache.device.type}")
        if not cache.abilities.compiles:
            raise ValueError(f"a {type(cache).__name__} decodes eagerly: its step cannot be captured")
        self.model, self.cache = model, cache
        self.idx = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=cache.device)
        state = [t.clone() for t in cache.buffers()]  # warming up writes the cache; it is put back after
        side = torch.cuda.Stream()  # warm-ups on a side stream, as capture asks: allocations, library handles
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(warm_ups):
                model.decode_step(self.idx, cache)
        torch.cuda.current_stream().wait_stream(side)
        for mine, saved in zip(cache.buffers(), state):
            mine.copy_(saved)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):  # recorded, not run: the cache is as it was
            self.logits = model.decode_step(self.idx, cache)  # (B, vocab_size)

    def fits(self, cache, tokens: int = 1) -> bool:
        """Whether this step serves passes of `tokens` tokens per row through `cache`: its own cache, one token."""
        return cache is self.cache and self.takes(tokens)

    def takes(self, tokens: int) -> bool:
        return tokens == self.tokens

    def decode_step(self, idx, cache):
        """idx (B, 1) -> the logits (B, vocab_size), as GPT.decode_step gives them."""
        self.idx.copy_(idx)
        self.graph.replay()
        return self.logits

    def __call__(self, idx, cache):
        """idx (B, 1) -> logits (B, 1, vocab_size), as model(idx, cache=cache)[0] gives them."""
        return self.decode_step(idx, cache)[:, None]
