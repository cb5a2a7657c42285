"""vLLM's Prometheus metrics for one simulated replica, in its own registry.

Gauges and counters are read from the engine at scrape time (no double bookkeeping); time to first
token is a histogram the driver observes. Names, labels (``model_name``, ``engine``) and TTFT buckets
follow vLLM v1, so scrapers written for vLLM read the simulator unchanged. A replica with a power model
also has a second registry in dcgm-exporter's format (:class:`DcgmCollector`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from load.sim.engine import Engine
from load.sim.power import REASON_IDLE, REASON_SW_POWER_CAP

# vLLM's buckets for vllm:time_to_first_token_seconds, in seconds.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# fmt: on


class EngineCollector(Collector):
    """vLLM's gauges and counters, read from the engine at scrape time; with ``sglang`` also SGLang's
    load series (a replica in SGLang's disaggregation mode registers with engine kind ``sglang``, whose
    scrapers read those names)."""

    def __init__(
        self,
        engine: Engine,
        model: str,
        sglang: bool = False,
        lora: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._engine = engine
        self._labels = (model, "0")
        self._sglang = sglang
        #: Serving LoRA adapters: export vLLM's ``vllm:lora_requests_info`` (value: ``clock()``, the wall
        #: time of the reading, as vLLM's).
        self._lora = lora
        self._clock = clock

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
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.preemptions),
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
            (
                "kvgate_sim_busy_seconds",
                "Seconds of the modelled timeline the engine spent in steps (its engine-seconds).",
                stats.busy_seconds,
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
        if self._sglang:  # SGLang's names and its model_name label
            for name, doc, value in (
                ("sglang:num_running_reqs", "The number of running requests.", engine.num_running),
                ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", engine.num_waiting),
                ("sglang:token_usage", "The token usage.", engine.kv_usage),
            ):
                gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
                gauge.add_metric([self._labels[0]], value)
                yield gauge
            for name, doc, value in (
                ("sglang:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
                (
                    "sglang:generation_tokens",
                    "Number of generation tokens processed.",
                    stats.generation_tokens,
                ),
            ):
                counter = CounterMetricFamily(name, doc, labels=["model_name"])
                counter.add_metric([self._labels[0]], value)
                yield counter
        cfg = engine.config
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"],
        )
        info.add_metric([str(cfg.block_size), str(cfg.num_blocks), str(cfg.enable_prefix_caching), "0"], 1)
        yield info
        if self._lora:
            running, waiting = engine.lora_requests()
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
            )
            lora.add_metric([",".join(running), str(cfg.max_loras), ",".join(waiting)], self._clock())
            yield lora
            loads = CounterMetricFamily(
                "kvgate_sim_lora_loads", "LoRA adapters loaded into GPU slots (the simulator's own)."
            )
            loads.add_metric([], engine.loras.loads)
            yield loads


def replica_registry(
    engine: Engine, model: str, sglang: bool = False, lora: bool = False
) -> tuple[CollectorRegistry, Callable[[float], None]]:
    """A registry exposing ``engine`` as vLLM does (and SGLang, with ``sglang``; ``lora``: with vLLM's LoRA
    metric), and the TTFT observer (seconds) to feed it."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, model, sglang, lora))
    ttft = Histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        ["model_name", "engine"],
        registry=registry,
        buckets=TTFT_BUCKETS,
    ).labels(model, "0")
    if not sglang:
        return registry, ttft.observe
    sglang_ttft = Histogram(
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        ["model_name"],
        registry=registry,
        buckets=TTFT_BUCKETS,
    ).labels(model)

    def observe(seconds: float) -> None:
        ttft.observe(seconds)
        sglang_ttft.observe(seconds)

    return registry, observe


class DcgmCollector(Collector):
    """What a dcgm-exporter on the replica's GPU would serve (its field names, labels and units; the
    engine's :mod:`load.sim.power` model): ``DCGM_FI_DEV_POWER_USAGE`` (W, the draw now),
    ``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` (mJ), ``DCGM_FI_DEV_POWER_MGMT_LIMIT`` (W),
    ``DCGM_FI_DEV_SM_CLOCK`` (MHz), ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS``, ``DCGM_FI_DEV_POWER_VIOLATION``
    (us the power cap held the clocks down, a counter) and ``DCGM_FI_DEV_GPU_TEMP`` (C: 30
    plus 50 x draw / TDP, a placeholder, not a thermal model). ``clock``: the driver's clock (seconds)."""

    def __init__(self, engine: Engine, hostname: str, clock: Callable[[], float], gpu_index: int = 0) -> None:
        if engine.power is None or engine.meter is None:
            raise ValueError("the engine has no power model")
        self._engine, self._clock = engine, clock
        gpu = engine.power.gpu
        self._labels = [
            str(gpu_index),
            f"GPU-sim-{hostname}-{gpu_index}",
            f"nvidia{gpu_index}",
            gpu.model_name,
        ]
        self._labels.append(hostname)

    def collect(self) -> Iterable[Metric]:
        power, meter = self._engine.power, self._engine.meter
        assert power is not None and meter is not None
        gpu, now = power.gpu, self._clock()
        labels = ["gpu", "UUID", "device", "modelName", "Hostname"]
        watts = meter.watts()
        ratio = meter.clock_ratio
        reasons = REASON_SW_POWER_CAP if ratio < 1.0 else REASON_IDLE if not self._engine.has_work() else 0
        gauges = (
            ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", watts),
            ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "Power management limit (in W).", power.limit_w),
            ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", gpu.max_sm_mhz * ratio),
            ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "Current clock event reasons (bitmask).", float(reasons)),
            ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", 30.0 + 50.0 * watts / gpu.max_w),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(self._labels, value)
            yield family
        energy = CounterMetricFamily(
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
            "Total energy consumption since boot (in mJ).",
            labels=labels,
        )
        energy.add_metric(self._labels, meter.energy_j(now) * 1000.0)
        yield energy
        violation = CounterMetricFamily(
            "DCGM_FI_DEV_POWER_VIOLATION",
            "Throttling duration due to power constraints (in us).",
            labels=labels,
        )
        violation.add_metric(self._labels, meter.capped_s * 1e6)
        yield violation


def dcgm_registry(engine: Engine, hostname: str, clock: Callable[[], float]) -> CollectorRegistry:
    """A registry serving ``engine``'s GPU as dcgm-exporter does (:class:`DcgmCollector`)."""
    registry = CollectorRegistry()
    registry.register(DcgmCollector(engine, hostname, clock))
    return registry
