"""The fleet: which engine endpoints exist, what they serve, and their latest load signals.

Plain data and bookkeeping, no IO and no clock reads: scrapers, config loaders and (later) the etcd
watcher write into a :class:`Fleet`; the scheduler reads :class:`EndpointState` snapshots from it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from contracts.events import EndpointId
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics

ROUTED_HALF_LIFE_S = 30.0
"""Half-life of :meth:`EndpointState.recent_routed` (the ``balance`` filter's window)."""


@dataclass(slots=True)
class EndpointState:
    """Live state of an endpoint as the scheduler sees it.

    ``healthy`` is False after failed scrapes; ``draining`` stops new requests; ``in_flight`` counts
    this gateway's open ext_proc streams for the endpoint (Envoy closes a stream as soon as it has nothing
    more to send it, which for the bundled config is right after routing: so this is not the engine's
    load); ``routed_since_scrape`` counts requests routed there since the last successful scrape;
    ``metrics`` is ``None`` until the first scrape or when the last one is older than the staleness bound
    (see :meth:`Fleet.expire_metrics`).
    """

    endpoint: Endpoint
    healthy: bool = True
    draining: bool = False
    in_flight: int = 0
    routed_since_scrape: int = 0
    metrics: EngineMetrics | None = None
    routed_decayed: float = field(default=0.0, repr=False)
    routed_at: float = field(default=0.0, repr=False)
    consecutive_failures: int = field(default=0, repr=False)

    @property
    def load(self) -> float:
        """Requests at the engine now, best estimate: its ``running + waiting`` at the last scrape plus
        what this gateway routed there since; without metrics, this gateway's open streams."""
        metrics = self.metrics
        if metrics is None:
            return float(max(self.in_flight, self.routed_since_scrape))
        return metrics.running + metrics.waiting + self.routed_since_scrape

    def recent_routed(self, now: float) -> float:
        """Requests this gateway routed here lately: each counts ``2 ** (-age / ROUTED_HALF_LIFE_S)``, so
        the figure is about the requests of the last ``1.44 x`` half-life (the endpoint's recent share)."""
        if self.routed_decayed <= 0.0:
            return 0.0
        return self.routed_decayed * math.pow(2.0, -max(0.0, now - self.routed_at) / ROUTED_HALF_LIFE_S)

    def count_routed(self, now: float, delta: float = 1.0) -> None:
        """Add ``delta`` requests (``-1``: one moved elsewhere) to :meth:`recent_routed` at ``now``."""
        self.routed_decayed = max(0.0, self.recent_routed(now) + delta)
        self.routed_at = max(now, self.routed_at)

    @property
    def id(self) -> EndpointId:
        return self.endpoint.id

    @property
    def address(self) -> str:
        return self.endpoint.address


class Fleet:
    """The set of known endpoints keyed by id, plus address -> id for the response path."""

    def __init__(self, endpoints: Iterable[Endpoint] = ()) -> None:
        self._states: dict[EndpointId, EndpointState] = {}
        self._by_address: dict[str, EndpointId] = {}
        for ep in endpoints:
            self.upsert(ep)

    def upsert(self, endpoint: Endpoint) -> EndpointState:
        """Add an endpoint or replace its static description, keeping its live state."""
        state = self._states.get(endpoint.id)
        if state is None:
            state = EndpointState(endpoint)
            self._states[endpoint.id] = state
        else:
            self._by_address.pop(state.endpoint.address, None)
            state.endpoint = endpoint
        self._by_address[endpoint.address] = endpoint.id
        return state

    def remove(self, endpoint_id: EndpointId) -> None:
        state = self._states.pop(endpoint_id, None)
        if state is not None:
            self._by_address.pop(state.endpoint.address, None)

    def get(self, endpoint_id: EndpointId) -> EndpointState | None:
        return self._states.get(endpoint_id)

    def by_address(self, address: str) -> EndpointState | None:
        endpoint_id = self._by_address.get(address)
        return None if endpoint_id is None else self._states.get(endpoint_id)

    def __iter__(self) -> Iterator[EndpointState]:
        return iter(self._states.values())

    def __len__(self) -> int:
        return len(self._states)

    def models(self) -> list[str]:
        """Every model name served by at least one endpoint, sorted."""
        return sorted({m for s in self._states.values() for m in s.endpoint.models})

    def record_scrape(
        self, endpoint_id: EndpointId, metrics: EngineMetrics, routed_before: int | None = None
    ) -> None:
        """Store a scrape. ``routed_before``: ``routed_since_scrape`` when the scrape was sent; only those
        requests are now in the engine's running/waiting (``None``: all of them are)."""
        state = self._states.get(endpoint_id)
        if state is not None:
            state.metrics = metrics
            state.healthy = True
            state.consecutive_failures = 0
            counted = state.routed_since_scrape if routed_before is None else routed_before
            state.routed_since_scrape = max(0, state.routed_since_scrape - counted)

    def record_scrape_failure(self, endpoint_id: EndpointId, unhealthy_after: int) -> None:
        """Count a failed scrape; after ``unhealthy_after`` in a row the endpoint is unhealthy."""
        state = self._states.get(endpoint_id)
        if state is not None:
            state.consecutive_failures += 1
            if state.consecutive_failures >= unhealthy_after:
                state.healthy = False

    def expire_metrics(self, now: float, stale_after: float) -> None:
        """Forget metrics older than ``stale_after`` seconds so scorers treat them as missing."""
        for state in self._states.values():
            if state.metrics is not None and now - state.metrics.at > stale_after:
                state.metrics = None
