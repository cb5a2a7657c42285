"""``kvgate_cascade_preroute_*``, read from the :class:`~extproc.cascade.plan.Cascader`'s learners (and
their :class:`~extproc.cascade.persist.PrerouteState`) when Prometheus scrapes."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.cascade.persist import PrerouteState
from extproc.cascade.plan import Cascader


class PrerouteCollector(Collector):
    def __init__(self, cascader: Cascader, state: PrerouteState | None = None) -> None:
        self._cascader = cascader
        self._state = state

    def collect(self) -> Iterator[Metric]:
        verdicts = GaugeMetricFamily(
            "kvgate_cascade_preroute_verdicts",
            "Gate verdicts a virtual model's preroute learner counts (its own, its sibling workers', and "
            "those taken back at start): a learner skips nothing before min_seen verdicts per feature",
            labels=["model"],
        )
        for model, prior in sorted(self._cascader.priors.items()):
            verdicts.add_metric([model], prior.verdicts)
        yield verdicts
        state = self._state
        if state is None:
            return
        yield from state.families(
            "kvgate_cascade_preroute",
            self._cascader.restored,
            "Preroute learners taken back at start (or at etcd's first policy) from the last run's snapshot",
            held="the preroute learners",
            empty="empty learners",
        )
