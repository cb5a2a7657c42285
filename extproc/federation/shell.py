"""Federation in the gateway process: the core (:class:`Federation`, :class:`SummaryBuilder`,
:class:`Forwarder`) wired to the summary service and follower, etcd ``federation/<cluster>``, Envoy's
logs (forward outcomes) and Prometheus. The processor only sees the :class:`Forwarder`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from contracts.federation import UNTRUSTED, Report
from extproc.federation.exchange import SummaryFollower, SummaryService
from extproc.federation.forwarding import Forwarder
from extproc.federation.health import Outcome, outcome_of
from extproc.federation.links import FederationConfig
from extproc.federation.peers import Federation
from extproc.federation.summary import ModelLoad, SummaryBuilder
from extproc.fleet import EndpointState
from extproc.routing.router import Router

log = logging.getLogger(__name__)

PREFILL_ROLE = "prefill"


def model_loads(router: Router, now: float, prefill_s_per_token: float) -> dict[str, ModelLoad]:
    """Per model the fleet serves: routable endpoints (healthy, not draining, not ejected, not prefill-only)
    and the predicted wait before a new request's prefill starts at the least-waiting one: ``min over e of
    slope_e x backlog_e`` (README.md, "Queue wait"), ``slope_e`` the endpoint's fitted TTFT slope
    (:class:`~extproc.scheduling.predict.TTFTPredictor`), or ``prefill_s_per_token`` (this cluster's
    configured prefill rate) while it has none, and ``backlog_e`` the prefill tokens still to compute
    there (:meth:`~extproc.scheduling.predict.TTFTPredictor.backlog`). An idle fleet waits 0."""
    predictor = router.predictor
    out: dict[str, ModelLoad] = {}
    serving: dict[str, list[EndpointState]] = {}
    for state in router.fleet:
        if not state.healthy or state.draining or state.ejected(now) or state.endpoint.role == PREFILL_ROLE:
            continue
        for model in state.endpoint.models:
            serving.setdefault(model, []).append(state)

    def wait(state: EndpointState) -> float:
        slope = predictor.fitted_slope(state.id)
        slope = prefill_s_per_token if slope is None else slope
        return slope * predictor.backlog(state, now, slope)

    for model in router.fleet.models():
        states = serving.get(model, [])
        least = min(map(wait, states), default=0.0)
        out[model] = ModelLoad(queue_wait_s=max(0.0, least), endpoints=len(states))
    return out


class LinkSink:
    """etcd ``federation/<cluster>`` into the link table (:class:`~extproc.control.plane.FamilySink`):
    a refused value is logged and the link in force stays; a change re-syncs the subscriptions."""

    def __init__(self, federation: Federation, changed: Callable[[], None]) -> None:
        self._federation = federation
        self._changed = changed

    def put(self, name: str, value: bytes, *, backlog: bool) -> bool:
        links = self._federation.links
        before = links.version
        error = links.put(name, value)
        if error is not None:
            log.warning("federation link refused, the last good one stays: %s", error)
            return False
        if links.version != before:
            self._changed()
            return True
        return False

    def delete(self, name: str) -> bool:
        links = self._federation.links
        before = links.version
        links.delete(name)
        if links.version != before:
            self._changed()
            return True
        return False


class FederationShell:
    """Owns the summary service and follower for one gateway process."""

    def __init__(
        self, config: FederationConfig, router: Router, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.federation = Federation(config)
        self.builder = SummaryBuilder()
        self.forwarder = Forwarder(self.federation, self.builder)
        self._router = router
        self._clock = clock
        self.service = SummaryService(self.federation, self.report, clock=clock)
        self.follower = SummaryFollower(self.federation, clock=clock)
        self.sink = LinkSink(self.federation, self._links_changed)
        self.outcomes: dict[tuple[str, str], int] = {}
        #: Told the linked peers' ingresses (``ip:port``) at start and on every link change (the gateway's
        #: EDS serves them as hosts of Envoy's engine cluster).
        #: Told the links' ingresses, each with its cluster's identity (Envoy's EDS: its exact SAN).
        self.on_ingresses: Callable[[Mapping[str, str]], None] | None = None
        self._started = False

    def report(self) -> Report:
        """This cluster's report now: per model, the summary of what its fleet still holds and its load."""
        router = self._router
        now = self._clock()
        loads = model_loads(router, now, self.federation.config.prefill_s_per_token)
        summaries = self.builder.build(router.policy.block_size, loads, router.index.held)
        return Report(self.federation.cluster, time.time(), self.federation.config.ttl_s, summaries)

    def _links_changed(self) -> None:
        if self._started:
            self.follower.sync()
            self._tell_ingresses()

    def _tell_ingresses(self) -> None:
        if self.on_ingresses is not None:
            self.on_ingresses(
                {link.ingress: link.identity for link in self.federation.links.links().values()}
            )

    def peer_at(self, address: str) -> str | None:
        """The linked cluster whose ingress is ``address`` (``ip:port``)."""
        for link in self.federation.links.links().values():
            if link.ingress == address:
                return link.cluster
        return None

    def failed_try(self, address: str, kind: str = "") -> None:
        """Envoy's failed-try log: a try to a peer's ingress failed (unreachable, reset or 5xx; or, ``kind``
        :data:`~contracts.federation.UNTRUSTED`, refused as untrusted); Envoy went on to the local pick."""
        peer = self.peer_at(address)
        if peer is not None:
            self._outcome(peer, Outcome.REFUSED if kind == UNTRUSTED else Outcome.UNREACHABLE)

    def completed(self, address: str, status: int, ttfb_s: float | None, *, streamed: bool = False) -> None:
        """Envoy's completion log: a request ended at ``address``; a peer's ingress gets its outcome
        (``health.outcome_of``: status 0, the client left first, says nothing of the peer; ``ttfb_s`` is
        judged only on a ``streamed`` request)."""
        peer = self.peer_at(address)
        if peer is None:
            return
        outcome = outcome_of(status, ttfb_s, self.federation.config.slow_s, streamed=streamed)
        if outcome is not None:
            self._outcome(peer, outcome)

    def _outcome(self, peer: str, outcome: Outcome) -> None:
        key = (peer, outcome.value)
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        self.federation.observe(peer, outcome, self._clock())

    async def start(self) -> None:
        await self.service.start()
        self._started = True
        self.follower.sync()
        self._tell_ingresses()
        log.info(
            "federation: cluster %s, summaries on port %d, %d link(s)",
            self.federation.cluster,
            self.service.port,
            len(self.federation.links.links()),
        )

    async def aclose(self) -> None:
        self._started = False
        await self.follower.aclose()
        await self.service.aclose()


