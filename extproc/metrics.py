"""The ext_proc's own Prometheus metrics (served on ``extproc.metrics_listen``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from contracts.events import Power
from extproc.drift.monitor import DriftView, Key
from extproc.fleet import Fleet
from extproc.overload.gate import DecisionGate, LagMeter

DECISION_BUCKETS = (50e-6, 100e-6, 200e-6, 300e-6, 500e-6, 750e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3)
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Log-probabilities (nats) of the cascade gate's statistic.
GATE_BUCKETS = (-5.0, -3.0, -2.0, -1.5, -1.0, -0.75, -0.5, -0.4, -0.3, -0.2, -0.1, -0.05, -0.02, 0.0)
STALENESS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: The feed clients' counters (``runtime.feed.client.FeedStats``) exported as ``kvgate_feed_<name>_total``.
FEED_COUNTERS = (
    "batches", "events", "gaps", "resets", "duplicates", "reconnects", "version_skew", "malformed", "foreign"
)  # fmt: skip
#: An endpoint id (a ``str`` NewType).
K = TypeVar("K", bound=str)


class GatewayMetrics:
    """Counters for outcomes, slot restores and ejections, histograms of decision and restore time, and
    per-endpoint gauges.

    The endpoint gauges are read from the fleet when Prometheus scrapes (a collector), so the request
    path and the engine-metrics loop never spend time on them.
    """

    def __init__(self, fleet: Fleet, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = registry or CollectorRegistry()
        self.requests = Counter(
            "kvgate_requests",
            "Requests handled by the picker, by outcome (routed or HTTP status).",
            ["outcome"],
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "kvgate_decision_seconds",
            "Parse + tokenize + digest + lookup + schedule time per request.",
            buckets=DECISION_BUCKETS,
            registry=self.registry,
        )
        self.prefix_hit_ratio = Histogram(
            "kvgate_prefix_hit_ratio",
            "Fraction of the prompt's full blocks the picked endpoint held.",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
            registry=self.registry,
        )
        self.pd_decisions = Counter(
            "kvgate_pd_decisions",
            "Requests of disaggregating models by how they were served (mode: disaggregated or "
            "aggregated; reason: disaggregated, cached, no_prefill, engine).",
            ["mode", "reason"],
            registry=self.registry,
        )
        self.pd_prefill_seconds = Histogram(
            "kvgate_pd_prefill_seconds",
            "Gateway-side prefill time: from sending a disaggregated request's prefill sub-request to its "
            "answer (or failure), per model and outcome (ok, or the failure's reason). vLLM's protocol: the "
            "time the request waited before Envoy got its decode endpoint. It excludes the KV transfer, "
            "which the decode engine times after it (the simulator: kvgate_sim_remote_prefill_seconds).",
            ["model", "outcome"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.pd_fallbacks = Counter(
            "kvgate_pd_fallbacks",
            "Disaggregated requests served aggregated because the prefill failed, per model and reason "
            "(timeout, unreachable, status, bad_response).",
            ["model", "reason"],
            registry=self.registry,
        )
        self.pd_prefill_errors = Counter(
            "kvgate_pd_prefill_errors",
            "SGLang prefill halves that failed, per model and reason (the decode half was routed with them: "
            "no fallback).",
            ["model", "reason"],
            registry=self.registry,
        )
        self.cascade_answers = Counter(
            "kvgate_cascade_answers",
            "Requests for a cascade's virtual model, by the step (1-based) and model that answered (the last"
            " step counted when its request is routed).",
            ["model", "step", "step_model"],
            registry=registry,
        )
        self.cascade_preroutes = Counter(
            "kvgate_cascade_preroutes",
            "Requests for a cascade's virtual model sent straight to its last step (preroute: the gate was"
            " predicted to escalate them).",
            ["model"],
            registry=registry,
        )
        self.cascade_gate = Histogram(
            "kvgate_cascade_gate_stat",
            "The logprob gate's statistic (nats) of each gated cascade step's answer.",
            ["model"],
            buckets=GATE_BUCKETS,
            registry=registry,
        )
        self.cascade_escalations = Counter(
            "kvgate_cascade_escalations",
            "Cascade steps that passed the request on, by reason (gate: below the threshold; no_logprobs;"
            " timeout, unreachable, status, bad_answer: no usable answer).",
            ["model", "reason"],
            registry=registry,
        )
        self.cascade_escalation_seconds = Histogram(
            "kvgate_cascade_escalation_seconds",
            "Seconds from a cascade request's arrival to its escalation (what the gated steps added).",
            ["model"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.fallbacks = Counter(
            "kvgate_served_by_fallback",
            "Requests Envoy sent to an endpoint other than the pick.",
            registry=self.registry,
        )
        self.slot_restores = Counter(
            "kvgate_slot_restores",
            "llama.cpp slot restores asked of agents before routing, by outcome "
            "(restored, miss, busy, failed, timeout).",
            ["outcome"],
            registry=self.registry,
        )
        self.slot_restore_seconds = Histogram(
            "kvgate_slot_restore_seconds",
            "Time a request waited for a slot restore before it was routed.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0),
            registry=self.registry,
        )
        self.ejections = Counter(
            "kvgate_endpoint_ejections",
            "Endpoints ejected from picks after a failed upstream try, by endpoint and kind (a response "
            "flag of Envoy's, e.g. upstream_connection_failure, or http_503).",
            ["endpoint", "kind"],
            registry=self.registry,
        )
        self.flow_queued = Gauge(
            "kvgate_flow_queued",
            "Requests flow control holds, per model and priority band.",
            ["model", "priority"],
            registry=self.registry,
        )
        self.flow_wait_seconds = Histogram(
            "kvgate_flow_wait_seconds",
            "How long a held request waited, by outcome (dispatched or shed).",
            ["outcome"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.flow_dispatches = Counter(
            "kvgate_flow_dispatches",
            "Held requests dispatched to an engine when capacity freed, per model and priority band.",
            ["model", "priority"],
            registry=self.registry,
        )
        self.flow_sheds = Counter(
            "kvgate_flow_sheds",
            "Requests flow control answered without an engine, by reason (queue_full, queue_timeout, "
            "slo_unattainable, no_endpoint).",
            ["reason"],
            registry=self.registry,
        )
        self.ttft_prediction_error = Histogram(
            "kvgate_ttft_prediction_error_seconds",
            "Observed minus predicted engine TTFT, in absolute seconds, by direction (late: observed later "
            "than predicted; early: sooner): per endpoint and window of its TTFT histogram, the engine's "
            "mean against the mean prediction of the requests routed there (extproc/scheduling/predict.py).",
            ["direction"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )
        self.feed_staleness = Histogram(
            "kvgate_feed_staleness_seconds",
            "Age of each feed batch (agents', kvcached daemons') when the gateway applied it: wall clock now "
            "minus the batch's timestamp.",
            buckets=STALENESS_BUCKETS,
            registry=self.registry,
        )
        self._flow_bands: set[tuple[str, str]] = set()
        self._fleet = fleet
        #: The kinds each endpoint's ``ejections`` series were counted under (to drop them when it goes).
        self._ejected: dict[str, set[str]] = {}
        registry.register(_FleetCollector(fleet))

    def ejected(self, endpoint: str, kind: str) -> None:
        """Count one ejection of ``endpoint`` after a failed try of ``kind``."""
        self._ejected.setdefault(endpoint, set()).add(kind)
        self.ejections.labels(endpoint, kind).inc()

    def keep_endpoints(self, current: Collection[str]) -> None:
        """Drop the per-endpoint series (``kvgate_endpoint_ejections_total``) of endpoints not in
        ``current`` (the fleet's ids): a fleet with churn (pods replaced) keeps no series of endpoints
        that left."""
        for endpoint in self._ejected.keys() - set(current):
            for kind in self._ejected.pop(endpoint):
                self.ejections.remove(endpoint, kind)

    def watch_index(self, occupancy: Callable[[], Mapping[K, int]]) -> None:
        """Export ``kvgate_index_blocks{endpoint}`` from ``occupancy()`` (blocks the prefix index holds per
        endpoint, ``HybridIndex.occupancy``) at every scrape."""
        self.registry.register(_IndexCollector(occupancy))

    def watch_drift(
        self, published: Mapping[Key, DriftView], refresh: Callable[[], None] | None = None
    ) -> None:
        """Export the drift alarm per model and endpoint from ``published``
        (:attr:`extproc.drift.monitor.DriftMonitor.published`) at every scrape, after ``refresh()``
        (which expires the windows, so an alarm clears at its window's end even with no new traffic; it
        is called on the scrape's thread, so it must do that work where the windows live)."""
        self.registry.register(_DriftCollector(published, refresh))

    def watch_overload(self, gate: DecisionGate, lag: LagMeter) -> None:
        """Export the ext_proc's own saturation (:mod:`extproc.overload`) at every scrape, and count
        the requests it sheds (``overload_sheds``)."""
        self.registry.register(_OverloadCollector(gate, lag))
        self.loop_lag = Histogram(
            "kvgate_extproc_loop_lag_seconds",
            "How late the ext_proc's event-loop timer woke (s), sampled every lag_interval_s: the "
            "decision loop's saturation; autoscale the picker on it.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )

    def watch_feeds(self, counters: Callable[[], Mapping[str, int]]) -> None:
        """Export ``kvgate_feed_<name>_total`` for :data:`FEED_COUNTERS` from ``counters()`` (the feed
        clients' shared stats) at every scrape, the gauge ``kvgate_version_skew_sources`` from its
        ``version_skew_sources`` and ``kvgate_etcd_endpoint_claims_refused_total`` from its
        ``endpoint_claims_refused``; a name it lacks reads 0."""
        self.registry.register(_FeedCollector(counters))

    def watch_pool(self, counters: Callable[[], Mapping[str, int]]) -> None:
        """Export the InferencePool watcher's state from ``counters()`` at every scrape
        (:class:`extproc.inferencepool.watch.PoolWatcher`): ``kvgate_inference_pool_<name>_total`` for
        ``lists``, ``relists`` (410 Gone), ``events``, ``reconnects``; gauges ``kvgate_inference_pool_synced``
        (listed once) and ``kvgate_inference_pool_endpoints`` (the pool's endpoints in the fleet)."""
        self.registry.register(_PoolCollector(counters))

    def ttft_observed(self, predicted_s: float, observed_s: float) -> None:
        """One window's mean predicted and observed engine TTFT at one endpoint."""
        error = observed_s - predicted_s
        self.ttft_prediction_error.labels("late" if error > 0 else "early").observe(abs(error))

    # -- flow control (extproc.flow.dispatch.FlowListener) -----------------------------------------------

    def dispatched(self, model: str, priority: int, waited_s: float) -> None:
        self.flow_dispatches.labels(model, str(priority)).inc()
        self.flow_wait_seconds.labels("dispatched").observe(waited_s)

    def shed(self, model: str, priority: int, reason: str, waited_s: float) -> None:
        self.flow_sheds.labels(reason).inc()
        if waited_s > 0:
            self.flow_wait_seconds.labels("shed").observe(waited_s)

    def depth(self, depth: dict[tuple[str, int], int]) -> None:
        """Set each band's gauge; a band that emptied reads 0, or loses its series when no endpoint serves
        its model (a name only a client gave, held in the waiting room: a series per such name would grow
        without bound)."""
        current = {(model, str(priority)): n for (model, priority), n in depth.items()}
        emptied = self._flow_bands - set(current)
        served = {m for s in self._fleet for m in s.endpoint.models} if emptied else set()
        for labels in emptied:
            if labels[0] in served:
                self.flow_queued.labels(*labels).set(0)
            else:
                self.flow_queued.remove(*labels)
        for labels, n in current.items():
            self.flow_queued.labels(*labels).set(n)
        self._flow_bands = set(current)


class _FleetCollector(Collector):
    """Per endpoint: ``kvgate_endpoint_in_flight`` (open ext_proc streams), ``kvgate_endpoint_load`` (the
    scheduler's estimate of requests at the engine) and ``kvgate_endpoint_healthy``. Per node and power
    source (from the readings agents send with their loads; a node's endpoints carry the same readings, the
    newest is shown): ``kvgate_power_watts``, ``kvgate_power_limit_watts``,
    ``kvgate_power_temperature_celsius``, ``kvgate_power_throttled`` (1 when a power or thermal limit holds
    the clocks down), ``kvgate_power_energy_joules_total`` (the source's energy counter: NVML's and DCGM's
    since the driver loaded, a BMC's since it started; ``rate()`` of it is the mean draw) and
    ``kvgate_power_source_up`` (0 while the source's last read failed); a figure the source does not give is
    left out."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def collect(self) -> Iterable[Metric]:
        in_flight = GaugeMetricFamily(
            "kvgate_endpoint_in_flight", "Open ext_proc streams per endpoint.", labels=["endpoint"]
        )
        load = GaugeMetricFamily(
            "kvgate_endpoint_load",
            "Requests at the engine as the scheduler sees them: running + waiting + routed since scrape.",
            labels=["endpoint"],
        )
        healthy = GaugeMetricFamily(
            "kvgate_endpoint_healthy",
            "1 if the endpoint is eligible (healthy, not draining, not ejected after a failed try).",
            labels=["endpoint"],
        )
        now = time.monotonic()  # the clock ejections are kept in (the processor's)
        for state in list(self._fleet):  # a snapshot: this runs on the metrics server's thread
            in_flight.add_metric([state.id], state.in_flight)
            load.add_metric([state.id], state.load)
            eligible = state.healthy and not state.draining and not state.ejected(now)
            healthy.add_metric([state.id], 1 if eligible else 0)
        yield in_flight
        yield load
        yield healthy
        yield from power_families(self._fleet)


#: (name, help, the reading's field) of each per-source power gauge.
_POWER_GAUGES = (
    ("kvgate_power_watts", "Power drawn now (W), per node and power source.", "watts"),
    ("kvgate_power_limit_watts", "Power cap in force (W), per node and power source.", "limit_w"),
    (
        "kvgate_power_temperature_celsius",
        "Hottest temperature read (C), per node and power source.",
        "temperature_c",
    ),
    ("kvgate_power_throttled", "1 if a power or thermal limit holds the clocks down.", "throttled"),
)


def power_families(fleet: Fleet) -> Iterable[Metric]:
    """The power gauges of every node the fleet has readings of (see :class:`_FleetCollector`)."""
    newest: dict[tuple[str, str], Power] = {}
    for state in list(fleet):
        node = state.endpoint.node or state.id
        for reading in state.power:
            key = (node, reading.source)
            if key not in newest or reading.at > newest[key].at:
                newest[key] = reading
    labels = ["node", "source"]
    for name, doc, field in _POWER_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=labels)
        for (node, source), reading in sorted(newest.items()):
            value = getattr(reading, field)
            if value is not None:
                family.add_metric([node, source], float(value))
        yield family
    energy = CounterMetricFamily(
        "kvgate_power_energy_joules",
        "Energy the power source's counter says was used (J) since it started (the GPU driver's for nvml and"
        " dcgm, the BMC's for redfish); its rate is the mean draw. Per node and power source.",
        labels=labels,
    )
    for (node, source), reading in sorted(newest.items()):
        if reading.energy_j is not None:
            energy.add_metric([node, source], reading.energy_j)
    yield energy
    up = GaugeMetricFamily(
        "kvgate_power_source_up", "0 while the power source's last read failed.", labels=labels
    )
    for (node, source), reading in sorted(newest.items()):
        up.add_metric([node, source], 0.0 if reading.error else 1.0)
    yield up


class _IndexCollector(Collector, Generic[K]):
    """``kvgate_index_blocks{endpoint}``: blocks the prefix index holds per endpoint (precise entries from
    KV events, approximate ones from routing decisions)."""

    def __init__(self, occupancy: Callable[[], Mapping[K, int]]) -> None:
        self._occupancy = occupancy

    def collect(self) -> Iterable[Metric]:
        blocks = GaugeMetricFamily(
            "kvgate_index_blocks",
            "Blocks the gateway's prefix index holds, per endpoint.",
            labels=["endpoint"],
        )
        for _ in range(3):  # the index changes on the event loop while this thread reads it
            try:
                held = dict(self._occupancy())
                break
            except RuntimeError:
                continue
        else:
            held = {}
        for endpoint, n in sorted(held.items()):
            blocks.add_metric([str(endpoint)], n)
        yield blocks


class _DriftCollector(Collector):
    """Per model, endpoint and source (``responses``: each answer's cached tokens; ``counters``: the
    engine's prefix-cache counters against the rates routed there): ``kvgate_drift_ratio``
    (engine-reused / predicted cached prompt tokens over the window), ``kvgate_drift_error`` (the
    predicted tokens the engine did not reuse, as a fraction), ``kvgate_drift_samples`` (requests with a
    prediction in the window), ``kvgate_drift_tripped`` (1 while the alarm is tripped) and
    ``kvgate_drift_observed_total`` (requests compared)."""

    def __init__(self, published: Mapping[Key, DriftView], refresh: Callable[[], None] | None = None) -> None:
        self._published = published
        self._refresh = refresh

    def collect(self) -> Iterable[Metric]:
        if self._refresh is not None:
            self._refresh()
        labels = ["model", "endpoint", "source"]  # source: responses (cached_tokens) or counters (vLLM's)
        ratio = GaugeMetricFamily(
            "kvgate_drift_ratio",
            "Prompt tokens the engine reused / prompt tokens the router predicted it held, over the window.",
            labels=labels,
        )
        error = GaugeMetricFamily(
            "kvgate_drift_error",
            "Fraction of the predicted cached prompt tokens the engine did not reuse, over the window.",
            labels=labels,
        )
        samples = GaugeMetricFamily(
            "kvgate_drift_samples", "Requests with a prediction in the drift window.", labels=labels
        )
        tripped = GaugeMetricFamily(
            "kvgate_drift_tripped",
            "1 while the drift alarm is tripped (extproc/drift/README.md).",
            labels=labels,
        )
        observed = CounterMetricFamily(
            "kvgate_drift_observed",
            "Answered requests whose engine reported its cached prompt tokens.",
            labels=labels,
        )
        for _ in range(3):  # the event loop replaces entries while this thread reads
            try:
                views = list(self._published.values())
                break
            except RuntimeError:
                continue
        else:
            views = []
        for v in sorted(views, key=lambda v: (v.model, v.endpoint, v.source)):
            key = [v.model, v.endpoint, v.source]
            if v.ratio is not None and v.error is not None:
                ratio.add_metric(key, v.ratio)
                error.add_metric(key, v.error)
            samples.add_metric(key, v.samples)
            tripped.add_metric(key, 1 if v.tripped else 0)
            observed.add_metric(key, v.observed)
        yield from (ratio, error, samples, tripped, observed)


class _OverloadCollector(Collector):
    """The ext_proc's saturation: decisions in flight, the decision queue (bodies waiting for a worker
    thread), the bound, in_flight / bound, requests shed, and the event loop's lag (last and peak)."""

    def __init__(self, gate: DecisionGate, lag: LagMeter) -> None:
        self._gate, self._lag = gate, lag

    def collect(self) -> Iterable[Metric]:
        gate, lag = self._gate, self._lag
        yield GaugeMetricFamily(
            "kvgate_extproc_decisions_in_flight",
            "Requests between their headers and their routing answer (not those flow control holds).",
            value=gate.in_flight,
        )
        yield GaugeMetricFamily(
            "kvgate_extproc_decision_queue",
            "Decisions whose body is complete and waits for a worker thread to tokenize it.",
            value=gate.queued,
        )
        yield GaugeMetricFamily(
            "kvgate_extproc_decision_limit",
            "Decisions in flight beyond which requests are shed (0: none).",
            value=gate.limit,
        )
        yield GaugeMetricFamily(
            "kvgate_extproc_saturation",
            "Decisions in flight / the bound: 1 means the next request is shed (0 without a bound).",
            value=gate.saturation,
        )
        yield CounterMetricFamily(
            "kvgate_extproc_overload_sheds",
            "Requests the ext_proc shed (503 gateway_overloaded) because its decisions were at the bound.",
            value=gate.shed,
        )
        yield GaugeMetricFamily(
            "kvgate_extproc_loop_lag_last_seconds",
            "The event-loop timer's last lateness (s).",
            value=lag.last,
        )
        yield GaugeMetricFamily(
            "kvgate_extproc_loop_lag_peak_seconds",
            "The event-loop timer's highest lateness over the last lag_window_s (s).",
            value=lag.peak,
        )


class _FeedCollector(Collector):
    """``kvgate_feed_<name>_total``: the feed clients' counters (batches and events applied, sequence gaps,
    resets by snapshot, duplicates, reconnects, version skew, refused malformed events, events dropped for
    naming an endpoint another feed owns)."""

    def __init__(self, counters: Callable[[], Mapping[str, int]]) -> None:
        self._counters = counters

    def collect(self) -> Iterable[Metric]:
        values = self._counters()
        for name in FEED_COUNTERS:
            yield CounterMetricFamily(
                f"kvgate_feed_{name}", f"Feed clients' {name} since start.", value=values.get(name, 0)
            )
        yield GaugeMetricFamily(
            "kvgate_version_skew_sources",
            "etcd records (endpoints, kvcached daemons) read now at a version this gateway does not use "
            "as written (contracts/README.md).",
            value=values.get("version_skew_sources", 0),
        )
        yield CounterMetricFamily(
            "kvgate_etcd_endpoint_claims_refused",
            "etcd endpoint records refused for an id another node's key holds (they wait until it goes).",
            value=values.get("endpoint_claims_refused", 0),
        )


class _PoolCollector(Collector):
    """The InferencePool watcher's counters and gauges (:meth:`GatewayMetrics.watch_pool`)."""

    def __init__(self, counters: Callable[[], Mapping[str, int]]) -> None:
        self._counters = counters

    def collect(self) -> Iterable[Metric]:
        values = self._counters()
        for name in ("lists", "relists", "events", "reconnects"):
            yield CounterMetricFamily(
                f"kvgate_inference_pool_{name}",
                f"InferencePool watch: {name} since start.",
                value=values.get(name, 0),
            )
        for name, what in (
            ("synced", "1 once the pool and its pods were listed"),
            ("endpoints", "pool endpoints in the fleet"),
        ):
            yield GaugeMetricFamily(
                f"kvgate_inference_pool_{name}", f"InferencePool: {what}.", value=values.get(name, 0)
            )
