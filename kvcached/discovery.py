"""Where the node's kvcached daemons are: registration of ``kvcached/<node>`` in etcd and the peer table.

Key (runtime/etcd.py schema, family ``kvcached``): ``<prefix>kvcached/<node>``, under the daemon's lease,
value JSON ``{"node": ..., "grpc": "host:port" | null, "quic": "host:port" | null, "feed": "host:port"}``
(:func:`encode_peer` / :func:`decode_peer`). The key vanishes ``lease_ttl_s`` after the daemon dies, or at
once when it stops cleanly.

:class:`PeerTable` is the sans-IO core: static ``[[peers]]`` plus what etcd says, minus this node;
:meth:`PeerTable.quic_addresses` is what a Get on a local miss asks. A bad etcd value is rejected with a
logged reason and the last good value for that node stays in force (DESIGN.md contract 3).
:class:`PeerWatcher` is the asyncio shell: one range read, then a watch from the next revision; on an
etcd outage or a cancelled (compacted) watch it resyncs with capped backoff, keeping the table meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping

import etcd3aio

from contracts.errors import ConfigError
from contracts.etcd import KVCACHED, EtcdSettings, PeerInfo, decode_peer, peer_key, split_key
from kvcached.config import StaticPeer
from runtime.etcd import ETCD_ERRORS, describe_error

log = logging.getLogger(__name__)

_DELETE = 1  # mvccpb.Event.EventType.DELETE


class PeerTable:
    """Known peers of node ``self_node``: static ones and etcd registrations (etcd wins for a node named
    in both). Pure bookkeeping; ``revision`` is the etcd revision it reflects."""

    def __init__(self, prefix: str, self_node: str, static: Iterable[StaticPeer] = ()) -> None:
        self.prefix = prefix
        self.self_node = self_node
        self._static = {p.node: PeerInfo(p.node, None, p.address, None) for p in static}
        self._etcd: dict[str, PeerInfo] = {}
        self.revision = 0
        self.rejected = 0

    @property
    def peers(self) -> Mapping[str, PeerInfo]:
        """node -> info, this node excluded."""
        merged = {**self._static, **self._etcd}
        merged.pop(self.self_node, None)
        return merged

    def quic_addresses(self) -> list[str]:
        """QUIC addresses of every peer that serves blocks, sorted by node."""
        return [info.quic for _, info in sorted(self.peers.items()) if info.quic is not None]

    def snapshot(self, kvs: Iterable[tuple[str, bytes]], revision: int) -> None:
        """Replace the etcd part with a full range read at ``revision`` (bad values keep the old one)."""
        old, self._etcd = self._etcd, {}
        for key, value in kvs:
            node = self._node(key)
            if node is not None:
                self._put(node, value, old.get(node))
        self.revision = revision

    def apply(self, changes: Iterable[tuple[str, bytes | None]], revision: int) -> None:
        """Apply watch changes in order: ``(key, value)``, value ``None`` for a delete."""
        for key, value in changes:
            node = self._node(key)
            if node is None:
                continue
            if value is None:
                if self._etcd.pop(node, None) is not None:
                    log.info("kvcached peer %s left", node)
            else:
                self._put(node, value, self._etcd.get(node))
        self.revision = revision

    def _node(self, key: str) -> str | None:
        split = split_key(self.prefix, key)
        if split is None or split[0] != KVCACHED or "/" in split[1]:
            return None
        return split[1]

    def _put(self, node: str, value: bytes, last_good: PeerInfo | None) -> None:
        try:
            info = decode_peer(node, value)
        except ConfigError as exc:
            self.rejected += 1
            log.warning("rejected %s (keeping the last good value): %s", peer_key(self.prefix, node), exc)
            if last_good is not None:
                self._etcd[node] = last_good
            return
        if self._etcd.get(node) != info and node != self.self_node:
            log.info("kvcached peer %s at quic %s", node, info.quic)
        self._etcd[node] = info


class PeerWatcher:
    """Keeps a :class:`PeerTable` in step with ``<prefix>kvcached/`` (see the module docstring). The
    client belongs to the caller."""

    def __init__(
        self,
        client: etcd3aio.Etcd3Client,
        settings: EtcdSettings,
        table: PeerTable,
        *,
        max_backoff_s: float = 2.0,
    ) -> None:
        self._client = client
        self._settings = settings
        self.table = table
        self._max_backoff_s = max_backoff_s
        self._task: asyncio.Task[None] | None = None
        self.synced = asyncio.Event()
        self.outages = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvcached-peer-watch")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    @property
    def _prefix(self) -> str:
        return f"{self._settings.prefix}{KVCACHED}/"

    async def _run(self) -> None:
        backoff = initial = 0.1
        while True:
            try:
                await self._resync()
                backoff = initial
                await self._watch()
            except ETCD_ERRORS as exc:
                self.outages += 1
                log.warning(
                    "etcd unreachable for peer discovery (%s): keeping known peers", describe_error(exc)
                )
            except Exception:
                log.exception("kvcached peer discovery failed; retrying")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    async def _resync(self) -> None:
        assert self._client.kv is not None
        response = await self._client.kv.get(
            self._prefix, etcd3aio.prefix_range_end(self._prefix), timeout=self._settings.timeout_s
        )
        kvs = [(kv.key.decode("utf-8", "replace"), bytes(kv.value)) for kv in response.kvs]
        self.table.snapshot(kvs, int(response.header.revision))
        self.synced.set()

    async def _watch(self) -> None:
        """Follow changes until the watch is cancelled (returns: resync) or etcd fails (raises)."""
        assert self._client.watch is not None
        stream = self._client.watch.watch(
            self._prefix, etcd3aio.prefix_range_end(self._prefix), start_revision=self.table.revision + 1
        )
        async for response in stream:
            if response.canceled or response.compact_revision:
                log.warning(
                    "etcd peer watch cancelled (compacted at %d): resyncing", response.compact_revision
                )
                return
            changes = [
                (
                    event.kv.key.decode("utf-8", "replace"),
                    None if event.type == _DELETE else bytes(event.kv.value),
                )
                for event in response.events
            ]
            if changes:
                self.table.apply(changes, int(response.header.revision))
