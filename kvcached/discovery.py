"""Where the node's kvcached daemons are: registration of ``kvcached/<node>`` in etcd and the peer table.

Key (contracts/etcd.py schema, family ``kvcached``): ``<prefix>kvcached/<node>``, under the daemon's lease,
value JSON ``{"node": ..., "grpc": "host:port" | null, "quic": "host:port" | null, "feed": "host:port"}``
(:func:`encode_peer` / :func:`decode_peer`). The key vanishes ``lease_ttl_s`` after the daemon dies, or at
once when it stops cleanly.

:class:`PeerTable` is the sans-IO core: static ``[[peers]]`` plus what etcd says, minus this node;
:meth:`PeerTable.quic_addresses` is what a Get on a local miss asks. A bad etcd value is rejected with a
logged reason and the last good value for that node stays in force (DESIGN.md contract 3).
The table has no loop of its own: :mod:`kvcached.main` runs it under :class:`runtime.watch.PrefixWatcher`
over :attr:`PeerTable.watch_prefix` (the loop the gateway's control plane uses too): one range read, then
a watch from the next revision with a liveness probe beside it; on an etcd outage, or a cancelled
(compacted) watch, it resyncs with capped backoff and never spins, keeping the table meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from contracts.errors import ConfigError
from contracts.etcd import KVCACHED, Change, PeerInfo, decode_peer, peer_key, peer_skew, split_key
from kvcached.config import StaticPeer

log = logging.getLogger(__name__)


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
        #: Peers registered under another digest version (left out of :attr:`peers`).
        self.skewed: set[str] = set()

    @property
    def watch_prefix(self) -> str:
        """The keys this table follows: ``<prefix>kvcached/``."""
        return f"{self.prefix}{KVCACHED}/"

    @property
    def peers(self) -> Mapping[str, PeerInfo]:
        """node -> info, this node excluded."""
        merged = {**self._static, **self._etcd}
        merged.pop(self.self_node, None)
        return merged

    def quic_addresses(self) -> list[str]:
        """QUIC addresses of every peer that serves blocks, sorted by node."""
        return [info.quic for _, info in sorted(self.peers.items()) if info.quic is not None]

    def snapshot(
        self, kvs: Iterable[tuple[str, bytes]], revision: int, created: Mapping[str, int] | None = None
    ) -> None:
        """Replace the etcd part with a full range read at ``revision`` (bad values keep the old one)."""
        old, self._etcd = self._etcd, {}
        present: set[str] = set()
        for key, value in kvs:
            node = self._node(key)
            if node is not None:
                present.add(node)
                self._put(node, value, old.get(node))
        self.skewed &= present
        self.revision = revision

    def apply(self, changes: Iterable[Change], revision: int) -> None:
        """Apply watch changes in order (value ``None``: a delete)."""
        for change in changes:
            node = self._node(change.key)
            if node is None:
                continue
            if change.value is None:
                self.skewed.discard(node)
                if self._etcd.pop(node, None) is not None:
                    log.info("kvcached peer %s left", node)
            else:
                self._put(node, change.value, self._etcd.get(node))
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
        skewed = peer_skew(info)
        if skewed is not None:
            # Another record schema, or blocks keyed by another digest scheme: not asked for blocks.
            if node not in self.skewed:
                what, version, why = skewed
                log.warning(
                    "version skew: %s of peer %s is version %d: %s; not asked for blocks",
                    what,
                    node,
                    version,
                    why,
                )
            self.skewed.add(node)
            self._etcd.pop(node, None)
            return
        self.skewed.discard(node)
        if self._etcd.get(node) != info and node != self.self_node:
            log.info("kvcached peer %s at quic %s", node, info.quic)
        self._etcd[node] = info
