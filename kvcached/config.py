"""kvcached configuration (``kvgate kvcached --config kvcached.toml``): frozen dataclasses parsed at the edge.

Unknown keys and ill-typed values are :class:`~kvcached.errors.KvcachedConfigError` naming the key; nothing
past :func:`parse_kvcached_config` sees a raw dict, except ``KvcachedConfig.etcd_raw`` (parsed by
:func:`contracts.etcd.parse_etcd_settings`). Sizes are bytes, times seconds, addresses ``host:port``
(port 0 = ephemeral: listen addresses only, a peer's cannot be dialed). Example (every key)::

    [kvcached]
    node = "node-a"                      # node id (default: the hostname); etcd key kvcached/<node>
    advertise = "127.0.0.1"              # host peers and gateways reach this node at (default: each
                                         # listen address's own host)
    listen_unix = "/run/kvgate/kvcached.sock"   # local gRPC API, plaintext, on a unix socket (optional)
    listen_tcp = "127.0.0.1:0"           # local gRPC API on TCP, mTLS only: needs [kvcached.tls] (optional)
    feed_listen = "127.0.0.1:0"          # index-event feed gRPC (mTLS when [kvcached.tls] is set)
    metrics_listen = "127.0.0.1:0"       # Prometheus text (optional; absent = no metrics server)
    ram_bytes = 1073741824               # RAM tier budget
    ssd_path = "/var/lib/kvgate/kvcached"   # RocksDB directory of the SSD tier (absent = RAM only)
    ssd_bytes = 68719476736              # SSD tier budget
    write_through = false                # each put also written to the SSD before it is acknowledged
                                         # (a kill -9 then loses nothing acknowledged; needs ssd_path)
    max_block_bytes = 67108864           # largest block accepted (default 64 MiB)
    max_concurrent_rpcs = 64             # local API calls served at once per listener; one more is
                                         # RESOURCE_EXHAUSTED (a failed call: agents count it as such).
                                         # Its messages hold at most listeners x max_concurrent_rpcs x
                                         # (max_block_bytes + 1 MiB) (default 64, at least 1)
    lease_ttl_s = 5                      # etcd lease TTL of kvcached/<node> (whole seconds >= 2)

    [kvcached.tls]                       # optional, all three or none: mTLS on TCP gRPC, feed and QUIC
    cert = "/etc/kvgate/kvcached.pem"
    key = "/etc/kvgate/kvcached.key"
    ca = "/etc/kvgate/ca.pem"            # clients and peers must chain to it (and so must servers we dial)

    [quic]                               # optional: peer fetch over QUIC; needs [kvcached.tls]
    listen = "127.0.0.1:0"               # UDP host:port of the PeerServer
    max_concurrent_streams = 64          # streams served at once per connection
    egress_bytes_per_s = 1250000000      # egress cap of the PeerServer (absent = unlimited)
    timeout_s = 2.0                      # a peer fetch that takes longer is a miss; a response we serve
                                         # that nothing acknowledges for as long is reset
    max_in_flight = 8                    # request streams in flight at once, all peers together
    max_datagram_size = 1200             # UDP payload bytes, 1200..65000; must fit the path MTU - 28:
                                         # 8972 with 9000-byte jumbo frames, 65000 on loopback (fewer,
                                         # larger packets: aioquic's cost is per packet; BENCHMARKS.md)
    buffer_bytes = 1073741824            # what the PeerServer buffers for requests and responses, all
                                         # connections and streams together; past it a stream is refused
                                         # (ERR_BUSY: a miss). Default: 1 GiB, or 2 x (max_block_bytes +
                                         # ~4.5 MiB) when more; at least max_block_bytes + ~4.5 MiB

    [[peers]]                            # static peers (besides those found in etcd)
    node = "node-b"
    address = "10.0.0.8:4433"            # its QUIC host:port

    [tracing]                            # optional (contracts/tracing.py): spans of Get and Contains
    enabled = true                       # (with a peer fetch's own), the parent from the caller's
    endpoint = "127.0.0.1:4317"          # traceparent metadata
    [remote]                             # optional: fetch from other clusters' kvcached (kvcached/remote.py)
    allow = false                        # never, unless true; then only after every local peer missed
    fetch_bytes_per_s = 100000000        # the cross-cluster budget (bytes/s pulled), required with allow
    [[remote.peers]]
    cluster = "eu"
    address = "10.1.0.8:4433"            # a remote daemon's QUIC host:port

    [etcd]                               # optional: registration + peer discovery (runtime/etcd.py)
    endpoints = ["127.0.0.1:2379"]
"""

