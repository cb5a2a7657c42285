"""The gateway's shared view of the cluster: etcd control plane, agents' event feeds, and policy.

:class:`Cluster` wires three sources into the gateway's fleet, index and router:

- the policy (:mod:`extproc.control.policy`): the embedded default from the gateway config, overridden by a
  local policy file (``[policy] file``) and by etcd ``policy/``, ``models/`` and ``objectives/`` keys when
  ``[etcd]`` is set; every change that passes validation is applied at once (scheduling profile, per-model
  routes, block size, speculative TTL, and the flow policy handed to :attr:`Cluster.flow_listener`); a
  refused one leaves the last good policy in force;
- the fleet: static ``[[endpoints]]`` plus the agents' leased ``endpoints/<id>`` entries and ``drain/<id>``
  flags (:class:`extproc.control.plane.ControlPlane`), plus, with ``[inference_pool]``, the ready pods of a
  Kubernetes InferencePool that no agent registered (:mod:`extproc.inferencepool`);
- admission (:meth:`Cluster.share_admission`): etcd ``tenants/<id>`` into the gate's tenant set, and the
  token counters replicas share under ``usage/<tenant>/<replica>`` (:class:`extproc.control.usage.UsageSync`);
- the agents' feeds (:class:`extproc.control.feeds.FeedManager`): each endpoint registered with a ``feed``
  address gets its load (and, in ``precise`` index mode, its KV events) from that stream; in precise mode
  the feeds of the nodes' kvcached daemons (etcd ``kvcached/<node>``) too, which the router's ``kv-tier``
  scorer reads through :meth:`extproc.index.hybrid.HybridIndex.node_leads`. The index decides what an
  event may change (:class:`~extproc.index.hybrid.HybridIndex` ignores every event in approximate mode).

When etcd is unreachable the gateway keeps routing on the last fleet and policy it had; the control plane
reconnects and resynchronises by itself.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from contracts.errors import ConfigError
from contracts.etcd import TENANTS, USAGE
from contracts.events import EndpointId, node_store_endpoint
from extproc.config import GatewayConfig
from extproc.control.feeds import FeedManager
from extproc.control.plane import ControlPlane, FamilySink
from extproc.control.policy import Policy, PolicyStore, routing_policy
from extproc.control.usage import Ledger, UsageSync
from extproc.fleet import Fleet
from extproc.flow.policy import FlowPolicy
from extproc.index.hybrid import HybridIndex
from extproc.inferencepool.core import PoolView
from extproc.inferencepool.merge import PoolSync
from extproc.routing.router import Router
from runtime.tls import ClientTlsFiles, ReloadingClientCerts

if TYPE_CHECKING:
    from extproc.inferencepool.watch import PoolWatcher

log = logging.getLogger(__name__)

SYNC_TIMEOUT_S = 2.0
"""How long start waits for the first etcd read before serving on the static fleet alone."""


class Cluster:
    """Keeps the fleet, index and router in step with etcd, the agents' feeds and the policy (``store``:
    the gateway's, :func:`~extproc.control.policy.gateway_policy`).

    ``flow_listener``: called (on the event loop, must not block) with the flow policy each time a policy
    is put in force; ``None`` at construction, so whoever sets it reads :attr:`flow_policy` first.
    """

    def __init__(
        self,
        config: GatewayConfig,
        fleet: Fleet,
        index: HybridIndex,
        router: Router,
        store: PolicyStore,
    ) -> None:
        self.config = config
        self.fleet, self.index, self.router = fleet, index, router
        self._static = frozenset(e.id for e in config.endpoints)
        self._known: set[EndpointId] = {s.id for s in fleet}
        self._stores: set[str] = set()  # nodes whose kvcached feeds are followed
        self.store = store
        self.policy_changes = 0
        self.flow_listener: Callable[[FlowPolicy], None] | None = None
        #: Called (on the event loop) with each policy put in force, for the disaggregation policy.
        self.pd_listener: Callable[[Policy], None] | None = None
        self._flow = store.policy.flow
        self.apply_policy(self.store.policy)
        fd = config.feeds
        credentials = None
        if fd.tls_ca and fd.tls_cert and fd.tls_key:  # each new subscription presents the current pair
            credentials = ReloadingClientCerts(
                ClientTlsFiles(ca=Path(fd.tls_ca), cert=Path(fd.tls_cert), key=Path(fd.tls_key)),
                where="feeds",
            )
        self.feeds = FeedManager(
            index,
            fleet,
            subscriber=f"extproc@{socket.gethostname()}:{os.getpid()}",
            credentials=credentials,
            server_name=fd.server_name,
        )
        self.control: ControlPlane | None = None
        #: The shared token budgets' etcd side (``None``: no ``[etcd]``, or no :meth:`share_admission`).
        self.usage: UsageSync | None = None
        #: The fleet part from a Kubernetes InferencePool's pods (``None``: no ``[inference_pool]``).
        self.pool: PoolSync | None = None
        self.pool_watcher: PoolWatcher | None = None
        if config.inference_pool is not None:
            from extproc.inferencepool.watch import PoolWatcher  # here: the API client takes 0.7 s to import

            self.pool = PoolSync(
                fleet,
                agents_outside_pool=config.inference_pool.agents_outside_pool,
                agent_node_is_pod=config.inference_pool.agent_node_is_pod,
            )
            self.pool_watcher = PoolWatcher(config.inference_pool, self._pool_view)
        if config.etcd is not None:
            self.control = ControlPlane(
                config.etcd,
                fleet,
                self.store,
                on_policy=self.apply_policy,
                on_fleet_change=self.fleet_changed,
                static_ids=self._static,
            )
            if self.pool is not None:  # an agent's record takes over its pod's pool endpoint, and
                self.control.core.yields = self.pool.owns  # (by default) only a ready pod's is admitted
                self.control.core.admits = self.pool.admits
                self.pool.draining = self.control.core.draining  # kvgate drain reaches pool pods too

    def share_admission(self, tenants: FamilySink, ledger: Ledger, sync_s: float) -> None:
        """With ``[etcd]``, follow ``tenants/`` into ``tenants`` (the gate's
        :class:`~extproc.admission.shared.TenantDirectory`) and share token budgets through ``ledger``,
        publishing every ``sync_s`` seconds; call before :meth:`start`. Without etcd nothing happens:
        tenants stay the file's and budgets stay per replica."""
        if self.control is None:
            return
        self.usage = UsageSync(ledger, sync_s=sync_s)
        self.control.core.follow(TENANTS, tenants)
        self.control.core.follow(USAGE, self.usage)

    async def start(self) -> None:
        """Follow etcd (waiting briefly for the first read) and subscribe to the feeds it names."""
        if self.control is not None:
            await self.control.start()
            if not await self.control.wait_synced(SYNC_TIMEOUT_S):
                log.warning("etcd not reachable yet: serving the static fleet until it is")
            if self.usage is not None and self.control.client is not None:
                settings = self.control.settings
                await self.usage.start(self.control.client, settings.prefix, settings.timeout_s)
        if self.pool_watcher is not None:
            await self.pool_watcher.start()
            if not await self.pool_watcher.wait_synced(SYNC_TIMEOUT_S):
                log.warning("Kubernetes API not reachable yet: serving without the pool's pods until it is")
        self.fleet_changed()

    async def aclose(self) -> None:
        if self.usage is not None:
            await self.usage.aclose()
        if self.pool_watcher is not None:
            await self.pool_watcher.aclose()
        if self.control is not None:
            await self.control.aclose()
        await self.feeds.aclose()

    def fleet_changed(self) -> None:
        """Endpoints came or went: forget removed ones in the index, place each endpoint in the precise
        or approximate part of the index, follow the feeds the fleet names. With an InferencePool, its
        pods' endpoints are merged in first (an agent that came or went takes or gives back its pod's)."""
        if self.pool is not None:
            self.pool.reconcile()
        current = {s.id for s in self.fleet}
        for gone in self._known - current:
            self.index.drop_endpoint(gone)
        if self._known - current:
            self.feeds.forget()
        self._known = current
        stores = dict(self.control.core.kvcached_feeds) if self.control is not None else {}
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
        self.feeds.stores = {node: feed for node, feed in stores.items() if feed}
        self.feeds.set_addresses(feeds | {feed for feed in stores.values() if feed})

    def pool_counters(self) -> dict[str, int]:
        """The InferencePool watcher's counters, ``synced`` (0/1) and ``endpoints`` (the pool's endpoints
        in the fleet now); empty without ``[inference_pool]``."""
        if self.pool_watcher is None or self.pool is None:
            return {}
        return {
            **self.pool_watcher.counters,
            "synced": int(self.pool_watcher.synced),
            "endpoints": len(self.pool.joined),
        }

    def _pool_view(self, view: PoolView) -> None:
        """The pool's endpoints changed (:class:`~extproc.inferencepool.watch.PoolWatcher`)."""
        assert self.pool is not None
        self.pool.set_pool(view.endpoints)
        if self.control is not None:
            self.control.core.readmit()  # agents' records at the addresses of pods that came or went
        self.fleet_changed()

    @property
    def flow_policy(self) -> FlowPolicy:
        """The flow policy in force (that of the last policy :meth:`apply_policy` put in force)."""
        return self._flow

    def apply_policy(self, policy: Policy) -> None:
        """Put a validated policy in force: the router's profile, per-model routes and block size (one
        :class:`~extproc.routing.router.RoutingPolicy`), the index's speculative TTL, and the flow policy
        (:attr:`flow_policy`, handed to :attr:`flow_listener` when set)."""
        try:
            routing = routing_policy(policy, max_fallbacks=self.config.extproc.max_fallbacks)
        except ConfigError as exc:  # the store validated it; a failure here is a bug, keep the old one
            log.error("policy not applied, the previous one stays: %s", exc)
            return
        before = self.router.policy.block_size
        self.router.apply(routing)
        if routing.block_size != before:
            log.info("index block size now %d tokens: prefixes are relearned", routing.block_size)
        self.index.speculative_ttl_s = policy.speculative_ttl_s
        self._flow = policy.flow
        if self.flow_listener is not None:
            self.flow_listener(policy.flow)
        if self.pd_listener is not None:
            self.pd_listener(policy)
        self.policy_changes += 1
        weights = ", ".join(f"{r.ref}={r.weight}" for r in policy.scheduling.profiles[0].plugins if r.weight)
        log.info("policy %d in force: %s; %d model routes", self.policy_changes, weights, len(routing.routes))
