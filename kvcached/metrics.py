"""Prometheus metrics of a kvcached daemon, in a registry of its own (several daemons can share a process
in tests).

Per tier (label ``tier`` = ``ram`` | ``ssd``), read from :meth:`TieredStore.stats` at scrape time, so the
store keeps plain counters and never imports prometheus_client: ``kvcached_tier_hits_total``,
``kvcached_tier_misses_total``, ``kvcached_tier_evictions_total``, ``kvcached_tier_demotions_total``,
``kvcached_tier_promotions_total``, ``kvcached_tier_corrupt_total`` (counters), ``kvcached_tier_bytes``,
``kvcached_tier_blocks`` (gauges). Stats keys are read as ``<tier>_<name>`` or ``<tier>.<name>``; any other
numeric key is exported as ``kvcached_store_<name>``.

Measured by the gRPC service: ``kvcached_requests_total{method,code}``, ``kvcached_request_seconds{method}``
(latency histogram of each API call), ``kvcached_get_seconds{source}`` (latency of Get by where the block
came from: ``ram``, ``ssd``, ``peer`` or ``miss``); peer fetch: ``kvcached_peer_fetch_seconds{outcome}``
(``hit``, ``miss``, ``unavailable``) and ``kvcached_peer_fetch_bytes_total``.

The local API's concurrency cap (``[kvcached] max_concurrent_rpcs``, per listener):
``kvcached_api_max_concurrent_rpcs`` and ``kvcached_api_rpcs_in_flight`` (calls in the service's handlers
now, all listeners together; gauges). A call over the cap is refused by gRPC before any handler runs, so
it is counted by its caller (``RESOURCE_EXHAUSTED``), not here.

Read from the QUIC :class:`~kvcached.peers.PeerServer`'s ``stats()`` at scrape time: its server-wide buffer
budget, ``kvcached_peer_buffer_bytes`` (held now by every connection's requests and responses together)
and ``kvcached_peer_buffer_capacity_bytes`` (gauges), and ``kvcached_peer_busy_total`` (requests and
responses refused because it was spent).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

#: Latency buckets (s): 10 us .. 5 s, dense where RAM (< 100 us) and SSD (< 2.5 ms) hits land.
LATENCY_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
_COUNTERS = frozenset({"hits", "misses", "evictions", "demotions", "promotions", "corrupt"})
_KEY = re.compile(r"^(ram|ssd)[_.](\w+)$")


class _StoreCollector:
    """Turns ``stats()`` into per-tier metric families at each scrape."""

    def __init__(self, stats: Callable[[], Mapping[str, int | float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            stats = dict(self._stats())
        except Exception:  # a closed store: export nothing rather than fail the scrape
            return
        tiered: dict[str, dict[str, float]] = {}
        plain: dict[str, float] = {}
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            m = _KEY.match(key)
            if m is None:
                plain[re.sub(r"\W", "_", key)] = float(value)
            else:
                tiered.setdefault(m.group(2), {})[m.group(1)] = float(value)
        for name, by_tier in sorted(tiered.items()):
            family: CounterMetricFamily | GaugeMetricFamily
            if name in _COUNTERS:
                family = CounterMetricFamily(f"kvcached_tier_{name}", f"Tier {name}", labels=["tier"])
            else:
                family = GaugeMetricFamily(f"kvcached_tier_{name}", f"Tier {name}", labels=["tier"])
            for tier, value in sorted(by_tier.items()):
                family.add_metric([tier], value)
            yield family
        for name, value in sorted(plain.items()):
            yield GaugeMetricFamily(f"kvcached_store_{name}", f"Store {name}", value=value)


class _PeerServerCollector:
    """Turns the peer server's ``stats()`` into its buffer-budget families at each scrape."""

    def __init__(self, stats: Callable[[], Mapping[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield GaugeMetricFamily(
            "kvcached_peer_buffer_bytes",
            "Bytes the QUIC peer server's requests and responses hold, all connections together",
            value=stats["buffer_bytes"],
        )
        yield GaugeMetricFamily(
            "kvcached_peer_buffer_capacity_bytes",
            "The QUIC peer server's buffer budget (quic.buffer_bytes)",
            value=stats["buffer_capacity_bytes"],
        )
        yield CounterMetricFamily(
            "kvcached_peer_busy",
            "Peer requests and responses refused because the buffer budget was spent",
            value=stats["busy"],
        )


class KvcachedMetrics:
    """The daemon's metrics; ``registry`` is what the metrics HTTP server exposes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvcached_requests", "Local API calls by method and gRPC status", ["method", "code"], registry=r
        )
        self.request_seconds = Histogram(
            "kvcached_request_seconds",
            "Local API call latency",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.get_seconds = Histogram(
            "kvcached_get_seconds",
            "Get latency by where the block came from (ram, ssd, peer, miss)",
            ["source"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.peer_fetch_seconds = Histogram(
            "kvcached_peer_fetch_seconds",
            "Peer fetch latency by outcome (hit, miss, unavailable)",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.peer_fetch_bytes = Counter(
            "kvcached_peer_fetch_bytes", "Block bytes fetched from peers over QUIC", registry=r
        )
        self.api_max_concurrent_rpcs = Gauge(
            "kvcached_api_max_concurrent_rpcs",
            "Local API calls each listener serves at once (max_concurrent_rpcs)",
            registry=r,
        )
        self.api_in_flight = Gauge(
            "kvcached_api_rpcs_in_flight", "Local API calls in the handlers now, all listeners", registry=r
        )
        self._collector: _StoreCollector | None = None
        self._peer_collector: _PeerServerCollector | None = None

    def watch_store(self, stats: Callable[[], Mapping[str, int | float]]) -> None:
        """Export the per-tier counters of a store (``TieredStore.stats``) at every scrape."""
        if self._collector is not None:
            self.registry.unregister(self._collector)
        self._collector = _StoreCollector(stats)
        self.registry.register(self._collector)

    def watch_peer_server(self, stats: Callable[[], Mapping[str, int]]) -> None:
        """Export the buffer budget of a QUIC peer server (``PeerServer.stats``) at every scrape."""
        if self._peer_collector is not None:
            self.registry.unregister(self._peer_collector)
        self._peer_collector = _PeerServerCollector(stats)
        self.registry.register(self._peer_collector)
