"""The gateway's shared view of the cluster: etcd control plane, agents' event feeds, and policy.

:class:`Cluster` wires three sources into the gateway's fleet, index and router:

- the policy (:mod:`extproc.control.policy`): the embedded default from the gateway config, overridden by a
  local policy file (``[policy] file``) and by etcd ``policy/`` and ``models/`` keys when ``[etcd]`` is set;
  every change that passes validation is applied at once (scheduling profile, per-model routes, block size,
  speculative TTL); a refused one leaves the last good policy in force;
- the fleet: static ``[[endpoints]]`` plus the agents' leased ``endpoints/<id>`` entries and ``drain/<id>``
  flags (:class:`extproc.control.plane.ControlPlane`);
- the agents' feeds (:class:`extproc.control.feeds.FeedManager`): each endpoint registered with a ``feed``
  address gets its load (and, in ``precise`` index mode, its KV events) from that stream; in precise mode
  the feeds of the nodes' kvcached daemons (etcd ``kvcached/<node>``) too, which the router's ``kv-tier``
  scorer reads through :meth:`extproc.index.hybrid.HybridIndex.node_leads`.

When etcd is unreachable the gateway keeps routing on the last fleet and policy it had; the control plane
reconnects and resynchronises by itself.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from contracts.errors import ConfigError
from contracts.events import EndpointId, IndexEvent, node_store_endpoint
from extproc.config import GatewayConfig
from extproc.control.feeds import FeedManager
from extproc.control.plane import ControlPlane
from extproc.control.policy import Policy, PolicyStore, load_policy_file
from extproc.fleet import Fleet
from extproc.index.hybrid import HybridIndex
from extproc.index.interface import PrefixIndex
from extproc.models.registry import ModelRegistry
from extproc.routing.router import Route, Router
from extproc.scheduling.registry import build_profile
from runtime.tls import ClientTlsFiles, channel_credentials

log = logging.getLogger(__name__)

SYNC_TIMEOUT_S = 2.0
"""How long start waits for the first etcd read before serving on the static fleet alone."""


class _NoIndexEvents:
    """The feed target in ``approximate`` mode: index events are ignored (loads still apply)."""

    def apply(self, events: Sequence[IndexEvent], now: float) -> None:
        return None

    def clear_endpoint(self, endpoint: EndpointId) -> None:
        return None


class Cluster:
    """Keeps the fleet, index and router in step with etcd, the agents' feeds and the policy."""

    def __init__(
        self,
        config: GatewayConfig,
        fleet: Fleet,
        index: PrefixIndex,
        router: Router,
        models: ModelRegistry,
    ) -> None:
        self.config = config
        self.fleet, self.index, self.router = fleet, index, router
        self._models = models
        self._static = frozenset(e.id for e in config.endpoints)
        self._known: set[EndpointId] = {s.id for s in fleet}
        self._stores: set[str] = set()  # nodes whose kvcached feeds are followed
        self.store = PolicyStore.from_config(config)
        if config.policy_file:
            # A bad file fails the start (ConfigError): nothing half-applied, the operator sees why.
            self.store.load(load_policy_file(Path(config.policy_file)))
        self.policy_changes = 0
        self.apply_policy(self.store.policy)
        target = index if isinstance(index, HybridIndex) else _NoIndexEvents()
        fd = config.feeds
        credentials = None
        if fd.tls_ca and fd.tls_cert and fd.tls_key:
            credentials = channel_credentials(
                ClientTlsFiles(ca=Path(fd.tls_ca), cert=Path(fd.tls_cert), key=Path(fd.tls_key))
            )
        self.feeds = FeedManager(
            target, fleet, subscriber=f"extproc@{socket.gethostname()}:{os.getpid()}", credentials=credentials
        )
        self.control: ControlPlane | None = None
        if config.etcd is not None:
            self.control = ControlPlane(
                config.etcd,
                fleet,
                self.store,
                on_policy=self.apply_policy,
                on_fleet_change=self.fleet_changed,
                static_ids=self._static,
            )

    async def start(self) -> None:
        """Follow etcd (waiting briefly for the first read) and subscribe to the feeds it names."""
        if self.control is not None:
            await self.control.start()
            if not await self.control.wait_synced(SYNC_TIMEOUT_S):
                log.warning("etcd not reachable yet: serving the static fleet until it is")
        self.fleet_changed()

    async def aclose(self) -> None:
        if self.control is not None:
            await self.control.aclose()
        await self.feeds.aclose()

    def fleet_changed(self) -> None:
        """Endpoints came or went: forget removed ones in the index, place each endpoint in the precise
        or approximate part of the index, follow the feeds the fleet names."""
        current = {s.id for s in self.fleet}
        for gone in self._known - current:
            self.index.drop_endpoint(gone)
        self._known = current
        stores = dict(self.control.core.kvcached_feeds) if self.control is not None else {}
        if isinstance(self.index, HybridIndex):
            for state in self.fleet:
                self.index.set_precise(state.id, state.endpoint.kv_events)
            # Each node's kvcached reports under a pseudo endpoint (contracts.events.node_store_endpoint).
            for node in self._stores - stores.keys():
                self.index.drop_endpoint(EndpointId(node_store_endpoint(node)))
            for node in stores:
                self.index.set_precise(EndpointId(node_store_endpoint(node)), True)
            self.router.node_stores = frozenset(stores)
        self._stores = set(stores)
        feeds = {s.endpoint.feed for s in self.fleet if s.endpoint.feed}
        self.feeds.set_addresses(feeds | {feed for feed in stores.values() if feed})

    def apply_policy(self, policy: Policy) -> None:
        """Put a validated policy in force: profile, per-model routes, block size, speculative TTL."""
        router = self.router
        max_fallbacks = self.config.extproc.max_fallbacks
        try:
            profile = build_profile(policy.scheduling, max_fallbacks=max_fallbacks)
            routes = {
                model: Route(
                    tuple(sorted(route.labels)),
                    build_profile(policy.scheduling, route.profile, max_fallbacks=max_fallbacks),
                )
                for model, route in policy.routes.items()
            }
        except ConfigError as exc:  # the store validated it; a failure here is a bug, keep the old one
            log.error("policy not applied, the previous one stays: %s", exc)
            return
        router.profile = profile
        router.routes = routes
        if policy.block_size != router.block_size:
            router.block_size = policy.block_size
            router.models = self._models = self._models.with_block_size(policy.block_size)
            log.info("index block size now %d tokens: prefixes are relearned", policy.block_size)
        if isinstance(self.index, HybridIndex):
            self.index.precise.speculative_ttl_s = policy.speculative_ttl_s
        self.policy_changes += 1
        weights = ", ".join(f"{r.ref}={r.weight}" for r in policy.scheduling.profiles[0].plugins if r.weight)
        log.info("policy %d in force: %s; %d model routes", self.policy_changes, weights, len(routes))
