"""``kvgate_burst_requests_total{endpoint,outcome}``, ``kvgate_burst_budget_left{endpoint}`` and
``kvgate_burst_records_refused_total`` (etcd records), read from the
:class:`~extproc.burst.core.Burster` and the record table when Prometheus scrapes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.burst.core import NO_BUDGET, SENT, Burster


class BurstCollector(Collector):
    """The burster's counts and each endpoint's budget left under ``per_minute()`` (the policy now)."""

    def __init__(
        self, burster: Burster, per_minute: Callable[[], float], refused: Callable[[], int] | None = None
    ) -> None:
        self._burster = burster
        self._per_minute = per_minute
        self._refused = refused

    def collect(self) -> Iterator[Metric]:
        burster = self._burster
        sent = CounterMetricFamily(
            "kvgate_burst_requests",
            "Requests flow control would have queued, by burst endpoint and outcome: sent there, or "
            "no_budget (its per-minute budget was spent; the request stayed local)",
            labels=["endpoint", "outcome"],
        )
        for e in burster.endpoints:
            for outcome in (SENT, NO_BUDGET):
                sent.add_metric([e.name, outcome], burster.counts.get((e.name, outcome), 0))
        yield sent
        left = GaugeMetricFamily(
            "kvgate_burst_budget_left",
            "Requests a burst endpoint may still take now (its token bucket)",
            labels=["endpoint"],
        )
        for name, tokens in burster.left(self._per_minute(), time.monotonic()).items():
            left.add_metric([name], tokens)
        yield left
        if self._refused is not None:
            yield CounterMetricFamily(
                "kvgate_burst_records_refused",
                "etcd burst/<name> records refused (the endpoint in force stayed)",
                value=self._refused(),
            )
