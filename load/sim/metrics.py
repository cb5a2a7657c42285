"""vLLM's Prometheus metrics for one simulated replica, in its own registry.

Gauges and counters are read from the engine at scrape time (no double bookkeeping); time to first
token is a histogram the driver observes. Names, labels (``model_name``, ``engine``) and TTFT buckets
follow vLLM v1, so scrapers written for vLLM read the simulator unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from load.sim.engine import Engine

# vLLM's buckets for vllm:time_to_first_token_seconds, in seconds.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# fmt: on


class EngineCollector(Collector):
    """vLLM's gauges and counters, read from the engine at scrape time."""

    def __init__(self, engine: Engine, model: str) -> None:
        self._engine = engine
        self._labels = (model, "0")

    def collect(self) -> Iterable[Metric]:
        engine, stats, labels = self._engine, self._engine.stats, ["model_name", "engine"]
        gauges = (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                engine.num_running,
            ),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.kv_usage),
        )
        counters = (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", stats.prefix_cache_hits),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens),
            # The simulator's own (not vLLM's): both halves of P/D handoffs (load/sim/handoff.py).
            (
                "kvgate_sim_remote_decodes",
                "Prefills answered with kv_transfer_params for a remote decode.",
                stats.remote_decodes,
            ),
            (
                "kvgate_sim_remote_prefills",
                "Requests decoded after a remote prefill (KV received).",
                stats.remote_prefills,
            ),
            (
                "kvgate_sim_remote_prefill_tokens",
                "Prompt tokens whose KV was received from a prefill replica.",
                stats.remote_prefill_tokens,
            ),
            (
                "kvgate_sim_remote_prefill_seconds",
                "Seconds spent receiving KV from prefill replicas (the modelled transfer time).",
                stats.remote_prefill_seconds,
            ),
        )
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(self._labels, value)
            yield gauge
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(self._labels, value)
            yield counter
        cfg = engine.config
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"],
        )
        info.add_metric([str(cfg.block_size), str(cfg.num_blocks), str(cfg.enable_prefix_caching), "0"], 1)
        yield info


def replica_registry(engine: Engine, model: str) -> tuple[CollectorRegistry, Callable[[float], None]]:
    """A registry exposing ``engine`` as vLLM does, and the TTFT observer (seconds) to feed it."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, model))
    ttft = Histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        ["model_name", "engine"],
        registry=registry,
        buckets=TTFT_BUCKETS,
    ).labels(model, "0")
    return registry, ttft.observe