from __future__ import annotations

import copy
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from contracts.config import REQUIRED, Section, read_tree
from contracts.errors import ConfigError
from contracts.kvcached import MAX_BLOCK_BYTES_DEFAULT
from contracts.tracing import TracingSettings, parse_tracing
from kvcached.errors import KvcachedConfigError
from kvcached.peers import DATAGRAM_BYTES_MAX, REQUEST_CHARGE_BYTES, response_charge_max
from kvcached.remote import RemotePeer

#: Local API calls each listener serves at once by default (``max_concurrent_rpcs``): at most ~4 GiB of
#: messages per listener with blocks of the 64 MiB maximum, ~200 MiB with 2 MiB blocks
#: (:mod:`kvcached.service`). A call that misses locally holds its slot through its peer fetch
#: (``quic.timeout_s`` at most), so the cap is set for bursts of those, not for a handful of callers.
MAX_CONCURRENT_RPCS_DEFAULT = 64

#: The ``service.name`` of kvcached's spans unless ``[tracing] service_name`` says otherwise.
KVCACHED_SERVICE = "kvgate-kvcached"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM paths: this daemon's certificate chain and key, and the CA every other side must chain to."""

    cert: Path
    key: Path
    ca: Path


@dataclass(frozen=True, slots=True)
class QuicSettings:
    """The QUIC peer server and client: UDP listen address, streams served at once per connection,
    egress cap (bytes/s, ``None`` = unlimited), fetch deadline (s), block streams in flight per fetch,
    UDP payload bytes per datagram (both directions; must fit the path MTU), the server's buffer budget
    in bytes, all connections together (``None``: :func:`kvcached.peers.buffer_bytes_default`)."""

    listen: str = "127.0.0.1:0"
    max_concurrent_streams: int = 64
    egress_bytes_per_s: float | None = None
    timeout_s: float = 2.0
    max_in_flight: int = 8
    max_datagram_size: int = 1200
    buffer_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class StaticPeer:
    """A peer named in the config: its node id and QUIC ``host:port``."""

    node: str
    address: str


@dataclass(frozen=True, slots=True)
class RemoteSettings:
    """``[remote]``: whether blocks may come from other clusters, the budget (bytes/s), and their daemons."""

    allow: bool
    fetch_bytes_per_s: float
    peers: tuple[RemotePeer, ...]


@dataclass(frozen=True, slots=True)
class KvcachedConfig:
    """A whole kvcached config (see the module docstring for each key's meaning and units).
    ``etcd_raw``: the ``[etcd]`` table as read (read-only), ``None`` when the daemon runs without etcd."""

    node: str
    ram_bytes: int
    advertise: str | None = None
    listen_unix: str | None = None
    listen_tcp: str | None = None
    feed_listen: str = "127.0.0.1:0"
    metrics_listen: str | None = None
    ssd_path: Path | None = None
    ssd_bytes: int = 0
    max_block_bytes: int = MAX_BLOCK_BYTES_DEFAULT
    max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS_DEFAULT
    lease_ttl_s: int = 5
    write_through: bool = False
    tls: TlsFiles | None = None
    quic: QuicSettings | None = None
    peers: tuple[StaticPeer, ...] = ()
    etcd_raw: Mapping[str, Any] | None = None
    #: ``[tracing]`` (:mod:`contracts.tracing`): spans of Get and Contains (the fetch path).
    tracing: TracingSettings = field(default_factory=lambda: TracingSettings(service_name=KVCACHED_SERVICE))
    #: ``[remote]``: cross-cluster fetch (``None``: none).
    remote: RemoteSettings | None = None


