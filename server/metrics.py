"""The server's counters, and GET /metrics in Prometheus's text format (version 0.0.4), written out by hand:
a few lines need no client library."""

import bisect

# Upper bounds of the time-to-first-token histogram, in seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
OUTCOMES = ("length", "stop", "cancelled", "stopped")  # how a completion ends
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """What only the server counts; the engine's own figures (blocks, hit rate) are read when scraped."""

    def __init__(self):
        self.tokens_drawn = 0
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)  # the last: past every bound
        self.ttft_sum = 0.0
        self.outcomes = dict.fromkeys(OUTCOMES, 0)

    def first_token(self, seconds: float) -> None:
        self.ttft_counts[bisect.bisect_left(TTFT_BUCKETS, seconds)] += 1
        self.ttft_sum += seconds

    def ended(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def render(self, gauges: dict) -> str:
        """The text a Prometheus server scrapes: gauges of the engine now, and the counters."""
        lines = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]):
            lines.extend([f"# HELP kvgpt_{name} {help_text}", f"# TYPE kvgpt_{name} {kind}"])
            lines.extend(f"kvgpt_{name}{labels} {value}" for labels, value in samples)

        metric("requests_running", "gauge", "Completions in the running batch.", [("", gauges["running"])])
        metric("requests_waiting", "gauge", "Completions waiting for the batch or the pool.", [("", gauges["waiting"])])
        metric("tokens_drawn_total", "counter", "Tokens drawn for every completion.", [("", self.tokens_drawn)])
        metric("prompt_tokens_total", "counter", "Prompt tokens admitted to the pool (again after a preemption).",
               [("", gauges["prompt_tokens"])])
        metric("prefix_cache_hit_tokens_total", "counter", "Of those, tokens read from cached blocks.",
               [("", gauges["reused_tokens"])])
        metric("prefix_cache_hit_rate", "gauge", "Prompt tokens read from cached blocks, as a fraction.",
               [("", round(gauges["hit_rate"], 6))])
        metric("blocks_used", "gauge", "KV blocks read by a running completion.", [("", gauges["blocks_used"])])
        metric("blocks_free", "gauge", "KV blocks that a completion can take, cached ones included.",
               [("", gauges["blocks_free"])])
        metric("blocks_cached", "gauge", "Free KV blocks that still hold a prefix for the prefix cache.",
               [("", gauges["blocks_cached"])])
        metric("preemptions_total", "counter", "Completions sent back to wait for want of blocks.",
               [("", gauges["preemptions"])])
        metric("requests_total", "counter", "Completions ended, by how they ended.",
               [(f'{{outcome="{outcome}"}}', count) for outcome, count in self.outcomes.items()])
        cumulative, samples = 0, []
        for bound, count in zip((*TTFT_BUCKETS, "+Inf"), self.ttft_counts):
            cumulative += count
            samples.append((f'_bucket{{le="{bound}"}}', cumulative))
        metric("time_to_first_token_seconds", "histogram", "From a completion's arrival to its first token.",
               samples + [("_sum", round(self.ttft_sum, 6)), ("_count", cumulative)])
        return "\n".join(lines) + "\n"
