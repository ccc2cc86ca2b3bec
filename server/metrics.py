"""/metrics: the engine's gauges and counters and the request latency histograms in Prometheus' text format, under
vLLM's names and bucket bounds, so that its dashboards and alerts carry over."""

from __future__ import annotations

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Histogram bounds in seconds, vLLM's; on a CPU a long prompt's TTFT or a long reply takes minutes, which the
# upper ones keep out of +Inf.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class Histogram:
    """A Prometheus histogram; only the engine thread observes, so it needs no lock."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, upper in enumerate(self.buckets):
            self.counts[i] += value <= upper  # kept cumulative, as exposed

    def lines(self, name: str, label: str) -> list[str]:
        return [
            *(f'{name}_bucket{{{label},le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)),
            f'{name}_bucket{{{label},le="+Inf"}} {self.count}',
            f"{name}_sum{{{label}}} {self.sum}",
            f"{name}_count{{{label}}} {self.count}",
        ]


def prometheus_text(
    model_name: str,
    stats: dict[str, float],
    alive: bool,
    ttft: Histogram,
    itl: Histogram,
    queue_time: Histogram,
    e2e: Histogram,
    block_size: int,
    cache_dtype: str,
) -> str:
    """The page /metrics serves: `stats` are Engine.stats(), `alive` whether the engine thread still runs; block_size
    and cache_dtype: the engine's knobs."""
    label, lines = f'model_name="{model_name}"', []
    for name, kind, key, text in [
        ("num_requests_running", "gauge", "num_running", "Sequences in the running batch (vLLM's name)."),
        ("num_requests_waiting", "gauge", "num_waiting", "Sequences waiting to be scheduled."),
        ("num_requests_swapped", "gauge", "num_swapped", "Sequences swapped out to host memory."),
        ("kv_cache_usage_perc", "gauge", "kv_usage", "Fraction of KV blocks in use (1 = full)."),
        ("num_preemptions_total", "counter", "num_preemptions", "Preemptions since start."),
        ("prompt_tokens_total", "counter", "prompt_tokens", "Prompt tokens computed."),
        ("generation_tokens_total", "counter", "generation_tokens", "Tokens generated."),
        ("prefix_cache_queries_total", "counter", "prefix_cache_queries", "Prompt tokens looked up."),
        ("prefix_cache_hits_total", "counter", "prefix_cache_hits", "Prompt tokens found cached."),
        ("spec_decode_num_draft_tokens_total", "counter", "spec_decode_draft_tokens", "Draft tokens proposed."),
        ("spec_decode_num_accepted_tokens_total", "counter", "spec_decode_accepted_tokens", "Draft tokens accepted."),
    ]:
        lines += [
            f"# HELP vllm:{name} {text}",
            f"# TYPE vllm:{name} {kind}",
            f"vllm:{name}{{{label}}} {stats.get(key, 0)}",
        ]
    if "num_kv_blocks" in stats:  # vLLM's: the KV cache's settings as labels, the value always 1
        blocks = int(stats["num_kv_blocks"])
        labels = f'block_size="{block_size}",cache_dtype="{cache_dtype}",num_gpu_blocks="{blocks}"'
        lines += [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig (num_gpu_blocks: the KV "
            "pool's blocks, on CPU too).",
            "# TYPE vllm:cache_config_info gauge",
            f"vllm:cache_config_info{{{labels}}} 1",
        ]
    lines += [
        "# HELP laneserve:engine_alive 0 once the engine thread has died (see /health).",
        "# TYPE laneserve:engine_alive gauge",
        f"laneserve:engine_alive{{{label}}} {int(alive)}",
    ]
    for name, hist, text in [
        ("time_to_first_token_seconds", ttft, "Time to first token."),
        ("inter_token_latency_seconds", itl, "Time between tokens."),
        ("request_queue_time_seconds", queue_time, "Time waiting for a first step."),
        ("e2e_request_latency_seconds", e2e, "Time from arrival to the last token."),
    ]:
        lines += [f"# HELP vllm:{name} {text}", f"# TYPE vllm:{name} histogram", *hist.lines(f"vllm:{name}", label)]
    return "\n".join(lines) + "\n"
