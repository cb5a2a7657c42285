"""``kvgate kvcached --config kvcached.toml``: the node's tiered KV block store daemon, composed.

Parts: the :class:`~kvcached.tiers.TieredStore` (RAM + RocksDB tiers); the local gRPC API
(:mod:`kvcached.service`, unix socket and/or mTLS TCP); the QUIC :class:`~kvcached.peers.PeerServer`
that lets peers fetch our blocks, and a :class:`~kvcached.peers.PeerClient` that fetches theirs on a
local miss; the index feed (:class:`runtime.feed.server.FeedServer`, source ``kvcached-<node>``): every change
the store reports becomes ``Stored``/``Removed(endpoint, digests, tier="ram"|"ssd")`` for the node's pseudo
endpoint ``kvcached:<node>`` (:func:`contracts.events.node_store_endpoint`), and a subscriber that needs a
resync gets a snapshot of what the tiers hold; with
``[etcd]``, the leased key ``kvcached/<node>`` (:mod:`kvcached.discovery`) and a watch of ``kvcached/``
that, with the static ``[[peers]]``, says whom to ask; Prometheus text on ``metrics_listen``
(``GET /metrics``, served on the event loop so scrapes never touch the store from another thread).

``--ready-file F``: once everything listens (and the first etcd registration was tried), the daemon's
addresses are written to ``F`` as JSON (:meth:`Daemon.status`). First SIGTERM/SIGINT stops cleanly
(lease revoked, so peers forget us at once; the store is closed); a second stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from contracts.errors import ConfigError
from contracts.etcd import PeerInfo, encode_peer, parse_etcd_settings, peer_key
from contracts.events import IndexEvent, Removed, Stored, node_store_endpoint
from kvcached.config import KvcachedConfig, load_kvcached_config
from kvcached.discovery import PeerTable
from kvcached.errors import KvcachedError
from kvcached.memory import tune_malloc
from kvcached.metrics import KvcachedMetrics
from kvcached.peers import DATAGRAM_BYTES_DEFAULT, PeerClient, PeerServer, buffer_bytes_default
from kvcached.remote import RemoteFetchPolicy
from kvcached.service import ApiServer, KvcachedService
from kvcached.tiers import TieredStore
from runtime.feed.log import FeedLog
from runtime.feed.server import FeedServer
from runtime.lifecycle import announce_ready, stop_on_signals
from runtime.listen import ListenError, binding
from runtime.tls import ServerTlsFiles
from runtime.tracing.tracer import build as build_tracer

if TYPE_CHECKING:
    from runtime.watch import PrefixWatcher

log = logging.getLogger(__name__)


class FeedPublisher:
    """The store's listener: each change becomes one feed batch naming every endpoint of the node."""

    def __init__(self, endpoints: tuple[str, ...]) -> None:
        self.endpoints = endpoints  # the node's pseudo endpoint (one)
        self.feed: FeedServer | None = None

    def on_stored(self, tier: str, digests: list[bytes]) -> None:
        if self.feed is not None and digests and self.endpoints:
            self.feed.publish([Stored(e, list(digests), tier) for e in self.endpoints])

    def on_removed(self, tier: str, digests: list[bytes]) -> None:
        if self.feed is not None and digests and self.endpoints:
            self.feed.publish([Removed(e, list(digests), tier) for e in self.endpoints])