def parse_kvcached_config(raw: object) -> KvcachedConfig:
    """Validate a whole config document (already decoded from TOML or JSON)."""
    try:
        return _parse(raw)
    except KvcachedConfigError:
        raise
    except ConfigError as exc:  # from the shared Section helper
        raise KvcachedConfigError(str(exc)) from exc


def load_kvcached_config(path: Path | str) -> KvcachedConfig:
    """Read and validate a ``.toml`` (or ``.json``) config file."""
    try:
        raw = read_tree(path, "kvcached config")
    except ConfigError as exc:
        raise KvcachedConfigError(str(exc)) from exc
    return parse_kvcached_config(raw)


def _parse(raw: object) -> KvcachedConfig:
    top = Section(raw, "config")
    k = Section(top.raw("kvcached") or {}, "kvcached")
    etcd_raw = top.raw("etcd")
    if etcd_raw is not None and not isinstance(etcd_raw, Mapping):
        raise KvcachedConfigError(f"etcd: expected a table, got {type(etcd_raw).__name__}")
    quic_raw = top.raw("quic")
    peers_raw = top.array("peers", [])
    tracing = parse_tracing(top.raw("tracing"), KVCACHED_SERVICE)
    remote_raw = top.raw("remote")
    top.done()

    node = k.string("node", socket.gethostname())
    if not node or "/" in node:
        raise KvcachedConfigError(f"kvcached.node: expected a non-empty name without '/', got {node!r}")
    ram_bytes = k.integer("ram_bytes", REQUIRED, minimum=1)
    ssd_path = k.string("ssd_path")
    ssd_bytes = k.integer("ssd_bytes", 0, minimum=0)
    tls = _tls(k.raw("tls"))
    max_block_bytes = k.integer("max_block_bytes", MAX_BLOCK_BYTES_DEFAULT, minimum=1)
    cfg = KvcachedConfig(
        node=node,
        ram_bytes=ram_bytes,
        advertise=_nonempty(k.string("advertise"), "kvcached.advertise"),
        listen_unix=_nonempty(k.string("listen_unix"), "kvcached.listen_unix"),
        listen_tcp=_hostport(k.string("listen_tcp"), "kvcached.listen_tcp"),
        feed_listen=_hostport(k.string("feed_listen", "127.0.0.1:0"), "kvcached.feed_listen") or "",
        metrics_listen=_hostport(k.string("metrics_listen"), "kvcached.metrics_listen"),
        ssd_path=None if ssd_path is None else Path(_nonempty(ssd_path, "kvcached.ssd_path") or ""),
        ssd_bytes=ssd_bytes,
        max_block_bytes=max_block_bytes,
        max_concurrent_rpcs=k.integer("max_concurrent_rpcs", MAX_CONCURRENT_RPCS_DEFAULT, minimum=1),
        lease_ttl_s=k.integer("lease_ttl_s", 5, minimum=2),
        write_through=k.flag("write_through", False),
        tls=tls,
        quic=None if quic_raw is None else _quic(quic_raw, max_block_bytes),
        peers=tuple(_peer(p, f"peers[{i}]") for i, p in enumerate(peers_raw)),
        etcd_raw=None if etcd_raw is None else MappingProxyType(copy.deepcopy(dict(etcd_raw))),
        tracing=tracing,
        remote=None if remote_raw is None else _remote(remote_raw),
    )
    k.done()
    if cfg.remote is not None and cfg.remote.allow and cfg.quic is None:
        raise KvcachedConfigError("remote.allow: needs [quic] (remote blocks come over the peer protocol)")
    if cfg.write_through and cfg.ssd_path is None:
        raise KvcachedConfigError("kvcached.write_through: needs an SSD tier (ssd_path)")
    if cfg.ssd_path is not None and cfg.ssd_bytes < 1:
        raise KvcachedConfigError("kvcached.ssd_bytes: must be >= 1 when ssd_path is set")
    if cfg.listen_tcp is not None and cfg.tls is None:
        raise KvcachedConfigError("kvcached.listen_tcp: the TCP API is mTLS only: set [kvcached.tls]")
    if cfg.quic is not None and cfg.tls is None:
        raise KvcachedConfigError("quic: peer fetch is mTLS only: set [kvcached.tls]")
    if cfg.listen_unix is None and cfg.listen_tcp is None:
        raise KvcachedConfigError("kvcached: set listen_unix, listen_tcp or both")
    nodes = [p.node for p in cfg.peers]
    if len(set(nodes)) != len(nodes):
        raise KvcachedConfigError("peers: duplicate node")
    return cfg


