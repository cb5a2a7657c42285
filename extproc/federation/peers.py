"""The federation state of one gateway: links in force, the summaries peers sent, their health and
egress budgets, and the decision over them (:mod:`extproc.federation.decision`). Pure: ``now`` (the
gateway's monotonic clock) is passed in; the gRPC exchange and the processor are the shell."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from contracts.digest import Digest
from contracts.federation import ModelSummary, Report
from extproc.federation.budget import EgressBudget
from extproc.federation.decision import (
    BUDGET,
    FORWARD,
    HOP,
    Candidate,
    Verdict,
    gains,
)
from extproc.federation.health import Outcome, PeerHealth
from extproc.federation.links import FederationConfig, Link, LinkTable
from extproc.federation.trust import Inbound


@dataclass(frozen=True, slots=True)
class Received:
    report: Report
    at: float
    size_bytes: int
    #: The report's summaries by model (looked up at every forward decision).
    models: Mapping[str, ModelSummary] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PeerStatus:
    """One peer for metrics and status: summary age (s; ``None``: never had one), its size (bytes on the
    wire, digests summarised, the largest queue wait it published over its models), whether it is fresh
    and the peer up, and egress used so far."""

    cluster: str
    summary_age_s: float | None
    summary_bytes: int
    summary_entries: int
    fresh: bool
    up: bool
    egress_requests: int
    egress_bytes: int
    queue_wait_s: float = 0.0


class Federation:
    def __init__(self, config: FederationConfig) -> None:
        self.config = config
        self.links = LinkTable(config)
        self._received: dict[str, Received] = {}
        self._health: dict[str, PeerHealth] = {}
        self._budgets: dict[str, tuple[Link, EgressBudget]] = {}

    @property
    def cluster(self) -> str:
        return self.config.cluster

    # -- summaries ------------------------------------------------------------------------------------

    def received(self, report: Report, now: float, size_bytes: int = 0) -> bool:
        """Keep ``report`` if it comes from a linked cluster (the shell checked the sender's identity)."""
        if self.links.get(report.cluster) is None:
            return False
        by_model = {s.model: s for s in reversed(report.models)}  # the first of a model, as before
        self._received[report.cluster] = Received(report, now, size_bytes, by_model)
        return True

    def _ttl(self, r: Received) -> float:
        return min(self.config.ttl_s, r.report.ttl_s)

    def summary(self, cluster: str, model: str, now: float) -> ModelSummary | None:
        """``cluster``'s summary of ``model`` if younger than the TTL (the smaller of ours and its)."""
        r = self._received.get(cluster)
        if r is None or now - r.at > self._ttl(r):
            return None
        return r.models.get(model)

    # -- health and budgets ---------------------------------------------------------------------------

    def _peer_health(self, cluster: str) -> PeerHealth:
        h = self._health.get(cluster)
        if h is None:
            h = self._health[cluster] = PeerHealth(self.config.down_base_s, self.config.down_max_s)
        return h

    def up(self, cluster: str, now: float) -> bool:
        return self._peer_health(cluster).usable(now)

    def observe(self, cluster: str, outcome: Outcome, now: float) -> None:
        """A forwarded request's outcome, or the summary stream's failure (UNREACHABLE)."""
        self._peer_health(cluster).observe(outcome, now)

    def _budget(self, link: Link, now: float) -> EgressBudget:
        held = self._budgets.get(link.cluster)
        if held is None or held[0] != link:  # a changed link gets a fresh budget at its new rates
            held = (link, EgressBudget(link.egress_requests_per_s, link.egress_bytes_per_s, now))
            self._budgets[link.cluster] = held
        return held[1]

    # -- the decision ---------------------------------------------------------------------------------

    def candidates(self, model: str, now: float) -> list[Candidate]:
        out: list[Candidate] = []
        for link in self.links.links().values():
            r = self._received.get(link.cluster)
            age = 0.0 if r is None else now - r.at
            summary = self.summary(link.cluster, model, now)
            out.append(Candidate(link, summary, self.up(link.cluster, now), age))
        return out

    def worth_hashing(self, prompt_blocks: int, local_lead: int, block_size: int) -> bool:
        """Whether the prompt is long enough that some link could win (so the shell may skip hashing the
        whole chain): the saving if a peer held all of it beats the shortest round trip plus the margin."""
        links = self.links.links().values()
        if not links or prompt_blocks < self.config.min_blocks:
            return False
        best = (prompt_blocks - local_lead) * block_size * self.config.prefill_s_per_token
        return best > min(link.rtt_ms for link in links) / 1000.0 + self.config.margin_s

    def decide(
        self,
        model: str,
        digests: Sequence[Digest],
        local_lead: int,
        block_size: int,
        body_bytes: int,
        inbound: Inbound,
        now: float,
        allowed: frozenset[str] | None = None,
    ) -> Verdict:
        """Forward to a peer, or not (:mod:`extproc.federation.decision`). A forwarded request never is.
        ``allowed``: the request's EPP subset hint (``ip:port``); only a peer whose ingress it lists may
        be picked."""
        if inbound.final:
            return Verdict(None, HOP)
        candidates = self.candidates(model, now)
        if allowed is not None:
            candidates = [c for c in candidates if c.link.ingress in allowed]
        found, reason = gains(
            digests,
            local_lead,
            block_size,
            candidates,
            prefill_s_per_token=self.config.prefill_s_per_token,
            margin_s=self.config.margin_s,
            min_blocks=self.config.min_blocks,
        )
        if not found:
            return Verdict(None, reason)
        for g in found:
            if self._budget(g.link, now).take(body_bytes, now):
                return Verdict(g.link, FORWARD, g.lead, g.net_s)
        return Verdict(None, BUDGET, found[0].lead, found[0].net_s)

    # -- status ---------------------------------------------------------------------------------------

    def status(self, now: float) -> list[PeerStatus]:
        out: list[PeerStatus] = []
        for link in self.links.links().values():
            r = self._received.get(link.cluster)
            budget = self._budgets.get(link.cluster)
            out.append(
                PeerStatus(
                    cluster=link.cluster,
                    summary_age_s=None if r is None else now - r.at,
                    summary_bytes=0 if r is None else r.size_bytes,
                    summary_entries=0 if r is None else sum(s.entries for s in r.report.models),
                    fresh=r is not None and now - r.at <= self._ttl(r),
                    up=self.up(link.cluster, now),
                    egress_requests=0 if budget is None else budget[1].requests,
                    egress_bytes=0 if budget is None else budget[1].bytes,
                    queue_wait_s=0.0
                    if r is None
                    else max((m.queue_wait_s for m in r.report.models), default=0.0),
                )
            )
        return out