class Daemon:
    """One kvcached daemon (see the module docstring); :meth:`start` then :meth:`aclose`."""

    def __init__(self, config: KvcachedConfig) -> None:
        self.config = config
        self.metrics = KvcachedMetrics()
        #: Spans of the fetch path (``[tracing]``); ``None``: tracing off.
        self.tracer = build_tracer(config.tracing)
        self._publisher = FeedPublisher((node_store_endpoint(config.node),))
        self.store: TieredStore | None = None
        self.feed: FeedServer | None = None
        self.api: ApiServer | None = None
        self.peer_server: PeerServer | None = None
        self.peer_client: PeerClient | None = None
        self.table = PeerTable("", config.node, config.peers)
        self.quic_port = 0
        self.metrics_port = 0
        self.registered = False
        self._etcd: Any = None
        self._leased: Any = None
        #: Follows ``kvcached/`` in etcd into :attr:`table` (``None`` without ``[etcd]``).
        self.watcher: PrefixWatcher[None] | None = None
        self._web: web.AppRunner | None = None

    async def start(self) -> None:
        cfg = self.config
        tls = None if cfg.tls is None else ServerTlsFiles(cfg.tls.cert, cfg.tls.key, cfg.tls.ca)
        self.feed = FeedServer(
            FeedLog(f"kvcached-{cfg.node}"), self._snapshot, listen=cfg.feed_listen, tls=tls
        )
        self._publisher.feed = self.feed
        self.store = TieredStore(
            cfg.ram_bytes,
            cfg.ssd_path,
            cfg.ssd_bytes,
            max_block_bytes=cfg.max_block_bytes,
            listener=self._publisher,
            write_through=cfg.write_through,
        )
        await self.feed.start()
        if cfg.tls is not None:
            q = cfg.quic
            self.peer_client = PeerClient(
                cert=cfg.tls.cert,
                key=cfg.tls.key,
                ca=cfg.tls.ca,
                timeout_s=2.0 if q is None else q.timeout_s,
                max_in_flight=8 if q is None else q.max_in_flight,
                max_datagram_size=DATAGRAM_BYTES_DEFAULT if q is None else q.max_datagram_size,
                max_block_bytes=cfg.max_block_bytes,
            )
            if q is not None:
                host, _, port = q.listen.rpartition(":")
                self.peer_server = PeerServer(
                    self.store,
                    host=host,
                    port=int(port),
                    cert=cfg.tls.cert,
                    key=cfg.tls.key,
                    ca=cfg.tls.ca,
                    max_concurrent_streams=q.max_concurrent_streams,
                    egress_bytes_per_s=q.egress_bytes_per_s,
                    max_datagram_size=q.max_datagram_size,
                    stall_timeout_s=q.timeout_s,
                    buffer_bytes=q.buffer_bytes or buffer_bytes_default(cfg.max_block_bytes),
                )
                self.metrics.watch_peer_server(self.peer_server.stats)
                self.quic_port = await self.peer_server.start()
        service = KvcachedService(
            self.store,
            metrics=self.metrics,
            peer_client=self.peer_client,
            peers=self.table.quic_addresses,
            peer_timeout_s=(2.0 if cfg.quic is None else cfg.quic.timeout_s) + 1.0,
            tracer=self.tracer,
            remote_peers=() if cfg.remote is None else tuple(p.address for p in cfg.remote.peers),
            remote=_remote_policy(cfg),
        )
        self.api = ApiServer(
            service,
            listen_unix=cfg.listen_unix,
            listen_tcp=cfg.listen_tcp,
            tls=cfg.tls,
            max_block_bytes=cfg.max_block_bytes,
            max_concurrent_rpcs=cfg.max_concurrent_rpcs,
        )
        await self.api.start()
        if cfg.metrics_listen is not None:
            await self._start_metrics(cfg.metrics_listen)
        if cfg.etcd_raw is not None:
            await self._start_etcd()
        log.info("kvcached %s ready: %s", cfg.node, json.dumps(self.status()))

    async def aclose(self) -> None:
        """Deregister, stop serving, close the store (each step runs even if an earlier one failed)."""
        steps: list[Any] = [
            self._leased.aclose() if self._leased is not None else None,
            self.watcher.aclose() if self.watcher is not None else None,
            self.api.aclose() if self.api is not None else None,
            self.peer_server.aclose() if self.peer_server is not None else None,
            self.peer_client.aclose() if self.peer_client is not None else None,
            self.feed.aclose() if self.feed is not None else None,
            self._web.cleanup() if self._web is not None else None,
            self._etcd.close() if self._etcd is not None else None,
        ]
        for step in steps:
            if step is None:
                continue
            try:
                await step
            except Exception:
                log.exception("kvcached shutdown step failed")
        self._publisher.feed = None
        if self.store is not None:
            try:
                self.store.close()
            except Exception:
                log.exception("kvcached shutdown: closing the store failed")
            self.store = None
        if self.tracer is not None:
            try:
                await asyncio.to_thread(self.tracer.shutdown)
            except Exception:
                log.exception("kvcached shutdown: the tracer's shutdown failed")

    def _addr(self, listen: str | None, port: int) -> str | None:
        if listen is None or not port:
            return None
        host = self.config.advertise or listen.rpartition(":")[0]
        return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"

    def info(self) -> PeerInfo:
        """What ``kvcached/<node>`` says about this daemon."""
        cfg = self.config
        quic = None if cfg.quic is None else self._addr(cfg.quic.listen, self.quic_port)
        feed_port = 0 if self.feed is None else self.feed.port
        grpc_port = 0 if self.api is None else self.api.tcp_port
        return PeerInfo(
            cfg.node, self._addr(cfg.listen_tcp, grpc_port), quic, self._addr(cfg.feed_listen, feed_port)
        )

    def status(self) -> dict[str, object]:
        """What ``--ready-file`` holds: node, addresses (``host:port``), unix socket, metrics port."""
        info = self.info()
        return {
            "node": info.node,
            "grpc": info.grpc,
            "unix": self.config.listen_unix,
            "quic": info.quic,
            "feed": info.feed,
            "metrics_port": self.metrics_port or None,
            "registered": self.registered,
            "feed_source": None if self.feed is None else self.feed.log.source,
        }

    def _snapshot(self) -> list[IndexEvent]:
        if self.store is None:
            return []
        held = self.store.held()
        endpoint = node_store_endpoint(self.config.node)
        return [Stored(endpoint, list(held[tier]), tier) for tier in sorted(held)]

    async def _start_metrics(self, listen: str) -> None:
        async def metrics(request: web.Request) -> web.Response:
            body = generate_latest(self.metrics.registry)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.add_routes([web.get("/metrics", metrics)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        host, _, port = listen.rpartition(":")
        self._web = runner  # cleaned up by aclose, also when the bind fails
        site = web.TCPSite(runner, host, int(port))
        with binding(listen):
            await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.metrics_port = int(sockets[0].getsockname()[1]) if sockets else int(port)

    async def _start_etcd(self) -> None:
        # Imported here: a daemon without [etcd] never loads an etcd client library.
        from runtime.etcd import LeasedKeys, connect
        from runtime.watch import PrefixWatcher

        assert self.config.etcd_raw is not None
        settings = parse_etcd_settings(self.config.etcd_raw, "etcd")
        self.table.prefix = settings.prefix
        self._etcd = await connect(settings)
        self._leased = LeasedKeys(self._etcd, self.config.lease_ttl_s, timeout_s=settings.timeout_s)
        key = peer_key(settings.prefix, self.config.node)
        self.registered = await self._leased.start({key: encode_peer(self.info())})
        if not self.registered:
            log.warning("kvcached %s: etcd not reachable yet; registration retries", self.config.node)
        self.watcher = PrefixWatcher(
            self._etcd,
            self.table.watch_prefix,
            self.table,
            timeout_s=settings.timeout_s,
            max_backoff_s=2.0,
            name="kvcached-peer-watch",
        )
        self.watcher.start()


def _remote_policy(cfg: KvcachedConfig) -> RemoteFetchPolicy | None:
    """Cross-cluster fetch (``[remote]``): budget burst of one second's worth, at least one largest block."""
    remote = cfg.remote
    if remote is None:
        return None
    burst = max(remote.fetch_bytes_per_s, float(cfg.max_block_bytes))
    return RemoteFetchPolicy(remote.allow, remote.fetch_bytes_per_s, burst, time.monotonic())


async def run(config: KvcachedConfig, ready_file: Path | None) -> int:
    daemon = Daemon(config)
    stop = asyncio.Event()
    stop_on_signals(stop)
    try:
        await daemon.start()
        announce_ready(ready_file, {**daemon.status(), "pid": os.getpid()})
        await stop.wait()
        log.info("kvcached %s: stopping", config.node)
    finally:
        await daemon.aclose()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate kvcached", description="Run the node's KV block store.")
    parser.add_argument("--config", type=Path, required=True, help="kvcached config (TOML)")
    parser.add_argument(
        "--ready-file", type=Path, help="write the daemon's addresses (JSON) here once it serves"
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_kvcached_config(args.config)
    except (KvcachedError, ConfigError) as exc:
        print(f"kvgate kvcached: {exc}", file=sys.stderr)
        return 2
    tune_malloc()
    try:
        import uvloop

        return uvloop.run(run(config, args.ready_file))
    except (KvcachedError, ConfigError, ListenError) as exc:
        print(f"kvgate kvcached: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