def _tls(raw: object) -> TlsFiles | None:
    if raw is None:
        return None
    s = Section(raw, "kvcached.tls")
    paths = {key: s.string(key) for key in ("cert", "key", "ca")}
    s.done()
    given = [key for key, v in paths.items() if v]
    if len(given) != len(paths):
        raise KvcachedConfigError(f"kvcached.tls: set all of cert, key, ca (got only {', '.join(given)})")
    return TlsFiles(Path(paths["cert"]), Path(paths["key"]), Path(paths["ca"]))


def _quic(raw: object, max_block_bytes: int) -> QuicSettings:
    s = Section(raw, "quic")
    d = QuicSettings()
    egress = s.number("egress_bytes_per_s", None, minimum=1.0)
    # One response of the largest block and its request must fit, or such a block is never served.
    least = response_charge_max(max_block_bytes) + REQUEST_CHARGE_BYTES
    quic = QuicSettings(
        listen=_hostport(s.string("listen", d.listen), "quic.listen") or "",
        max_concurrent_streams=s.integer("max_concurrent_streams", d.max_concurrent_streams, minimum=1),
        egress_bytes_per_s=egress,
        timeout_s=s.number("timeout_s", d.timeout_s, minimum=0.001),
        max_in_flight=s.integer("max_in_flight", d.max_in_flight, minimum=1),
        max_datagram_size=s.integer("max_datagram_size", d.max_datagram_size, minimum=1200),
        buffer_bytes=s.integer("buffer_bytes", None, minimum=least),
    )
    s.done()
    if quic.max_datagram_size > DATAGRAM_BYTES_MAX:
        raise KvcachedConfigError(
            f"quic.max_datagram_size must be at most {DATAGRAM_BYTES_MAX}, got {quic.max_datagram_size}"
        )
    return quic


def _peer(raw: object, where: str) -> StaticPeer:
    s = Section(raw, where)
    peer = StaticPeer(
        node=_nonempty(s.string("node", REQUIRED), f"{where}.node") or "",
        address=_dialable(s.string("address", REQUIRED), f"{where}.address"),
    )
    s.done()
    return peer


def _remote(raw: object) -> RemoteSettings:
    s = Section(raw, "remote")
    allow = s.flag("allow", False)
    rate = s.number("fetch_bytes_per_s", REQUIRED if allow else 0.0, minimum=0.0)
    peers = []
    for i, p in enumerate(s.array("peers", [])):
        ps = Section(p, f"remote.peers[{i}]")
        peers.append(
            RemotePeer(
                cluster=_nonempty(ps.string("cluster", REQUIRED), f"remote.peers[{i}].cluster") or "",
                address=_dialable(ps.string("address", REQUIRED), f"remote.peers[{i}].address"),
            )
        )
        ps.done()
    s.done()
    if allow and rate <= 0:
        raise KvcachedConfigError("remote.fetch_bytes_per_s: must be > 0 when allow is true")
    return RemoteSettings(allow=allow, fetch_bytes_per_s=rate, peers=tuple(peers))


def _hostport(value: str | None, where: str) -> str | None:
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise KvcachedConfigError(f"{where}: expected host:port, got {value!r}")
    return value


def _dialable(value: str | None, where: str) -> str:
    """A peer's ``host:port``: a port of 0 (an ephemeral listen port) cannot be dialed."""
    address = _hostport(value, where) or ""
    if int(address.rpartition(":")[2]) == 0:
        raise KvcachedConfigError(f"{where}: port 0 cannot be dialed, got {address!r}")
    return address


def _nonempty(value: str | None, where: str) -> str | None:
    if value == "":
        raise KvcachedConfigError(f"{where}: must not be empty")
    return value
