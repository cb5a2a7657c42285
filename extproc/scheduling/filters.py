"""Filters: each narrows the candidate endpoints of one request (formulas in README.md).

``model``, ``healthy`` and ``subset`` may leave no candidate: the caller then answers 503.
``load-threshold`` never empties the list: when every candidate is overloaded it keeps them all and lets
the scorers choose the least bad one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from extproc.fleet import EndpointState
from extproc.scheduling.interface import CycleState, SchedulingRequest


class ModelFilter:
    """Keeps endpoints that serve ``request.model``."""

    __slots__ = ("name",)

    def __init__(self, name: str = "model") -> None:
        self.name = name

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        model = request.model
        return [c for c in candidates if model in c.endpoint.models]


class HealthyFilter:
    """Keeps endpoints that are healthy (recent scrapes succeed) and not draining."""

    __slots__ = ("name",)

    def __init__(self, name: str = "healthy") -> None:
        self.name = name

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        return [c for c in candidates if c.healthy and not c.draining]


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
            return list(candidates)
        return [c for c in candidates if c.endpoint.address in subset]


@dataclass(frozen=True, slots=True)
class LoadThresholdParams:
    """Limits above which an endpoint counts as overloaded.

    ``max_waiting``: queued requests (engine ``waiting`` metric). ``max_kv_usage``: KV cache fraction in
    use, 0..1 (above 1 disables the check). ``max_in_flight``: requests this gateway has routed there and
    not seen finish; ``None``: no limit.
    """

    max_waiting: float = 8.0
    max_kv_usage: float = 0.95
    max_in_flight: int | None = None

    def __post_init__(self) -> None:
        if not self.max_waiting >= 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting!r}")
        if not self.max_kv_usage >= 0:
            raise ValueError(f"max_kv_usage must be >= 0, got {self.max_kv_usage!r}")
        if self.max_in_flight is not None and self.max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {self.max_in_flight!r}")


class LoadThresholdFilter:
    """Drops overloaded endpoints, unless that would drop every candidate.

    An endpoint is overloaded when ``waiting > max_waiting``, or ``kv_usage > max_kv_usage``, or
    ``in_flight > max_in_flight``. Missing metrics never make an endpoint overloaded. Keeping the full list
    when all are overloaded is deliberate: with a hot prefix, this filter is what moves traffic off an
    overloaded owner onto a replica with room, and never turns a busy fleet into a 503.
    """

    __slots__ = ("name", "params")

    def __init__(self, name: str = "load-threshold", params: LoadThresholdParams | None = None) -> None:
        self.name = name
        self.params = params or LoadThresholdParams()

    def overloaded(self, candidate: EndpointState) -> bool:
        """Whether ``candidate`` is over one of the limits."""
        p = self.params
        if p.max_in_flight is not None and candidate.in_flight > p.max_in_flight:
            return True
        metrics = candidate.metrics
        if metrics is None:
            return False
        if metrics.waiting > p.max_waiting:
            return True
        return metrics.kv_usage is not None and metrics.kv_usage > p.max_kv_usage

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        kept = [c for c in candidates if not self.overloaded(c)]
        return kept if kept else list(candidates)
