"""``kvgate agent --config node.toml``: one node agent, composing the agent's parts.

For each ``[[engines]]`` entry: an :class:`~agent.supervisor.EngineSupervisor` runs (or, for
``openai_compat``, probes) the engine; once it is ready (a remote engine that answers only after its
``ready_timeout_s``, turned ``unhealthy`` meanwhile, as soon as it answers) the agent registers it in etcd
(``endpoints/<id>`` under the agent's lease, :class:`runtime.etcd.LeasedKeys`), subscribes to its KV
events (:class:`~agent.kvevents.KvEventSubscriber`) and translates them into index events
(:class:`~agent.translate.Translator`), and scrapes its load (:class:`~agent.telemetry.TelemetryLoop`).
The node's power sources (``[[power]]``, :mod:`agent.power`) are read on their own intervals, and their
latest readings go out with every load.
Index events and loads go out on one gRPC stream (:class:`~runtime.feed.server.FeedServer`) that every gateway
replica subscribes to; a subscriber that needs a full resync gets the translators' snapshots.

An engine that crashes loses its cache: its endpoint is reported ``Cleared`` and unhealthy until it is
ready again. First SIGTERM/SIGINT drains: every endpoint is reported draining (gateways stop routing to
it at once), in-flight requests get ``drain_timeout_s`` to finish, the endpoints are deregistered, then
the engines stop. A second signal stops at once. Without ``[etcd]`` the agent runs standalone (the feed
and admin API still serve; a gateway can list the endpoints statically).

Admin HTTP (``admin_listen``): ``GET /healthz`` (the agent runs), ``GET /readyz`` (200 when every engine
is ready), ``GET /status`` (engines, states, addresses, feed position, power sources and their errors, slot
save/restore counters),
``GET /metrics`` (the same as Prometheus text, :mod:`agent.metrics`),
``POST /drain`` (the same drain as SIGTERM, then exit); with ``[agent] kvcached``, ``POST /slots/save``,
``/slots/restore`` and ``/slots/restore-chain`` (llama.cpp slot state through the node's kvcached,
:mod:`agent.slot_api`). Plaintext without ``[agent.tls]`` (bind it to loopback or a management network);
with it, HTTPS with the feed's certificate, and every ``POST`` needs a client certificate that chains to
``client_ca`` (401 without; the ``GET`` routes stay open to probes, :mod:`agent.admin`).

llama.cpp engines of an agent with ``[agent] kvcached``: their slots are saved into kvcached when they
finish a request of at least ``slot_save_min_tokens`` tokens (:mod:`agent.autosave`, watching ``/slots``
through the telemetry poll), and their endpoint record names the agent's ``/slots/restore-chain`` URL
(``slot_restore``: ``http://<advertise>:<admin port>/slots/restore-chain``, ``https://`` with
``[agent.tls]``) so that gateways restore a prefix kvcached holds before they route a request there
(:mod:`extproc.control.restore`, over mTLS with the gateway's ``[feeds]`` client certificate).

KV events and slot chains are hashed in blocks of the gateways' index block size, followed live in etcd
(``policy/index/block_size``, :mod:`agent.blocksize`): when it changes, each engine's endpoint is reported
``Cleared`` and its KV events are translated anew from the engine's replay, in blocks of the new size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from agent.admin import client_cert_required, reloading_server_context
from agent.autosave import SlotAutoSaver
from agent.blocksize import DEFAULT_INDEX_BLOCK_SIZE, IndexBlockSize
from agent.blocksize import PATH as BLOCK_SIZE_PATH
from agent.config import NodeConfig, load_node_config
from agent.errors import AgentError
from agent.kvevents import EventsLost, KvBatch, KvEventSubscriber, SubscriberConfig
from agent.launch import endpoint_for
from agent.metrics import agent_registry
from agent.power.sources import build_monitor
from agent.slot_api import RESTORE_CHAIN_PATH, RestoreStats, SlotAdmin
from agent.supervised import RestartPolicy, supervise
from agent.supervisor import EngineState, EngineSupervisor
from agent.telemetry import EngineScraper, EngineStatus, GpuTelemetry, TelemetryLoop
from agent.translate import Translator
from contracts.errors import ConfigError
from contracts.etcd import endpoint_key, parse_etcd_settings, policy_key
from contracts.events import Cleared, IndexEvent, Load
from contracts.kvcached import MESSAGE_SLACK
from engines.config import EngineConfig
from engines.endpoint import encode_endpoint
from runtime.feed.log import FeedLog
from runtime.feed.server import FeedServer
from runtime.kvcached import DigestCheckedStore, KvcachedClient
from runtime.lifecycle import announce_ready, stop_on_signals, systemd_notify_wanted
from runtime.listen import ListenError, binding
from runtime.tls import ServerTlsFiles
from runtime.tracing.http import traced
from runtime.tracing.tracer import build as build_tracer

if TYPE_CHECKING:
    from runtime.watch import PrefixWatcher

log = logging.getLogger(__name__)
#: Probes and scrapes: never traced.
UNTRACED_PATHS = ("/healthz", "/readyz", "/metrics", "/status")

TELEMETRY_INTERVAL_S = 0.1
#: How long start waits for etcd's ``index/block_size`` before starting engines at the current size.
BLOCK_SIZE_WAIT_S = 2.0
#: Every reading is sent (heartbeat = interval), as often as the gateway scraped engines itself: the
#: gateway's load estimate adds the requests it routed since the last reading, so a reading that is skipped
#: because the engine's numbers did not change (short requests that came and went between two samples)
#: would let that count grow and overstate the load (measured: a hot prefix pushed off its owner).
TELEMETRY_HEARTBEAT_S = TELEMETRY_INTERVAL_S


COALESCE_BATCHES = 64
"""Engine batches received together from which :func:`feed_batches` sends the net state instead."""


def feed_batches(
    translator: Translator, items: Sequence[KvBatch | EventsLost], coalesce_at: int = COALESCE_BATCHES
) -> list[list[IndexEvent]]:
    """The feed batches for ``items`` (one engine's, in order), translated by ``translator``.

    Fewer than ``coalesce_at``: one feed batch per engine batch with events (``EventsLost``: the
    translator's reset, a ``Cleared``). From ``coalesce_at`` on (a replay: the catch-up from seq 0 when
    the agent starts, up to the engine's whole buffer, 10,000 batches by default, or a long gap's): the
    translator takes them all and one feed batch carries the result, ``Cleared`` for the engine and then
    its snapshot, the same holdings in one message. Published one by one, the catch-up of 8 busy
    simulated engines put ~13,000 batches on the feed within 2 s of the agent's start: the gateway fell
    1,024 batches behind, was cut off and resynced, up to three times, while already routing
    (BENCHMARKS.md, routing quality, seventh session).

    A batch the translator fails on (malformed data that decoded) is counted
    (``stats.failed_batches``) and taken as lost events, a ``Cleared``, as an ``EventsLost`` is; the
    engine's later batches are translated (a failure that reached the pump would make it subscribe again,
    replaying the same batch: the engine's KV events would stay dead).
    """
    batches = [_translated(translator, i) for i in items]
    if len(items) >= coalesce_at:
        return [[Cleared(translator.endpoint, None), *translator.snapshot()]]
    return [events for events in batches if events]


def _translated(translator: Translator, item: KvBatch | EventsLost) -> list[IndexEvent]:
    """``item``'s index events; a batch that fails to translate is lost events (:func:`feed_batches`)."""
    if isinstance(item, EventsLost):
        return translator.reset()
    try:
        return translator.apply(item.events)
    except Exception as exc:  # the type only: a message may quote the engine's payload
        translator.stats.failed_batches += 1
        log.warning(
            "engine %s: KV batch %d not translatable (%s): entries cleared",
            translator.endpoint, item.seq, type(exc).__name__,
        )  # fmt: skip
        return translator.reset()


@dataclasses.dataclass(slots=True)
class _Engine:
    """One supervised engine and what the agent runs for it once it is ready."""

    config: EngineConfig
    supervisor: EngineSupervisor
    translator: Translator | None = None
    subscriber: KvEventSubscriber | None = None
    pump: asyncio.Task[None] | None = None
    registered: bool = False
    #: :meth:`Agent._engine_ready` began for the engine's current run (it follows the first ``ready``,
    #: whatever came before: a remote engine that answers late turns ``unhealthy``, then ``ready``);
    #: cleared when the engine goes away, or when ``_engine_ready`` failed (the next ``ready`` retries).
    followed: bool = False
    draining: bool = False
    scraper: EngineScraper | None = None
    #: Automatic slot saves (llama.cpp with ``[agent] kvcached``).
    autosave: SlotAutoSaver | None = None
    #: Held while the engine's KV event subscription is (re)made, so two never overlap.
    kv_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


class Agent:
    """The node agent: supervisors, event translation, feed, telemetry, registration."""

    def __init__(self, config: NodeConfig, *, index_block_size: int | None = None) -> None:
        self.config = config
        #: Spans of the admin and slot API's requests (``[tracing]``); ``None``: tracing off.
        self.tracer = build_tracer(config.tracing)
        #: Prometheus metrics read from :meth:`status` at each ``GET /metrics`` (:mod:`agent.metrics`).
        self._registry = agent_registry(self.status)
        self.node = config.agent.id
        #: Tokens per index block of the KV events and slot chains sent to gateways: the gateways' own
        #: (etcd ``policy/index/block_size``, followed live) unless ``index_block_size`` fixes it.
        self.index_block_size = index_block_size or DEFAULT_INDEX_BLOCK_SIZE
        self._follow_block_size = index_block_size is None
        self._block_size_watch: PrefixWatcher[int] | None = None
        self.feed_log = FeedLog(self.node)
        tls = config.agent.tls
        self.feed = FeedServer(
            self.feed_log,
            self._snapshot,
            listen=config.agent.listen,
            tls=None if tls is None else ServerTlsFiles(Path(tls.cert), Path(tls.key), Path(tls.client_ca)),
        )
        gpus = GpuTelemetry()
        #: The node's power sources (``[[power]]``), each read on its own interval (:mod:`agent.power`).
        self.power = build_monitor(config.power, gpus.read)
        self.telemetry = TelemetryLoop(
            TELEMETRY_INTERVAL_S,
            self.feed.publish,
            heartbeat_s=TELEMETRY_HEARTBEAT_S,
            gpus=gpus,
            power=self.power.readings,
        )
        self.engines: dict[str, _Engine] = {}
        self.feed_address = ""
        self.admin_port = 0
        self._etcd_client: object | None = None
        self._leased: object | None = None
        self._prefix = ""
        self._admin: web.AppRunner | None = None
        #: The node's kvcached (``[agent] kvcached``): llama.cpp slot save/restore routes use it.
        self._kvcached: KvcachedClient | None = None
        #: The slot routes and per-engine slot caches (with ``[agent] kvcached``).
        self.slots: SlotAdmin | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Failures of supervised tasks by (engine, task, exception type): ``kvgate_agent_task_failures``.
        self.task_failures: dict[tuple[str, str, str], int] = {}
        #: When a supervised task that failed runs again (:mod:`agent.supervised`; tests shorten it).
        self.task_restarts = RestartPolicy()
        self.stop_requested = asyncio.Event()
        self._registered = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Serve the feed and admin API, connect to etcd, start every engine (not waiting for them)."""
        await asyncio.to_thread(Path(self.config.agent.state_dir).mkdir, parents=True, exist_ok=True)
        await self.feed.start()
        self.feed_address = _join(self.config.agent.advertise, self.feed.port)
        await self._start_admin()
        if self.config.etcd_raw is not None:
            await self._start_etcd()
        if self.slots is not None:  # slot chains use the gateways' block size, as KV events do
            self.slots.block_size = self.index_block_size
        self.power.start()
        self.telemetry.start()
        for engine in self.config.engines:
            sup = EngineSupervisor(engine, self.config.agent, on_change=self._on_change)
            self.engines[engine.id] = _Engine(engine, sup)
        for eng in self.engines.values():
            await eng.supervisor.start()
        log.info(
            "agent %s: feed on %s, admin on %d, %d engines", self.node, self.feed_address, self.admin_port,
            len(self.engines),
        )  # fmt: skip

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until every engine is ready and registered (:class:`~agent.errors.EngineNotReady`)."""
        await asyncio.gather(*(e.supervisor.wait_ready(timeout_s) for e in self.engines.values()))

        async def registered() -> None:
            while not all(e.registered for e in self.engines.values()):
                self._registered.clear()
                await self._registered.wait()

        await asyncio.wait_for(registered(), timeout_s)

    async def drain(self) -> None:
        """Drain every engine (module docstring), then stop the agent's own services."""
        await asyncio.gather(*(self._drain_engine(e) for e in self.engines.values()))
        await self.aclose()

    async def aclose(self) -> None:
        """Stop everything now (engines get SIGTERM, then SIGKILL after their grace period)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for eng in self.engines.values():
            await self._stop_feed(eng)
            if eng.autosave is not None:
                await eng.autosave.aclose()
        if self.slots is not None:
            await self.slots.aclose()
        await asyncio.gather(*(e.supervisor.aclose() for e in self.engines.values()), return_exceptions=True)
        await self.telemetry.aclose()
        await self.power.aclose()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)
        if self._block_size_watch is not None:
            await self._block_size_watch.aclose()
        if self._leased is not None:
            from runtime.etcd import LeasedKeys

            assert isinstance(self._leased, LeasedKeys)
            await self._leased.aclose(revoke=True)
        if self._etcd_client is not None:
            import etcd3aio

            assert isinstance(self._etcd_client, etcd3aio.Etcd3Client)
            await self._etcd_client.close()
        await self.feed.aclose()
        if self._admin is not None:
            await self._admin.cleanup()
        if self._kvcached is not None:
            await self._kvcached.aclose()

    # -- etcd ------------------------------------------------------------------------------------------

    async def _start_etcd(self) -> None:
        # Imported here: a standalone agent never loads an etcd client library.
        from runtime.etcd import LeasedKeys, connect
        from runtime.watch import PrefixWatcher

        settings = parse_etcd_settings(self.config.etcd_raw, "etcd")
        self._prefix = settings.prefix
        client = await connect(settings)
        self._etcd_client = client
        if self._follow_block_size:
            key = policy_key(settings.prefix, BLOCK_SIZE_PATH)
            watch: PrefixWatcher[int] = PrefixWatcher(
                client,
                key,
                IndexBlockSize(key),
                timeout_s=settings.timeout_s,
                on_applied=self._set_index_block_size,
                name="agent-index-block-size",
            )
            self._block_size_watch = watch
            watch.start()
            if not await watch.wait_synced(BLOCK_SIZE_WAIT_S):
                log.warning(
                    "agent %s: etcd not reachable yet: index block size %d until it is",
                    self.node,
                    self.index_block_size,
                )
        leased = LeasedKeys(client, self.config.agent.lease_ttl_s, timeout_s=settings.timeout_s)
        self._leased = leased
        if not await leased.start({}):
            log.warning("agent %s: etcd not reachable yet; registration retries in the background", self.node)

    def _set_index_block_size(self, size: int) -> None:
        """The gateways' index block size is now ``size`` tokens: slot chains use it at once, and each
        engine's KV events are translated again in blocks of it (:meth:`_translate_again`)."""
        if size == self.index_block_size:
            return
        log.info("agent %s: index block size %d -> %d tokens", self.node, self.index_block_size, size)
        self.index_block_size = size
        if self.slots is not None:
            self.slots.block_size = size
        for eng in self.engines.values():
            if eng.translator is not None:
                self._spawn(self._translate_again(eng), f"block-size-{eng.config.id}")

    async def _translate_again(self, eng: _Engine) -> None:
        """Forget what ``eng`` was reported to hold (a ``Cleared``: those digests are of the old block
        size) and follow its KV events anew from the engine's replay, as at start: the catch-up goes out
        as one snapshot in blocks of the new size (:func:`feed_batches`)."""
        async with eng.kv_lock:
            await self._stop_feed(eng)
            translator, eng.translator = eng.translator, None
            if translator is not None:
                self.feed.publish(translator.reset())
            if eng.supervisor.state is EngineState.READY:
                await self._follow_kv_events(eng)

    async def _register(self, eng: _Engine) -> None:
        launch = eng.supervisor.launch
        assert launch is not None
        if self._leased is not None:
            from runtime.etcd import LeasedKeys

            assert isinstance(self._leased, LeasedKeys)
            # Load travels on the feed: gateways need not scrape the engine (metrics_url None).
            endpoint = dataclasses.replace(
                endpoint_for(eng.config, launch, node=self.node, feed=self.feed_address),
                metrics_url=None,
                slot_restore=self.slot_restore_url(eng.config),
            )
            key = endpoint_key(self._prefix, eng.config.id, self.node)
            await self._leased.update(key, encode_endpoint(endpoint))
        eng.registered = True
        self._registered.set()

    def slot_restore_url(self, engine: EngineConfig) -> str | None:
        """Where gateways ask this agent to restore a prefix into ``engine`` (``None``: not offered)."""
        if self.slots is None or engine.kind != "llama_cpp" or not engine.started:
            return None
        scheme = "http" if self.config.agent.tls is None else "https"
        return f"{scheme}://{_join(self.config.agent.advertise, self.admin_port)}{RESTORE_CHAIN_PATH}"

    async def _deregister(self, eng: _Engine) -> None:
        eng.registered = False
        if self._leased is not None:
            from runtime.etcd import LeasedKeys

            assert isinstance(self._leased, LeasedKeys)
            await self._leased.delete(endpoint_key(self._prefix, eng.config.id, self.node))

    # -- engines ---------------------------------------------------------------------------------------

    def _on_change(self, sup: EngineSupervisor, old: EngineState, new: EngineState) -> None:
        eng = self.engines.get(sup.engine.id)
        if eng is None:
            return
        log.info("engine %s: %s -> %s", sup.engine.id, old.value, new.value)
        if new is EngineState.READY and not eng.followed:  # not a recovery from unhealthy while followed
            eng.followed = True
            self._spawn(self._engine_ready(eng), f"ready-{sup.engine.id}")
        elif new in (EngineState.RESTARTING, EngineState.STOPPED) and old is not EngineState.DRAINING:
            # The process is gone and its KV cache with it.
            eng.followed = False
            if eng.translator is not None:
                self.feed.publish(eng.translator.reset())
            if eng.autosave is not None:
                eng.autosave.reset()
            self.feed.publish([Load(sup.engine.id, 0.0, 0.0, None, healthy=False)])
            self._spawn(self._stop_feed(eng), f"stop-feed-{sup.engine.id}")

    async def _engine_ready(self, eng: _Engine) -> None:
        try:
            await self._follow_engine(eng)
        except BaseException:
            eng.followed = False  # the next ready tries again
            raise

    async def _follow_engine(self, eng: _Engine) -> None:
        """A ready engine: follow its KV events, scrape it, save its slots, register it."""
        launch = eng.supervisor.launch
        assert launch is not None
        cfg = eng.config
        async with eng.kv_lock:
            await self._follow_kv_events(eng)
        if launch.metrics_url is not None and cfg.id not in self._watched():
            scraper = EngineScraper(cfg.kind, launch.metrics_url)
            eng.scraper = scraper
            self.telemetry.watch(cfg.id, scraper, status=lambda: self._status(eng))
        self._start_autosave(eng)
        await self._register(eng)

    async def _follow_kv_events(self, eng: _Engine) -> None:
        """Subscribe to a ready engine's KV events (those that publish them), replaying from its first
        batch, translated in blocks of :attr:`index_block_size` (the engine's previous translator is kept
        across a restart: it was reset when the engine went away). The pump is supervised
        (:func:`agent.supervised.supervise`): a failure is counted, what the translator held is cleared
        on the feed, and a new subscription replays what the engine still buffers. Callers hold
        ``eng.kv_lock``."""
        launch = eng.supervisor.launch
        assert launch is not None
        if not launch.speaks_kv_events or launch.kv_events_endpoint is None:
            return
        await self._stop_feed(eng)
        cfg = eng.config
        translator = eng.translator or Translator(cfg.id, cfg.model, self.index_block_size)
        eng.translator = translator
        await self._subscribe(eng)
        eng.pump = asyncio.create_task(
            supervise(
                f"kv-{cfg.id}",
                functools.partial(self._pump_once, eng, translator),
                count=functools.partial(self._count_failure, cfg.id, "kv_events"),
                on_failure=functools.partial(self._pump_failed, eng, translator),
                policy=self.task_restarts,
            ),
            name=f"kv-{cfg.id}",
        )

    async def _subscribe(self, eng: _Engine) -> KvEventSubscriber | None:
        """A started subscription to the engine's KV events, catching up from its replay buffer, held in
        ``eng.subscriber``; ``None`` when the engine publishes none now (it went away)."""
        launch = eng.supervisor.launch
        if launch is None or not launch.speaks_kv_events or launch.kv_events_endpoint is None:
            return None
        subscriber = KvEventSubscriber(
            SubscriberConfig(
                launch.kv_events_endpoint,
                launch.kv_replay_endpoint,
                topic=launch.kv_events_topic,
                catch_up=True,
            )
        )
        eng.subscriber = subscriber  # first: _stop_feed closes it, whatever happens next
        await subscriber.start()
        return subscriber

    async def _pump_once(self, eng: _Engine, translator: Translator) -> None:
        """One supervised run of the pump, on the current subscription or a new one."""
        subscriber = eng.subscriber or await self._subscribe(eng)
        if subscriber is not None:
            await self._pump(eng, subscriber, translator)

    async def _pump_failed(self, eng: _Engine, translator: Translator) -> None:
        """After a failed pump: close its subscription and clear what the translator held on the feed
        (batches may have been lost); the next run subscribes again and replays."""
        subscriber, eng.subscriber = eng.subscriber, None
        if subscriber is not None:
            await subscriber.aclose()
        self.feed.publish(translator.reset())

    def _count_failure(self, engine: str, task: str, error: str) -> None:
        key = (engine, task, error)
        self.task_failures[key] = self.task_failures.get(key, 0) + 1

    def _start_autosave(self, eng: _Engine) -> None:
        """Automatic slot saves for a llama.cpp engine (once per engine: they survive its restarts)."""
        cfg, min_tokens = eng.config, self.config.agent.slot_save_min_tokens
        if self.slots is None or eng.autosave is not None or cfg.kind != "llama_cpp" or not cfg.started:
            return
        if min_tokens <= 0:
            return
        saver = SlotAutoSaver(cfg.id, cfg.model, functools.partial(self.slots.cache, cfg.id), min_tokens)
        if eng.scraper is not None:
            eng.scraper.on_slots = saver.observe  # the telemetry poll reads /slots anyway
        else:
            saver.poll()
        eng.autosave = saver

    def _watched(self) -> set[str]:
        return {e.config.id for e in self.engines.values() if e.scraper is not None}

    def _status(self, eng: _Engine) -> EngineStatus:
        state = eng.supervisor.state
        return EngineStatus(healthy=state in (EngineState.READY, EngineState.DRAINING), draining=eng.draining)

    async def _pump(self, eng: _Engine, subscriber: KvEventSubscriber, translator: Translator) -> None:
        """Engine KV batches -> index events on the feed, in order (a replayed run folded: see
        :func:`feed_batches`)."""
        async for item in subscriber:
            items = [item, *subscriber.take_ready()]
            for lost in items:
                if isinstance(lost, EventsLost):
                    log.warning("engine %s: KV events lost (%s): entries cleared", eng.config.id, lost.reason)
            for events in feed_batches(translator, items):
                self.feed.publish(events)

    async def _stop_feed(self, eng: _Engine) -> None:
        pump, eng.pump = eng.pump, None
        if pump is not None:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        sub, eng.subscriber = eng.subscriber, None
        if sub is not None:
            await sub.aclose()

    async def _drain_engine(self, eng: _Engine) -> None:
        """Stop new requests (draining on the feed at once), let in-flight ones finish, deregister, stop."""
        eng.draining = True
        self.feed.publish([Load(eng.config.id, 0.0, 0.0, None, healthy=True, draining=True)])
        scraper = eng.scraper

        async def in_flight() -> int:
            if scraper is None:
                return 0
            sample = await scraper.scrape()
            if sample is None:
                raise AgentError(scraper.last_error or "metrics unavailable")
            return int(sample.running + sample.waiting)

        timeout = self.config.agent.drain_timeout_s
        left = await _wait_idle(in_flight, timeout)
        await self._deregister(eng)

        async def nothing() -> int:
            return 0

        await eng.supervisor.drain(nothing, 0.0)
        log.info("engine %s drained (%s in flight at stop)", eng.config.id, left)

    def _snapshot(self) -> list[IndexEvent]:
        held: list[IndexEvent] = []
        for eng in self.engines.values():
            if eng.translator is not None:
                held.extend(eng.translator.snapshot())
        return held

    def _spawn(self, coro: object, name: str) -> None:
        assert asyncio.iscoroutine(coro)
        task: asyncio.Task[None] = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)

    # -- admin API -------------------------------------------------------------------------------------

    async def _start_admin(self) -> None:
        """Serve the admin API: plaintext, or HTTPS where state changes need a client certificate."""
        tls = self.config.agent.tls
        ssl_context = None if tls is None else reloading_server_context(tls).context  # follows rotation
        middlewares: list[Middleware] = [] if tls is None else [client_cert_required]
        if self.tracer is not None:  # outermost: a refused request is traced too
            middlewares.insert(0, traced(self.tracer, skip=UNTRACED_PATHS))
        app = web.Application(middlewares=middlewares)
        app.add_routes(
            [
                web.get("/healthz", self._healthz),
                web.get("/readyz", self._readyz),
                web.get("/status", self._status_page),
                web.get("/metrics", self._metrics),
                web.post("/drain", self._drain_request),
            ]
        )
        if self.config.agent.kvcached:
            self._kvcached = KvcachedClient(
                self.config.agent.kvcached,
                max_message_bytes=self.config.agent.kvcached_max_block_bytes + MESSAGE_SLACK,
            )
            # Refused while the daemon keys blocks by another digest version (logged once).
            self.slots = SlotAdmin(self, DigestCheckedStore(self._kvcached))
            app.add_routes(self.slots.routes())
        self._admin = web.AppRunner(app, access_log=None)
        await self._admin.setup()
        host, _, port = self.config.agent.admin_listen.rpartition(":")
        site = web.TCPSite(self._admin, host.strip("[]"), int(port), ssl_context=ssl_context)
        with binding(self.config.agent.admin_listen):
            await site.start()
        server = site._server
        assert server is not None
        self.admin_port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        ready = all(e.supervisor.state is EngineState.READY and e.registered for e in self.engines.values())
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def _status_page(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _metrics(self, request: web.Request) -> web.Response:
        """Prometheus text (:mod:`agent.metrics`), read from :meth:`status` now."""
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _drain_request(self, request: web.Request) -> web.Response:
        self.stop_requested.set()
        return web.json_response({"draining": True}, status=202)

    def status(self) -> dict[str, object]:
        """What ``GET /status`` and ``--ready-file`` report."""
        return {
            "node": self.node,
            "feed": self.feed_address,
            "index_block_size": self.index_block_size,
            "admin_port": self.admin_port,
            "feed_seq": self.feed_log.seq,
            "power": [state.as_dict() for state in self.power.states],
            "task_failures": [
                {"engine": engine, "task": task, "error": error, "count": n}
                for (engine, task, error), n in sorted(self.task_failures.items())
            ],
            "engines": [
                {
                    "id": e.config.id,
                    "kind": e.config.kind,
                    "state": e.supervisor.state.value,
                    "address": None if e.supervisor.launch is None else e.supervisor.launch.address,
                    "pid": e.supervisor.pid,
                    "registered": e.registered,
                    "restarts": e.supervisor.restarts,
                    "kv_events": e.translator is not None,
                    "kv_subscriber": None if e.subscriber is None else dataclasses.asdict(e.subscriber.stats),
                    "kv_translator": None if e.translator is None else dataclasses.asdict(e.translator.stats),
                    "slot_autosave": None if e.autosave is None else e.autosave.as_dict(),
                    "slot_restores": None
                    if self.slots is None or e.config.kind != "llama_cpp"
                    else dataclasses.asdict(self.slots.stats.get(e.config.id) or RestoreStats()),
                }
                for e in self.engines.values()
            ],
        }


async def _wait_idle(in_flight: object, timeout_s: float, poll_s: float = 0.1) -> int:
    """Poll ``in_flight()`` until it is 0 or ``timeout_s`` passed; the last count (-1: unknown)."""
    assert callable(in_flight)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    left = -1
    while True:
        try:
            left = await in_flight()
        except AgentError as exc:
            log.warning("in-flight count unavailable while draining: %s", exc)
            left = -1
        if left == 0 or loop.time() >= deadline:
            return left
        await asyncio.sleep(poll_s)


def _log_failure(task: asyncio.Task[None]) -> None:
    exc = None if task.cancelled() else task.exception()
    if exc is not None:  # the type only: a message or traceback may quote an engine's payload
        log.error("agent task %s failed (%s)", task.get_name(), type(exc).__name__)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def run(config: NodeConfig, ready_file: Path | None, ready_timeout_s: float) -> int:
    agent = Agent(config)
    stop = agent.stop_requested
    stop_on_signals(stop)
    try:
        await agent.start()
        if ready_file is not None or systemd_notify_wanted():
            waiting = asyncio.ensure_future(agent.wait_ready(ready_timeout_s))
            stopped = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if waiting in done:
                waiting.result()
                announce_ready(ready_file, {**agent.status(), "pid": os.getpid()})
            else:
                waiting.cancel()
            stopped.cancel()
        await stop.wait()
        log.info("agent %s: draining", agent.node)
        await agent.drain()
    except BaseException:
        await agent.aclose()
        raise
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate agent", description="Run a kvgate node agent.")
    parser.add_argument("--config", type=Path, required=True, help="node config (TOML)")
    parser.add_argument(
        "--ready-file", type=Path, help="write the agent's status (JSON) here once every engine is ready"
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for --ready-file")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_node_config(args.config)
    except (AgentError, ConfigError) as exc:
        print(f"kvgate agent: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        return uvloop.run(run(config, args.ready_file, args.ready_timeout))
    except (AgentError, ConfigError, ListenError) as exc:
        print(f"kvgate agent: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
