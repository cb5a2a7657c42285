"""The gateway's side of the agents' and kvcached daemons' index-event feeds: one subscription per feed
address, applied to the index and the fleet.

:class:`FeedManager` runs a :class:`~runtime.feed.client.FeedClient` per feed address (``Endpoint.feed``, and
each node's kvcached) and applies what they receive: index events to an :class:`EventIndex` (the precise
index), ``Load`` events to the fleet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import grpc

from contracts import events as ev
from contracts.events import NODE_STORE_PREFIX, Batch, Cleared, EndpointId, IndexEvent, Load
from engines.metrics import EngineMetrics, LoraState
from extproc.fleet import EndpointState, Fleet
from extproc.scheduling.energy import EnergyModel, average_watts, node_watts
from runtime.feed.client import FeedClient, FeedStats
from runtime.tls import ReloadingClientCerts

log = logging.getLogger(__name__)


class EventIndex(Protocol):
    """The part of the precise index the feeds write to (``extproc.index.precise``)."""

    def apply(self, events: list[IndexEvent], now: float) -> object: ...
    def clear_endpoint(self, endpoint: EndpointId) -> object: ...


@dataclass(frozen=True, slots=True)
class FeedView:
    """One feed as the status page shows it: its ``address``; whether a stream is ``connected``; the
    ``endpoints`` it spoke of; ``age_s``: seconds since its last batch was applied (``None``: none yet);
    ``staleness_s``: how old that batch was when applied (the agent's wall clock to this gateway's,
    seconds; ``None``: unknown); ``last_error``: why its last stream broke (empty: never)."""

    address: str
    connected: bool
    endpoints: tuple[str, ...]
    age_s: float | None
    staleness_s: float | None
    last_error: str


class _Feed:
    """The manager's handler for one address, remembering which endpoints the feed spoke of, and when
    (monotonic seconds) and how stale (seconds) its last batch was applied."""

    def __init__(self, manager: FeedManager, address: str) -> None:
        self.manager = manager
        self.address = address
        self.endpoints: set[EndpointId] = set()
        self.applied_at: float | None = None
        self.staleness_s: float | None = None

    def on_batch(self, batch: Batch) -> None:
        self.manager._apply(self, batch)

    def on_reset(self, source: str, endpoints: frozenset[EndpointId]) -> None:
        owns = self.manager.owns
        for endpoint in self.endpoints | endpoints:
            if owns(self.address, endpoint):
                self.manager.index.clear_endpoint(endpoint)
        self.endpoints = {e for e in endpoints if owns(self.address, e)}
        log.info("feed %s (%s): snapshot of %d endpoints", self.address, source, len(endpoints))

    def on_lost(self, address: str) -> None:
        self.manager._set_lost(self, lost=True)

    def on_restored(self, address: str) -> None:
        self.manager._set_lost(self, lost=False)


class FeedManager:
    """One :class:`FeedClient` per feed address, applying what they receive.

    A feed speaks only for the endpoints it owns (:meth:`owns`): those registered with its address as
    ``Endpoint.feed``, and the node store ``kvcached:<node>`` of the node whose kvcached record names it
    (:attr:`stores`). An event naming an endpoint registered with another feed is dropped and counted
    (``stats.foreign``, logged once per feed and endpoint): an agent, compromised or misconfigured, cannot
    add or remove another node's blocks, set its load, health or drain, clear it with its snapshots, or
    mark it unhealthy by going away. An event naming an endpoint registered nowhere is dropped too (the
    index ignores an endpoint's events until its registration marks it precise); once the fleet names a
    followed feed for a new event-fed endpoint, that feed is read again from a snapshot
    (:meth:`set_addresses`), so what it said of the endpoint before its registration is not lost.

    Index events go to ``index`` (``apply(events, now)``; a snapshot first clears every endpoint the
    feed spoke of and owns); each ``Load`` (one :func:`contracts.events.load_problem` refuses is counted in
    ``stats.malformed`` and skipped) updates the fleet: its metrics (``at`` = ``clock()``, monotonic
    seconds), ``healthy``, and ``draining`` (set from the agent; cleared only if the agent had set it,
    so a drain ordered elsewhere stays), its node's power readings (:meth:`Fleet.record_power`); GPU
    telemetry is kept in :attr:`gpus`. A lost feed marks its
    endpoints unhealthy; a restored one gives them back the health their last ``Load`` reported.

    A restarted engine is a new replica to the scheduler: when an agent brings back (unhealthy, then
    healthy) an endpoint it had cleared since its last healthy ``Load`` (outside a snapshot: what an agent
    sends when its engine exits), the endpoint's routed share (:meth:`EndpointState.recent_routed`) starts
    again from 0, as a new endpoint's does. Kept, the crashed process's share held the ``balance`` filter
    shut while the replicas that held a shared prefix took every request: a simulated vLLM its agent
    saw ready 2.9 s after SIGKILL got its first request 21.9 s after the kill (16 clients, a 500-token
    system prompt, 3 agents); with the share restarted, 0.03 s after it was ready. An engine that comes
    back with its cache (a hang that ended) keeps its share.
    Must be used on one event loop (clients are started by :meth:`set_addresses`).
    """

    def __init__(
        self,
        index: EventIndex,
        fleet: Fleet,
        *,
        subscriber: str,
        credentials: grpc.ChannelCredentials | ReloadingClientCerts | None = None,
        server_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        stats: FeedStats | None = None,
    ) -> None:
        self.index, self.fleet = index, fleet
        self.stats = stats if stats is not None else FeedStats()
        #: Latest ``Load`` per endpoint of the fleet (:meth:`forget` drops those that left).
        self.loads: dict[EndpointId, Load] = {}
        #: Energy per output token of each node, learnt from the power readings and tokens/s of its loads.
        self.energy = EnergyModel()
        self._energy_at: dict[str, float] = {}
        #: The reading each node's energy was last learnt from (its mean draw since then comes from the
        #: energy counter: :func:`~extproc.scheduling.energy.average_watts`).
        self._energy_last: dict[str, ev.Power] = {}
        self._subscriber, self._credentials, self._server_name = subscriber, credentials, server_name
        self._clock, self._wall = clock, wall
        #: The running clients by address (read only).
        self.clients: dict[str, FeedClient] = {}
        self._feeds: dict[str, _Feed] = {}
        self._draining: set[EndpointId] = set()
        #: Endpoints their agent cleared (outside a snapshot) since their last healthy ``Load``.
        self._emptied: set[EndpointId] = set()
        self._closing: set[asyncio.Task[None]] = set()
        #: Endpoints a refused ``Load`` was logged for (once each; every one is counted).
        self._malformed_logged: set[EndpointId] = set()
        #: The feed address of each node's kvcached (``kvcached/<node>`` records): the one feed that may
        #: report the node store ``kvcached:<node>`` (set by the caller before :meth:`set_addresses`).
        self.stores: dict[str, str] = {}
        #: (feed, endpoint) pairs a foreign event was logged for (once each; every one is counted).
        self._foreign_logged: set[tuple[str, EndpointId]] = set()
        #: The event-fed endpoints the fleet registered with each feed at the last :meth:`set_addresses`.
        self._owned: dict[str, frozenset[EndpointId]] = {}

    def owns(self, address: str, endpoint: EndpointId) -> bool:
        """Whether the feed at ``address`` speaks for ``endpoint`` (class docstring)."""
        if endpoint.startswith(NODE_STORE_PREFIX):
            return self.stores.get(endpoint[len(NODE_STORE_PREFIX) :]) == address
        state = self.fleet.get(endpoint)
        return state is not None and state.endpoint.feed == address

    def _registered(self, endpoint: EndpointId) -> bool:
        """Whether ``endpoint`` is registered (in the fleet, or a node store with a kvcached record)."""
        if endpoint.startswith(NODE_STORE_PREFIX):
            return endpoint[len(NODE_STORE_PREFIX) :] in self.stores
        return self.fleet.get(endpoint) is not None

    def _foreign(self, feed: _Feed, endpoint: EndpointId) -> bool:
        """Whether ``feed`` must not speak for ``endpoint``; one registered with another feed is counted."""
        if self.owns(feed.address, endpoint):
            return False
        if self._registered(endpoint):
            self.stats.foreign += 1
            key = (feed.address, endpoint)
            if key not in self._foreign_logged and len(self._foreign_logged) < 1024:
                self._foreign_logged.add(key)
                log.warning("feed %s: dropped events for %s, registered with another feed", *key)
        return True

    def sync(self) -> None:
        """Follow the fleet: :meth:`set_addresses` with every ``Endpoint.feed`` it names."""
        self.set_addresses({s.endpoint.feed for s in self.fleet if s.endpoint.feed})

    def set_addresses(self, addresses: Iterable[str]) -> None:
        """Start clients for new addresses and stop those of addresses gone; the index entries of a
        stopped feed's endpoints are cleared (nothing keeps them current any more). A followed feed the
        fleet now names for an event-fed endpoint it did not is read again from a snapshot
        (:meth:`FeedClient.resync`): what the feed said of that endpoint before (an engine's catch-up,
        sent before its registration reached this gateway) was dropped."""
        wanted = set(addresses)
        owned: dict[str, set[EndpointId]] = {}
        for state in self.fleet:
            if state.endpoint.feed and state.endpoint.kv_events:
                owned.setdefault(state.endpoint.feed, set()).add(state.id)
        for address, client in self.clients.items():
            new = owned.get(address, set()) - self._owned.get(address, frozenset())
            if new and address in wanted and client.tracker.epoch is not None:
                log.info("feed %s: now feeds %s: reading it again from a snapshot", address, sorted(new))
                client.resync()
        self._owned = {address: frozenset(ids) for address, ids in owned.items()}
        for address in sorted(self.clients.keys() - wanted):
            client = self.clients.pop(address)
            feed = self._feeds.pop(address)
            for endpoint in feed.endpoints:
                if self.owns(address, endpoint) or not self._registered(endpoint):  # not another feed's
                    self.index.clear_endpoint(endpoint)
            self._emptied -= feed.endpoints
            task = asyncio.create_task(client.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            log.info("feed %s: unsubscribed", address)
        for address in sorted(wanted - self.clients.keys()):
            feed = _Feed(self, address)
            client = FeedClient(
                address,
                feed,
                subscriber=self._subscriber,
                stats=self.stats,
                credentials=self._credentials,
                server_name=self._server_name,
                wall=self._wall,
            )
            self._feeds[address] = feed
            self.clients[address] = client
            client.start()

    async def aclose(self) -> None:
        clients = list(self.clients.values())
        self.clients.clear()
        self._feeds.clear()
        await asyncio.gather(*(c.aclose() for c in clients), *self._closing)

    def views(self, now: float) -> list[FeedView]:
        """Every feed, by address (``now``: monotonic seconds, for :attr:`FeedView.age_s`)."""
        views = []
        for address, feed in sorted(self._feeds.items()):
            client = self.clients.get(address)
            views.append(
                FeedView(
                    address=address,
                    connected=client is not None and client.connected,
                    endpoints=tuple(sorted(feed.endpoints)),
                    age_s=None if feed.applied_at is None else max(0.0, now - feed.applied_at),
                    staleness_s=feed.staleness_s,
                    last_error=client.last_error if client is not None else "",
                )
            )
        return views

    def _apply(self, feed: _Feed, batch: Batch) -> None:
        now = self._clock()
        feed.applied_at = now
        if batch.ts > 0:
            feed.staleness_s = self._wall() - batch.ts
        index_events: list[IndexEvent] = []
        for event in batch.events:
            endpoint = EndpointId(event.endpoint)
            if self._foreign(feed, endpoint):
                continue
            feed.endpoints.add(endpoint)
            if isinstance(event, Load):
                problem = ev.load_problem(event)
                if problem is None:
                    self._apply_load(endpoint, event, now)
                else:  # refused: the endpoint keeps its last good load (and ages like a silent one)
                    self.stats.malformed += 1
                    if endpoint not in self._malformed_logged and len(self._malformed_logged) < 1024:
                        self._malformed_logged.add(endpoint)
                        log.warning("feed %s: refused a load of %s: %s", feed.address, endpoint, problem)
                continue
            if isinstance(event, Cleared) and event.tier is None and not batch.snapshot:
                self._emptied.add(endpoint)
            index_events.append(event)
        if index_events:
            self.index.apply(index_events, now)

    def forget(self) -> None:
        """The fleet changed: drop what is kept per endpoint for those no longer in it, and the energy
        state of nodes with no endpoint left (a fleet with churn keeps nothing of names gone)."""
        current = {s.id for s in self.fleet}
        nodes = {s.endpoint.node or s.id for s in self.fleet}
        for gone in [e for e in self.loads if e not in current]:
            del self.loads[gone]
        self._emptied &= current
        self._draining &= current
        self._malformed_logged &= current
        for node in [n for n in self._energy_at if n not in nodes]:
            self._energy_at.pop(node, None)
            self._energy_last.pop(node, None)
            self.energy.forget(node)

    def _apply_load(self, endpoint: EndpointId, load: Load, now: float) -> None:
        state = self.fleet.get(endpoint)
        if state is not None:  # one outside the fleet (not yet, or no longer, registered) keeps nothing
            self.loads[endpoint] = load
        if load.healthy and endpoint in self._emptied:
            self._emptied.discard(endpoint)
            if state is not None and not state.healthy:  # back from a restart (class docstring)
                self.fleet.restarted(endpoint)
                log.info("endpoint %s back after a restart: its routed share starts again", endpoint)
        if state is None:
            return
        self.fleet.record_power(endpoint, tuple(load.power), now)
        state.output_tps = load.output_tps if load.healthy else None
        self._learn_energy(state, now)
        if load.healthy:  # an unhealthy engine's numbers mean nothing
            lora = None
            if load.lora_running is not None or load.max_lora is not None or load.lora_slots_used is not None:
                lora = LoraState(
                    frozenset(load.lora_running or ()),
                    frozenset(load.lora_waiting or ()),
                    load.max_lora,
                    load.lora_slots_used,
                )
            counted = load.prefix_hits is not None and load.prefix_queries is not None
            metrics = EngineMetrics(
                load.waiting,
                load.running,
                load.kv_usage,
                now,
                prefix_hits=load.prefix_hits if counted else None,  # the drift alarm's counters
                prefix_queries=load.prefix_queries if counted else None,
                lora=lora,
            )
            self.fleet.record_scrape(endpoint, metrics)
        elif state.healthy:
            log.warning("endpoint %s unhealthy: reported by its agent", endpoint)
        self.fleet.set_state(endpoint, healthy=load.healthy)
        if load.draining:
            self.fleet.set_state(endpoint, draining=True)
            self._draining.add(endpoint)
        elif endpoint in self._draining:
            self.fleet.set_state(endpoint, draining=False)
            self._draining.discard(endpoint)

    def _learn_energy(self, state: EndpointState, now: float) -> None:
        """A new power reading of ``state``'s node feeds the node's energy model, and every endpoint of
        the node gets its estimate (J per output token; :mod:`extproc.scheduling.energy`). The same reading
        arrives with each of the node's loads: it counts once."""
        reading = node_watts(state.power)
        node = state.endpoint.node or state.id
        if reading is None or reading.watts is None or reading.at <= self._energy_at.get(node, -1.0):
            return
        self._energy_at[node] = reading.at
        previous, self._energy_last[node] = self._energy_last.get(node), reading
        watts = average_watts(previous, reading)
        states = self.fleet.node_states(node)
        rates = [s.output_tps for s in states if s.output_tps is not None]
        if not rates or watts is None:
            return
        tps = sum(rates)
        running = [s.metrics.running for s in states if s.metrics is not None]
        self.energy.observe(
            node, watts, tps, now, reading_at=reading.at, running=sum(running) if running else None
        )
        estimate, curve = self.energy.marginal(node, watts, tps), self.energy.curve(node)
        for s in states:
            s.energy_per_token, s.power_curve = estimate, curve

    def _set_lost(self, feed: _Feed, *, lost: bool) -> None:
        endpoints = {e for e in feed.endpoints if self.owns(feed.address, e)}
        endpoints |= {s.id for s in self.fleet if s.endpoint.feed == feed.address}
        for endpoint in endpoints:
            last = self.loads.get(endpoint)
            self.fleet.set_state(endpoint, healthy=not lost and (last is None or last.healthy))
        log.info("feed %s %s: %d endpoints", feed.address, "lost" if lost else "restored", len(endpoints))
