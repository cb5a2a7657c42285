"""Filters: each narrows the candidate endpoints of one request (formulas in README.md).

``model``, ``healthy`` and ``subset`` may leave no candidate: the caller then answers 503.
``load-threshold`` never empties the list: when every candidate is overloaded it keeps them all and lets
the scorers choose the least bad one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from extproc.fleet import EndpointState
from extproc.scheduling.interface import Candidates, CycleState, SchedulingRequest


def _narrowed(candidates: Sequence[EndpointState], kept: list[EndpointState]) -> list[EndpointState]:
    """``kept`` (a sub-list of ``candidates``), or ``candidates`` itself as :class:`Candidates` when nothing
    was dropped, so the columns computed so far stay with it."""
    return kept if len(kept) < len(candidates) else Candidates.of(candidates)


class ModelFilter:
    """Keeps endpoints that serve ``request.model``."""

    __slots__ = ("name",)

    def __init__(self, name: str = "model") -> None:
        self.name = name

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        model = request.model
        return _narrowed(candidates, [c for c in candidates if model in c.endpoint.models])


class HealthyFilter:
    """Keeps endpoints that are healthy (recent scrapes succeed), not draining, and not ejected at
    ``request.now`` (a failed try keeps an endpoint out for a while: :mod:`extproc.xds.ejection`)."""

    __slots__ = ("name",)

    def __init__(self, name: str = "healthy") -> None:
        self.name = name

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        now = request.now
        return _narrowed(
            candidates, [c for c in candidates if c.healthy and not c.draining and c.ejected_until <= now]
        )


class SubsetFilter:
    """Keeps endpoints whose ``ip:port`` is in ``request.subset`` (the EPP subset hint); no hint: all.

    An empty hint, or one naming no candidate, leaves nothing: the protocol answers 503 then.
    """

    __slots__ = ("name",)

    def __init__(self, name: str = "subset") -> None:
        self.name = name

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        subset = request.subset
        if subset is None:
            return Candidates.of(candidates)
        return _narrowed(candidates, [c for c in candidates if c.endpoint.address in subset])


@dataclass(frozen=True, slots=True)
class LoadThresholdParams:
    """Limits above which an endpoint counts as overloaded.

    ``max_waiting``: queued requests (engine ``waiting`` metric). ``max_in_flight``: requests at the
    engine (:attr:`EndpointState.load`: running + waiting + routed since the last scrape); ``None``: no
    absolute limit. ``max_in_flight_ratio`` and
    ``in_flight_slack``: the relative limit ``in_flight > ratio x mean in-flight of the candidates + slack``
    (``None``: off); it is what stops a prefix every request shares (an agent's system prompt and tools)
    from piling all traffic onto the replicas that happen to hold it, and lets it spread to more.
    ``exact_in_flight_ratio``: the ratio in place of ``max_in_flight_ratio`` when the cycle's leads are
    exact (``CycleState.exact``: a precise index, where the ``balance`` filter spreads a lead that every
    request shares by each replica's recent share); ``None``: ``max_in_flight_ratio`` then too, and no
    relative limit at all while ``max_in_flight_ratio`` is ``None``. Looser there because what it also
    trips on is an owner's load fluctuating over a fair share, and each trip sends a request whose prefix
    only that owner holds to a replica that recomputes it (measured, BENCHMARKS.md "Routing quality",
    2026-11-30: kvgate-precise with 2.0 against 1.5, the default run and the sweep's variants).
    ``max_waiting_ratio`` and ``waiting_slack``: ``waiting > max_waiting`` counts only when it is also
    ``> ratio x mean waiting of the candidates + slack`` (``None``: the absolute limit alone). When the
    whole fleet queues, a replica a few requests over ``max_waiting`` has no better place to send its
    prefix: moving it would only recompute the prefix elsewhere and evict what that replica held.
    Measured (BENCHMARKS.md, shared-prefix, 128 concurrent sessions): with the absolute limit alone the
    filter flapped between replicas near it: hit ratio 0.28, 275 output tokens/s; with the ratio 0.53, 393.
    ``max_kv_usage``: KV cache fraction in use, 0..1; ``None`` (the default): not checked, because vLLM's
    ``kv_cache_usage_perc`` counts blocks pinned by running requests, so a busy prefix owner routinely
    reads above 0.95 without being overloaded. Measured (BENCHMARKS.md, shared-prefix at 16 req/s): with
    the check at 0.95 the filter evicted exactly the owners and the hit ratio fell from 0.83 to 0.64.
    """

    max_waiting: float = 8.0
    max_kv_usage: float | None = None
    max_in_flight: int | None = None
    max_in_flight_ratio: float | None = 1.5
    in_flight_slack: float = 2.0
    exact_in_flight_ratio: float | None = 2.0
    max_waiting_ratio: float | None = 1.5
    waiting_slack: float = 2.0

    def __post_init__(self) -> None:
        if not self.max_waiting >= 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting!r}")
        if self.max_kv_usage is not None and not self.max_kv_usage >= 0:
            raise ValueError(f"max_kv_usage must be >= 0, got {self.max_kv_usage!r}")
        if self.max_in_flight is not None and self.max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {self.max_in_flight!r}")
        if self.max_in_flight_ratio is not None and not 1.0 <= self.max_in_flight_ratio < float("inf"):
            raise ValueError(f"max_in_flight_ratio must be finite and >= 1, got {self.max_in_flight_ratio!r}")
        if self.exact_in_flight_ratio is not None and not 1.0 <= self.exact_in_flight_ratio < float("inf"):
            raise ValueError(
                f"exact_in_flight_ratio must be finite and >= 1, got {self.exact_in_flight_ratio!r}"
            )
        if not 0 <= self.in_flight_slack < float("inf"):
            raise ValueError(f"in_flight_slack must be finite and >= 0, got {self.in_flight_slack!r}")
        if self.max_waiting_ratio is not None and not 1.0 <= self.max_waiting_ratio < float("inf"):
            raise ValueError(f"max_waiting_ratio must be finite and >= 1, got {self.max_waiting_ratio!r}")
        if not 0 <= self.waiting_slack < float("inf"):
            raise ValueError(f"waiting_slack must be finite and >= 0, got {self.waiting_slack!r}")


class LoadThresholdFilter:
    """Drops overloaded endpoints, unless that would drop every candidate.

    An endpoint is overloaded when ``waiting > max_waiting`` and (with ``max_waiting_ratio``)
    ``waiting > max_waiting_ratio x mean waiting + waiting_slack``, or ``kv_usage > max_kv_usage`` (when
    set), or ``in_flight > max_in_flight`` (when set), or ``in_flight > max_in_flight_ratio x mean +
    in_flight_slack`` (``exact_in_flight_ratio`` in place of the ratio when ``state.exact``); each mean
    over the candidates. Missing metrics never make an endpoint overloaded.
    Keeping the full list when all are overloaded is deliberate: with a hot prefix, this filter is what
    moves traffic off an overloaded owner onto a replica with room, and never turns a busy fleet into a 503.
    """

    __slots__ = ("name", "params")
    #: A preference: what it drops may still be a fallback (scheduling/interface.py Filter).
    soft = True

    def __init__(self, name: str = "load-threshold", params: LoadThresholdParams | None = None) -> None:
        self.name = name
        self.params = params or LoadThresholdParams()

    def limits(
        self, mean_in_flight: float = 0.0, mean_waiting: float = 0.0, exact: bool = False
    ) -> tuple[float, float]:
        """The in-flight and waiting figures above which an endpoint is overloaded, for these means over
        the candidates and leads ``exact`` or not (each limit of :class:`LoadThresholdParams` that is set,
        the lowest applying)."""
        p = self.params
        in_flight = math.inf if p.max_in_flight is None else float(p.max_in_flight)
        ratio = p.max_in_flight_ratio
        if ratio is not None and exact and p.exact_in_flight_ratio is not None:
            ratio = p.exact_in_flight_ratio
        if ratio is not None:
            in_flight = min(in_flight, ratio * mean_in_flight + p.in_flight_slack)
        waiting = p.max_waiting
        if p.max_waiting_ratio is not None:
            waiting = max(waiting, p.max_waiting_ratio * mean_waiting + p.waiting_slack)
        return in_flight, waiting

    def overloaded(
        self,
        candidate: EndpointState,
        mean_in_flight: float = 0.0,
        mean_waiting: float = 0.0,
        exact: bool = False,
    ) -> bool:
        """Whether ``candidate`` is over one of the limits (the means: over the candidates)."""
        max_in_flight, max_waiting = self.limits(mean_in_flight, mean_waiting, exact)
        return self._over(candidate, candidate.load, max_in_flight, max_waiting)

    def _over(self, candidate: EndpointState, load: float, max_in_flight: float, max_waiting: float) -> bool:
        if load > max_in_flight:
            return True
        metrics = candidate.metrics
        if metrics is None:
            return False
        if metrics.waiting > max_waiting:
            return True
        max_kv_usage = self.params.max_kv_usage
        return max_kv_usage is not None and metrics.kv_usage is not None and metrics.kv_usage > max_kv_usage

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        cands = Candidates.of(candidates)
        loads = cands.loads  # per-cycle columns: each load computed once, shared with the scorers
        waiting = cands.waiting  # NaN without metrics: never over the limit, not in the mean
        mean = sum(loads) / len(loads) if loads else 0.0
        finite = list(filter(math.isfinite, waiting))
        mean_waiting = sum(finite) / len(finite) if finite else 0.0
        max_in_flight, max_waiting = self.limits(mean, mean_waiting, state.exact)
        max_kv_usage = self.params.max_kv_usage
        # _over, inlined: ``not x > limit`` as _over tests it (NaN waiting: not over)
        keep = [not (load > max_in_flight or w > max_waiting) for load, w in zip(loads, waiting, strict=True)]
        if max_kv_usage is not None:
            keep = [
                k
                and (
                    (metrics := c.metrics) is None
                    or metrics.kv_usage is None
                    or not metrics.kv_usage > max_kv_usage
                )
                for k, c in zip(keep, cands, strict=True)
            ]
        kept = keep.count(True)
        return cands.select(keep) if 0 < kept < len(cands) else cands


@dataclass(frozen=True, slots=True)
class BalanceParams:
    """``max_share_ratio`` and ``share_slack``: an endpoint is over its share when its recently routed
    requests (:meth:`EndpointState.recent_routed`) exceed the least candidate's by more than
    ``max(slack, (ratio - 1) x mean over the candidates)``. Measured from the least, not the mean, so no
    replica sits idle: against the mean, ``ratio x`` would let ``N / ratio`` replicas take everything.
    ``min_lead_blocks``: an endpoint over its share is still kept for a request whose cached lead on it
    is at least this many blocks longer than on any other candidate (what only it holds: a session's own
    history, a prefix no other replica has).

    Why 2.0 and not tighter: a replica that serves cache hits finishes sooner, so in a closed loop (and
    any saturated fleet) it takes more requests without being busier. At 1.3 the filter read that as over
    its share and moved prefixes off their owners onto replicas that had to recompute them and evict
    others (shared-prefix, 128 concurrent sessions: hit ratio 0.53 and 393 output tokens/s at 1.3, 0.64
    and 507 at 2.0); the agentic spread it exists for stays (busiest/mean 1.07 at 1.3, 1.17 at 2.0;
    BENCHMARKS.md)."""

    max_share_ratio: float = 2.0
    share_slack: float = 2.0
    min_lead_blocks: int = 8

    def __post_init__(self) -> None:
        if not 1.0 <= self.max_share_ratio < float("inf"):
            raise ValueError(f"max_share_ratio must be finite and >= 1, got {self.max_share_ratio!r}")
        if not 0 <= self.share_slack < float("inf"):
            raise ValueError(f"share_slack must be finite and >= 0, got {self.share_slack!r}")
        if self.min_lead_blocks < 1:
            raise ValueError(f"min_lead_blocks must be >= 1, got {self.min_lead_blocks!r}")


class BalanceFilter:
    """Keeps requests that any of several replicas could serve as well from piling onto a few of them.

    Drops an endpoint that is over its share of recently routed requests (see :class:`BalanceParams`)
    unless it holds a lead of the request's prefix that no other candidate comes close to. A prefix that
    every request shares (an agent's system prompt and tools) matches equally on every replica holding
    it, so it no longer pins new sessions to the first replicas that computed it: they spread, paying one
    prefill of the shared part on each replica once, while each session's follow-ups (whose history only
    its own replica holds) stay put. Never empties the list.

    Acts only when ``state.exact`` (every candidate's lead comes from engine KV events). The approximate
    index remembers where it routed and never sees an eviction, so a prefix looks held by replicas that
    dropped it; balancing between such false holders sent requests to cold replicas (shared-prefix at 24
    req/s: TTFT p90 2.54 s with the filter, 1.52 s without; with exact leads 1.14 s; BENCHMARKS.md).
    """

    __slots__ = ("name", "params")
    #: A preference: what it drops may still be a fallback (scheduling/interface.py Filter).
    soft = True

    def __init__(self, name: str = "balance", params: BalanceParams | None = None) -> None:
        self.name = name
        self.params = params or BalanceParams()

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        if len(candidates) < 2 or not state.exact:
            return Candidates.of(candidates)
        p = self.params
        now = request.now
        shares = [c.recent_routed(now) for c in candidates]
        mean = sum(shares) / len(shares)
        limit = min(shares) + max(p.share_slack, (p.max_share_ratio - 1.0) * mean)
        if max(shares) <= limit:
            return Candidates.of(candidates)
        matched = state.prefix_blocks
        leads = [max(0, matched.get(c.id, 0)) for c in candidates]
        best = max(leads)
        holders = leads.count(best)
        second = max((lead for lead in leads if lead < best), default=0) if holders == 1 else best
        kept = [
            c
            for c, share, lead in zip(candidates, shares, leads, strict=True)
            if share <= limit or lead - (second if lead == best else best) >= p.min_lead_blocks
        ]
        return _narrowed(candidates, kept) if kept else Candidates.of(candidates)


class SLOFilter:
    """Prefers endpoints predicted to send the first token within the request's TTFT budget.

    Keeps the candidates whose ``state.predicted_ttft`` is at most ``request.ttft_budget_s``; when the
    request has no budget, no candidate has a prediction, or none is predicted to meet it, keeps them all
    (flow control decides whether an unattainable request is shed: :mod:`extproc.scheduling.predict`).
    Soft: an endpoint it drops may still be a fallback.
    """

    __slots__ = ("name",)
    #: A preference: what it drops may still be a fallback (scheduling/interface.py Filter).
    soft = True

    def __init__(self, name: str = "slo") -> None:
        self.name = name

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        budget = request.ttft_budget_s
        predicted = state.predicted_ttft
        if budget is None or not predicted:
            return Candidates.of(candidates)
        kept = [c for c in candidates if predicted.get(c.id, math.inf) <= budget]
        return _narrowed(candidates, kept) if kept else Candidates.of(candidates)