class FederationCollector(Collector):
    """Prometheus: decisions by reason, forwards and outcomes per peer, summary age and size, egress used."""

    def __init__(self, shell: FederationShell) -> None:
        self._shell = shell

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        shell = self._shell
        fwd = shell.forwarder
        decisions = CounterMetricFamily(
            "kvgate_federation_decisions", "Federation verdicts on requests, by reason", labels=["reason"]
        )
        for reason, n in sorted(fwd.decisions.items()):
            decisions.add_metric([reason], n)
        forwards = CounterMetricFamily(
            "kvgate_federation_forwards", "Requests forwarded, by peer", labels=["peer"]
        )
        for peer, n in sorted(fwd.forwards.items()):
            forwards.add_metric([peer], n)
        outcomes = CounterMetricFamily(
            "kvgate_federation_forward_outcomes",
            "Outcomes of tries sent to peers (Envoy's logs), by peer and outcome",
            labels=["peer", "outcome"],
        )
        for (peer, outcome), n in sorted(shell.outcomes.items()):
            outcomes.add_metric([peer, outcome], n)
        admissions = CounterMetricFamily(
            "kvgate_federation_inbound_admissions",
            "Requests linked peers forwarded here under [auth], by peer and result (admitted or the refusal)",
            labels=["peer", "result"],
        )
        for (peer, result), n in sorted(fwd.admissions.items()):
            admissions.add_metric([peer, result], n)
        age = GaugeMetricFamily(
            "kvgate_federation_summary_age_seconds", "Age of the peer's last summary", labels=["peer"]
        )
        size = GaugeMetricFamily(
            "kvgate_federation_summary_bytes", "Size of the peer's last summary report", labels=["peer"]
        )
        entries = GaugeMetricFamily(
            "kvgate_federation_summary_entries", "Prefix digests in the peer's last summary", labels=["peer"]
        )
        up = GaugeMetricFamily("kvgate_federation_peer_up", "1 when the peer may be chosen", labels=["peer"])
        wait = GaugeMetricFamily(
            "kvgate_federation_peer_queue_wait_seconds",
            "Largest queue wait the peer's last summary published (over its models)",
            labels=["peer"],
        )
        egress_rq = CounterMetricFamily(
            "kvgate_federation_egress_requests",
            "Requests forwarded within the egress budget",
            labels=["peer"],
        )
        egress_b = CounterMetricFamily(
            "kvgate_federation_egress_bytes", "Body bytes forwarded within the egress budget", labels=["peer"]
        )
        for s in shell.federation.status(shell._clock()):
            if s.summary_age_s is not None:
                age.add_metric([s.cluster], s.summary_age_s)
            size.add_metric([s.cluster], s.summary_bytes)
            entries.add_metric([s.cluster], s.summary_entries)
            up.add_metric([s.cluster], 1.0 if s.up and s.fresh else 0.0)
            wait.add_metric([s.cluster], s.queue_wait_s)
            egress_rq.add_metric([s.cluster], s.egress_requests)
            egress_b.add_metric([s.cluster], s.egress_bytes)
        noted = GaugeMetricFamily(
            "kvgate_federation_noted_digests", "Sampled prefix digests this gateway may publish (before held)"
        )
        noted.add_metric([], len(shell.builder))
        yield from (
            decisions,
            forwards,
            outcomes,
            admissions,
            age,
            size,
            entries,
            up,
            wait,
            egress_rq,
            egress_b,
            noted,
        )
