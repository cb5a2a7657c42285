"""``kvgate_response_affinity_*``, read from the :class:`~extproc.affinity.core.ResponseAffinity` when
Prometheus scrapes."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.affinity.core import ResponseAffinity
from extproc.affinity.persist import AffinityState


class AffinityCollector(Collector):
    def __init__(self, affinity: ResponseAffinity, state: AffinityState | None = None) -> None:
        self._affinity = affinity
        self._state = state

    def collect(self) -> Iterator[Metric]:
        a = self._affinity
        requests = CounterMetricFamily(
            "kvgate_response_affinity_requests",
            "Requests carrying previous_response_id, by outcome: hit (sent to the endpoint that produced "
            "it), unknown (no entry in the tenant's scope), unavailable (its endpoint is not routable now: "
            "scored as usual)",
            labels=["outcome"],
        )
        for outcome, n in sorted(a.outcomes.items()):
            requests.add_metric([outcome], n)
        yield requests
        yield CounterMetricFamily(
            "kvgate_response_affinity_learned",
            "Response ids learned from Envoy's completion log (response id -> endpoint)",
            value=a.learned,
        )
        evicted = CounterMetricFamily(
            "kvgate_response_affinity_evicted", "Entries dropped, by reason (lru, ttl)", labels=["reason"]
        )
        for reason, n in sorted(a.evicted.items()):
            evicted.add_metric([reason], n)
        yield evicted
        yield GaugeMetricFamily(
            "kvgate_response_affinity_entries", "Response ids kept now", value=len(a.entries)
        )
        state = self._state
        if state is None:
            return
        yield from state.families(
            "kvgate_response_affinity",
            a.restored,
            "Entries taken at start from the last run's snapshot (state_dir)",
            held="the table",
            empty="an empty table",
        )
