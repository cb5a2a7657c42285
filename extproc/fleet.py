"""The fleet: which engine endpoints exist, what they serve, and their latest load signals.

Plain data and bookkeeping, no IO and no clock reads: scrapers, config loaders and (later) the etcd
watcher write into a :class:`Fleet`; the scheduler reads :class:`EndpointState` snapshots from it.
Watchers (:meth:`Fleet.watch`, the EDS server) hear of the changes the fleet's own methods make.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from contracts.config import canonical_address
from contracts.events import EndpointId, Power
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics

ROUTED_HALF_LIFE_S = 30.0
"""Half-life of :meth:`EndpointState.recent_routed` (the ``balance`` filter's window)."""
MAX_LORA_RECENT = 64
"""Adapters remembered per endpoint in :attr:`EndpointState.lora_recent` (the oldest are forgotten)."""


@dataclass(frozen=True, slots=True)
class PowerCurve:
    """One node's fitted power curve (:meth:`extproc.scheduling.energy.EnergyModel.curve`; kept here, with
    the state that holds it): ``idle_w`` (W, no work), ``wake_w`` (W an active GPU draws above idle before
    any token: busy intercept - idle), ``k`` (J per output token on a busy node: the busy line's slope),
    ``seq_tps`` (output tokens/s of one sequence there; ``None``: unknown, then ``busy_tps``, the busy
    readings' mean tokens/s, stands in, which understates the wake cost per token)."""

    idle_w: float
    wake_w: float
    k: float
    seq_tps: float | None
    busy_tps: float

    def cost(self, running: float) -> float:
        """Marginal energy per output token (J/token) of one more request on a node running ``running``
        requests: ``(P(with) - P(without)) x t / tokens``. The request runs ``t = tokens / seq_tps``
        seconds; the GPU is awake anyway until its running requests end, which for ``n`` requests with
        remaining times spread evenly over ``[0, t]`` is ``t x n / (n + 1)`` on average, so the request
        keeps it awake ``t / (n + 1)`` longer: ``k + wake_w / (seq_tps x (n + 1))``. Idle (``n = 0``): the
        whole wake-up, ``k + wake_w / seq_tps``; a busy node tends to ``k``."""
        rate = self.seq_tps if self.seq_tps is not None else self.busy_tps
        n = max(0.0, running) if math.isfinite(running) else 0.0
        return self.k + self.wake_w / (max(rate, 1e-9) * (n + 1.0))


@dataclass(slots=True, weakref_slot=True)
class EndpointState:
    """Live state of an endpoint as the scheduler sees it.

    ``healthy`` is False after failed scrapes; ``draining`` stops new requests; ``in_flight`` counts
    this gateway's open ext_proc streams for the endpoint (Envoy closes a stream as soon as it has nothing
    more to send it, which for the bundled config is right after routing: so this is not the engine's
    load); ``routed_since_scrape`` counts requests routed there since the last successful scrape, and
    ``completed_since_scrape`` the requests this gateway routed there (at any time) whose completion
    Envoy reported since then (:meth:`~extproc.routing.router.Router.completed`); ``metrics`` is
    ``None`` until the first scrape or when the last one is older than the staleness bound (see
    :meth:`Fleet.expire_metrics`); ``ejected_until``: monotonic seconds until which the endpoint is
    not picked after a failed try (:meth:`Fleet.eject`; 0: never ejected).

    Weakly referable: a plugin's per-endpoint state can go with the endpoint's state object (the
    ``power-cap`` filter's latch forgets an endpoint removed from the fleet).
    """

    endpoint: Endpoint
    healthy: bool = True
    draining: bool = False
    in_flight: int = 0
    routed_since_scrape: int = 0
    completed_since_scrape: int = 0
    #: Requests this gateway routed here whose completion it has not heard yet (exact for its own
    #: traffic; flow control's in-flight limit never counts fewer).
    outstanding: int = 0
    metrics: EngineMetrics | None = None
    routed_decayed: float = field(default=0.0, repr=False)
    routed_at: float = field(default=0.0, repr=False)
    consecutive_failures: int = field(default=0, repr=False)
    ejected_until: float = 0.0
    #: Nothing listened at its address at the last scrape (refused): the process that answers next is a
    #: new one, with an empty cache.
    vanished: bool = field(default=False, repr=False)
    #: The sibling workers' ``in_flight`` and net routed count (:attr:`net_routed`) for this endpoint,
    #: summed (other ext_proc processes of this host, :mod:`extproc.control.siblings`; 0 without
    #: siblings; the net may be negative).
    sibling_in_flight: int = 0
    sibling_routed: int = 0
    #: The latest power readings of the endpoint's node, one per source its agent reads
    #: (:class:`contracts.events.Power`: watts, cap, temperature, throttling; a source's ``error`` set
    #: means it is silent); ``()`` without readings or once they are older than the staleness bound.
    power: tuple[Power, ...] = ()
    #: Monotonic seconds when :attr:`power` arrived.
    power_at: float = field(default=0.0, repr=False)
    #: Output tokens/s of the engine as its agent last measured them (``None``: unknown).
    output_tps: float | None = None
    #: Marginal energy per output token of the endpoint's node (J/token), as
    #: :class:`extproc.scheduling.energy.EnergyModel` estimates it from the node's watts and output tokens/s
    #: (``None``: not enough telemetry); the ``power`` scorer reads it.
    energy_per_token: float | None = None
    #: The node's power curve (idle draw, wake-up draw, J/token when busy, one sequence's tokens/s) from the
    #: same telemetry (:meth:`extproc.scheduling.energy.EnergyModel.curve`; ``None``: not enough); the
    #: ``marginal-energy`` scorer reads it.
    power_curve: PowerCurve | None = None
    #: LoRA adapter -> monotonic seconds when it was last known on the endpoint: in a reading's running or
    #: waiting adapters (:class:`engines.metrics.LoraState`) or routed there (:meth:`saw_adapter`); its
    #: ``max_lora`` most recent entries approximate the engine's slot table (extproc/scheduling/lora.py).
    lora_recent: dict[str, float] = field(default_factory=dict, repr=False)

    def saw_adapter(self, adapter: str, now: float) -> None:
        """``adapter`` is on the endpoint at ``now`` (a reading named it, or a request for it went there)."""
        recent = self.lora_recent
        recent[adapter] = max(now, recent.pop(adapter, now))  # re-inserted: the newest last
        if len(recent) > MAX_LORA_RECENT:
            del recent[min(recent, key=recent.__getitem__)]

    @property
    def net_routed(self) -> int:
        """This gateway's ``routed_since_scrape - completed_since_scrape``: what it added to the engine's
        queue since the last scrape (negative when more of its requests ended than it sent since)."""
        return self.routed_since_scrape - self.completed_since_scrape

    @property
    def load(self) -> float:
        """Requests at the engine now, best estimate, never below 0. With metrics:
        ``running + waiting + net``, where ``net = net_routed + sibling_routed`` is what this gateway and
        its sibling workers routed there since their own last scrapes minus their requests whose
        completion they heard of since. Without metrics: ``max(in_flight + sibling_in_flight, net)``
        (the counts run from the last scrape, or from the start when there was none: then ``net`` is
        exactly the requests routed there and not yet complete)."""
        metrics = self.metrics
        net = self.routed_since_scrape - self.completed_since_scrape + self.sibling_routed
        if metrics is None:
            return float(max(self.in_flight + self.sibling_in_flight, net, 0))
        load = metrics.running + metrics.waiting + net
        # No max() nor float() call (``+ 0.0``: the same float); loads_of inlines this, keep them alike.
        return load + 0.0 if load > 0 else 0.0

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

    def ejected(self, now: float) -> bool:
        """Whether a failed try keeps the endpoint out of picks at ``now`` (monotonic seconds)."""
        return now < self.ejected_until

    @property
    def id(self) -> EndpointId:
        return self.endpoint.id

    @property
    def address(self) -> str:
        return self.endpoint.address


def loads_of(states: Iterable[EndpointState]) -> list[float]:
    """``[s.load for s in states]`` (the same floats: :attr:`EndpointState.load`) with the formula inlined
    for states with metrics, so no property call per state: the scheduling cycle's ``loads`` column."""
    return [
        s.load
        if (m := s.metrics) is None
        else (
            load + 0.0
            if (
                load := m.running
                + m.waiting
                + (s.routed_since_scrape - s.completed_since_scrape + s.sibling_routed)
            )
            > 0
            else 0.0
        )
        for s in states
    ]


class Fleet:
    """The set of known endpoints keyed by id, plus address -> id for the response path.

    Its methods call every watcher (:meth:`watch`) after a change of membership, address, health, drain
    or ejection: every writer goes through them (:meth:`set_state` for the feeds and etcd).
    """

    def __init__(self, endpoints: Iterable[Endpoint] = ()) -> None:
        self._states: dict[EndpointId, EndpointState] = {}
        self._by_address: dict[str, EndpointId] = {}
        self._watchers: list[Callable[[], None]] = []
        #: Called after each new load reading (a scrape or a feed's ``Load``): capacity may have freed.
        self.on_reading: Callable[[], None] | None = None
        for ep in endpoints:
            self.upsert(ep)

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` (synchronously, so keep it cheap) after each change; returns the unwatch."""
        self._watchers.append(callback)
        return lambda: self._watchers.remove(callback)

    def _changed(self) -> None:
        for callback in list(self._watchers):
            callback()

    def upsert(self, endpoint: Endpoint) -> EndpointState:
        """Add an endpoint or replace its static description, keeping its live state."""
        state = self._states.get(endpoint.id)
        if state is None:
            state = EndpointState(endpoint)
            self._states[endpoint.id] = state
        else:
            self._forget_address(state.endpoint)
            state.endpoint = endpoint
        self._by_address[canonical_address(endpoint.address)] = endpoint.id
        self._changed()
        return state

    def remove(self, endpoint_id: EndpointId) -> None:
        state = self._states.pop(endpoint_id, None)
        if state is not None:
            self._forget_address(state.endpoint)
            self._changed()

    def _forget_address(self, endpoint: Endpoint) -> None:
        """Drop ``endpoint``'s address mapping, unless another endpoint took that address since (a new pod
        at a reused IP, registered before the old one left): it stays that one's."""
        key = canonical_address(endpoint.address)
        if self._by_address.get(key) == endpoint.id:
            del self._by_address[key]

    def set_state(
        self, endpoint_id: EndpointId, *, healthy: bool | None = None, draining: bool | None = None
    ) -> None:
        """Health and/or drain as a control source reports them (an agent's feed, etcd ``drain/``); the
        watchers hear of a change."""
        state = self._states.get(endpoint_id)
        if state is None:
            return
        changed = False
        if healthy is not None and healthy != state.healthy:
            state.healthy, changed = healthy, True
        if draining is not None and draining != state.draining:
            state.draining, changed = draining, True
        if changed:
            self._changed()

    def restarted(self, endpoint_id: EndpointId) -> None:
        """A new process answers at the endpoint (its cache empty): to the scheduler a new replica, whose
        routed share starts from 0. Kept, the dead process's share held the ``balance`` filter shut while
        the replicas holding a shared prefix took every request."""
        state = self._states.get(endpoint_id)
        if state is not None:
            state.routed_decayed = 0.0

    def eject(self, endpoint_id: EndpointId, until: float) -> None:
        """Keep the endpoint out of picks until ``until`` (monotonic seconds; never shortens one)."""
        state = self._states.get(endpoint_id)
        if state is not None and until > state.ejected_until:
            state.ejected_until = until
            self._changed()

    def get(self, endpoint_id: EndpointId) -> EndpointState | None:
        return self._states.get(endpoint_id)

    def by_address(self, address: str) -> EndpointState | None:
        endpoint_id = self._by_address.get(canonical_address(address))
        return None if endpoint_id is None else self._states.get(endpoint_id)

    def __iter__(self) -> Iterator[EndpointState]:
        return iter(self._states.values())

    def __len__(self) -> int:
        return len(self._states)

    def models(self) -> list[str]:
        """Every model name served by at least one endpoint, sorted."""
        return sorted({m for s in self._states.values() for m in s.endpoint.models})

    def record_scrape(
        self,
        endpoint_id: EndpointId,
        metrics: EngineMetrics,
        routed_before: int | None = None,
        completed_before: int | None = None,
    ) -> None:
        """Store a scrape. ``routed_before``: ``routed_since_scrape`` when the scrape was sent; only those
        requests are now in the engine's running/waiting (``None``: all of them are).
        ``completed_before``: ``completed_since_scrape`` when the scrape was sent; only those requests
        are gone from the engine's counts (``None``: all of them are)."""
        state = self._states.get(endpoint_id)
        if state is not None:
            recovered = not state.healthy
            if state.vanished:
                self.restarted(endpoint_id)
                state.vanished = False
            state.metrics = metrics
            if metrics.lora is not None:
                for adapter in metrics.lora.active:
                    state.saw_adapter(adapter, metrics.at)
            state.healthy = True
            state.consecutive_failures = 0
            counted = state.routed_since_scrape if routed_before is None else routed_before
            state.routed_since_scrape = max(0, state.routed_since_scrape - counted)
            done = state.completed_since_scrape if completed_before is None else completed_before
            state.completed_since_scrape = max(0, state.completed_since_scrape - done)
            if recovered:
                self._changed()
            if self.on_reading is not None:
                self.on_reading()

    def record_scrape_failure(
        self, endpoint_id: EndpointId, unhealthy_after: int, gone: bool = False
    ) -> None:
        """Count a failed scrape; after ``unhealthy_after`` in a row the endpoint is unhealthy. ``gone``:
        the connection was refused (no process listens), so the next one to answer is a new process."""
        state = self._states.get(endpoint_id)
        if state is not None:
            state.vanished = state.vanished or gone
            state.consecutive_failures += 1
            if state.consecutive_failures >= unhealthy_after and state.healthy:
                state.healthy = False
                self._changed()

    def record_power(self, endpoint_id: EndpointId, power: tuple[Power, ...], now: float) -> None:
        """Store the power readings an agent sent with the endpoint's load, received at ``now``
        (monotonic seconds)."""
        state = self._states.get(endpoint_id)
        if state is not None:
            state.power, state.power_at = power, now

    def node_states(self, node: str) -> list[EndpointState]:
        """The endpoints of node ``node`` (an endpoint without a node is a node of its own, by its id)."""
        return [s for s in self._states.values() if (s.endpoint.node or s.id) == node]

    def expire_metrics(self, now: float, stale_after: float) -> None:
        """Forget metrics and power readings older than ``stale_after`` seconds so scorers treat them as
        missing."""
        for state in self._states.values():
            if state.metrics is not None and now - state.metrics.at > stale_after:
                state.metrics = None
            if state.power and now - state.power_at > stale_after:
                state.power, state.energy_per_token, state.power_curve = (), None, None
