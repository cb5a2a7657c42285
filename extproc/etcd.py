"""The etcd side of the control plane: settings, the key schema, the endpoint codec and leased keys.

Key schema (DESIGN.md contract 3), under a configurable prefix (default ``/kvgate/``):

=====================  ==========================================================  ==================
key                    value                                                       written by
=====================  ==========================================================  ==================
``endpoints/<id>``     JSON endpoint (:func:`encode_endpoint`), under a lease      node agents
``drain/<id>``         any value (by convention ``{"at": unix_s, "by": who}``);    ``kvgate drain``
                       present = the endpoint takes no new requests
``policy/<path>``      one JSON value per key (:mod:`extproc.policy`), e.g.        ``kvgate policy``
                       ``policy/weights/prefix`` = ``3.0``
``models/<name>``      JSON route ``{"labels": {..}, "profile": ".."}``            ``kvgate policy``
``tenants/<id>``       reserved: tenant scopes and limits (:mod:`extproc.tenants`)  (later)
``kvcached/<node>``    reserved: a node's tier store, under a lease                kvcached (later)
=====================  ==========================================================  ==================

Only :mod:`etcd3aio` (grpc.aio) talks to etcd in kvgate: one etcd client library per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import etcd3aio
import grpc
import grpc.aio

from extproc.errors import ConfigError
from extproc.fleet import Endpoint

log = logging.getLogger(__name__)

ENDPOINTS, DRAIN, POLICY, MODELS, TENANTS, KVCACHED = (
    "endpoints",
    "drain",
    "policy",
    "models",
    "tenants",
    "kvcached",
)
"""Key families: the first path segment after the prefix."""

#: What a failed etcd call raises: etcd3aio's mapped errors, unmapped gRPC statuses, timeouts.
ETCD_ERRORS: tuple[type[BaseException], ...] = (etcd3aio.EtcdError, grpc.aio.AioRpcError, TimeoutError)


@dataclass(frozen=True, slots=True)
class EtcdSettings:
    """How to reach etcd: client ``host:port`` endpoints, the key prefix (ends with ``/``), optional TLS
    (``tls_ca`` PEM path verifies the servers; ``tls_cert`` + ``tls_key`` are the client certificate,
    both or neither, and need ``tls_ca``; ``tls_server_name`` overrides the name checked against the
    server certificate, needed with several TLS endpoints), and ``timeout_s``, the deadline of one call."""

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    prefix: str = "/kvgate/"
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    timeout_s: float = 2.0


_DEFAULT = EtcdSettings()


def parse_etcd_settings(raw: object, where: str) -> EtcdSettings:
    """Validate an ``[etcd]`` table (unknown keys, bad addresses, half-set TLS: :class:`ConfigError`)."""
    from extproc.config import Section, _all_or_none, _hostport

    s = Section(raw, where)
    endpoints = s.array("endpoints", list(_DEFAULT.endpoints))
    if not endpoints or not all(isinstance(e, str) for e in endpoints):
        raise ConfigError(f"{where}.endpoints: expected a non-empty list of host:port strings")
    prefix = s.string("prefix", _DEFAULT.prefix)
    if not prefix.endswith("/"):
        raise ConfigError(f"{where}.prefix: must end with '/', got {prefix!r}")
    settings = EtcdSettings(
        endpoints=tuple(_hostport(e, f"{where}.endpoints") for e in endpoints),
        prefix=prefix,
        tls_ca=s.string("tls_ca"),
        tls_cert=s.string("tls_cert"),
        tls_key=s.string("tls_key"),
        tls_server_name=s.string("tls_server_name"),
        timeout_s=s.number("timeout_s", _DEFAULT.timeout_s, minimum=0.001),
    )
    s.done()
    _all_or_none(where, tls_cert=settings.tls_cert, tls_key=settings.tls_key)
    if settings.tls_cert and not settings.tls_ca:
        raise ConfigError(f"{where}: a client certificate (tls_cert, tls_key) needs tls_ca")
    if settings.tls_ca == "":
        raise ConfigError(f"{where}.tls_ca: must not be empty")
    return settings


def _pem(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"etcd {what} {path}: {exc.strerror}") from exc


async def connect(settings: EtcdSettings) -> etcd3aio.Etcd3Client:
    """An etcd client with its channel open (no call made yet: an unreachable etcd fails later calls).

    The caller owns it and closes it with ``await client.close()``."""
    client = etcd3aio.Etcd3Client(
        list(settings.endpoints),
        tls_server_name=settings.tls_server_name,
        watch_max_reconnect_backoff_seconds=1.0,
        ca_cert=_pem(settings.tls_ca, "tls_ca"),
        cert_chain=_pem(settings.tls_cert, "tls_cert"),
        cert_key=_pem(settings.tls_key, "tls_key"),
    )
    # gRPC waits up to 120 s between reconnection attempts by default; etcd3aio builds its channel from
    # these options (no public knob), so cap the wait: a gateway or agent is back soon after etcd is.
    client._manager.grpc_options += _RECONNECT_OPTIONS
    await client.connect()
    return client


_RECONNECT_OPTIONS: list[tuple[str, str | int | bool]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


# -- keys ---------------------------------------------------------------------------------------------


def family_key(prefix: str, family: str, name: str) -> str:
    """``<prefix><family>/<name>``; ``name`` must be non-empty."""
    if not name:
        raise ConfigError(f"{family}: empty name")
    return f"{prefix}{family}/{name}"


def endpoint_key(prefix: str, endpoint_id: str) -> str:
    return family_key(prefix, ENDPOINTS, endpoint_id)


def drain_key(prefix: str, endpoint_id: str) -> str:
    return family_key(prefix, DRAIN, endpoint_id)


def policy_key(prefix: str, path: str) -> str:
    """The key of a policy path (:mod:`extproc.policy`): ``models/<name>`` lives in its own family,
    every other path under ``policy/``."""
    if path.startswith(MODELS + "/"):
        return family_key(prefix, MODELS, path[len(MODELS) + 1 :])
    return family_key(prefix, POLICY, path)


def split_key(prefix: str, key: str | bytes) -> tuple[str, str] | None:
    """``(family, name)`` of a key under ``prefix``, or ``None`` if it is not ``<prefix><family>/<name>``."""
    text = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
    if not text.startswith(prefix):
        return None
    family, sep, name = text[len(prefix) :].partition("/")
    if not sep or not family or not name:
        return None
    return family, name


def policy_path(family: str, name: str) -> str | None:
    """The policy path of a ``policy/`` or ``models/`` key (``None`` for other families, and for
    ``policy/models/...``, which would shadow the ``models/`` family)."""
    if family == MODELS:
        return f"{MODELS}/{name}"
    if family == POLICY and not name.startswith(MODELS + "/"):
        return name
    return None


# -- endpoint codec -----------------------------------------------------------------------------------


def encode_endpoint(endpoint: Endpoint) -> bytes:
    """The JSON value of ``endpoints/<id>`` (sorted keys, compact; ``slot_restore`` only when set)."""
    doc: dict[str, object] = {
        "id": endpoint.id,
        "address": endpoint.address,
        "models": sorted(endpoint.models),
        "engine": endpoint.engine,
        "role": endpoint.role,
        "node": endpoint.node,
        "feed": endpoint.feed,
        "kv_events": endpoint.kv_events,
        "metrics_url": endpoint.metrics_url,
        "block_size": endpoint.block_size,
        "capacity_blocks": endpoint.capacity_blocks,
        "labels": dict(endpoint.labels),
    }
    if endpoint.slot_restore is not None:  # absent otherwise: records stay readable by older gateways
        doc["slot_restore"] = endpoint.slot_restore
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def decode_endpoint(key_id: str, value: bytes) -> Endpoint:
    """Validate an ``endpoints/<key_id>`` value; :class:`ConfigError` names the field and the reason."""
    from extproc.config import parse_endpoint

    where = f"{ENDPOINTS}/{key_id}"
    try:
        raw = json.loads(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: not valid JSON: {exc}") from exc
    if isinstance(raw, dict) and "id" not in raw:  # not defaulted to the address, as in a config file
        raise ConfigError(f"{where}.id: required")
    endpoint = parse_endpoint(raw, where)
    if endpoint.id != key_id:
        raise ConfigError(f"{where}.id: {endpoint.id!r} does not match the key")
    return endpoint


# -- kvcached/<node> (written by kvcached daemons, read by peers and gateways) ------------------------------


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """One kvcached daemon as registered: node id, local gRPC API (TCP, mTLS; ``None``: unix only),
    QUIC peer address (``None``: serves no peers) and index feed, each ``host:port``."""

    node: str
    grpc: str | None
    quic: str | None
    feed: str | None


def peer_key(prefix: str, node: str) -> str:
    """``<prefix>kvcached/<node>``."""
    return family_key(prefix, KVCACHED, node)


def encode_peer(info: PeerInfo) -> bytes:
    """The JSON value of ``kvcached/<node>`` (sorted keys, compact)."""
    doc = {"node": info.node, "grpc": info.grpc, "quic": info.quic, "feed": info.feed}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def decode_peer(node: str, value: bytes) -> PeerInfo:
    """Validate a ``kvcached/<node>`` value; :class:`ConfigError` names the field and the reason."""
    where = f"{KVCACHED}/{node}"
    try:
        doc = json.loads(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    unknown = sorted(set(doc) - {"node", "grpc", "quic", "feed"})
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
    if doc.get("node") != node:
        raise ConfigError(f"{where}.node: {doc.get('node')!r} does not match the key")
    fields: dict[str, str | None] = {}
    for name in ("grpc", "quic", "feed"):
        v = doc.get(name)
        if v is not None and not _is_hostport(v):
            raise ConfigError(f"{where}.{name}: expected host:port or null, got {v!r}")
        fields[name] = v
    return PeerInfo(node, fields["grpc"], fields["quic"], fields["feed"])


def _is_hostport(value: object) -> bool:
    if not isinstance(value, str):
        return False
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) <= 65535)


# -- leased keys --------------------------------------------------------------------------------------


class LeasedKeys:
    """Keys that live exactly as long as this process keeps its etcd lease alive.

    :meth:`start` grants a lease of ``ttl_s`` seconds and puts the keys under it; a background task
    renews it every ``ttl_s / 3`` seconds. When etcd is unreachable the task retries (backoff up to
    ``ttl_s / 3``); when etcd answers that the lease is gone (it expired during an outage, or the cluster
    was rebuilt) a new lease is granted and every key is put again. :meth:`aclose` revokes the lease so
    the keys vanish at once; without revoking they vanish ``ttl_s`` after the last renewal, which is
    what happens when the process dies. The client belongs to the caller.
    """

    def __init__(self, client: etcd3aio.Etcd3Client, ttl_s: int = 10, *, timeout_s: float = 2.0) -> None:
        if ttl_s < 1:
            raise ConfigError(f"lease ttl_s must be >= 1, got {ttl_s}")
        self._client = client
        self.ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._keys: dict[str, bytes] = {}
        self._stale: set[str] = set()  # deleted locally, maybe still in etcd under the live lease
        self._lease: int | None = None
        self._dirty = True
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._connected = False
        self.counters: dict[str, int] = {"grants": 0, "lost": 0, "errors": 0}

    @property
    def lease_id(self) -> int | None:
        return self._lease

    @property
    def registered(self) -> bool:
        """The lease is alive and every key is written under it (as of the last call to etcd)."""
        return self._connected and self._lease is not None and not self._dirty

    @property
    def keys(self) -> Mapping[str, bytes]:
        return dict(self._keys)

    async def start(self, keys: Mapping[str, bytes] | None = None) -> bool:
        """Register ``keys`` and start renewing; returns whether the first registration succeeded
        (if not, the background task keeps trying)."""
        if self._task is not None:
            raise RuntimeError("LeasedKeys already started")
        self._keys.update(keys or {})
        ok = await self._tick()
        self._task = asyncio.create_task(self._run(), name="etcd-lease")
        return ok

    async def update(self, key: str, value: bytes) -> bool:
        """Set ``key`` under the lease; returns whether it reached etcd now (else it is re-put later)."""
        self._keys[key] = value
        self._stale.discard(key)
        async with self._lock:
            if self._lease is None:
                return False
            try:
                await self._kv().put(key, value, lease=self._lease, timeout=self._timeout_s)
            except ETCD_ERRORS as exc:
                self._dirty = True
                self._failed(exc)
                return False
            return True

    async def delete(self, key: str) -> None:
        """Forget ``key`` and delete it from etcd (now, or once etcd is reachable again)."""
        self._keys.pop(key, None)
        async with self._lock:
            if self._lease is None:
                return
            try:
                await self._kv().delete(key, timeout=self._timeout_s)
            except ETCD_ERRORS as exc:
                self._stale.add(key)
                self._dirty = True
                self._failed(exc)

    async def aclose(self, revoke: bool = True) -> None:
        """Stop renewing; with ``revoke`` also revoke the lease so the keys disappear at once."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        lease, self._lease = self._lease, None
        if revoke and lease is not None and self._client.lease is not None:
            try:
                await self._client.lease.revoke(lease, timeout=self._timeout_s)
            except ETCD_ERRORS as exc:
                log.warning("etcd lease %x: revoke failed (%s); keys expire in %d s", lease, exc, self.ttl_s)

    def _kv(self) -> etcd3aio.kv.KVService:
        if self._client.kv is None:
            raise RuntimeError("etcd client is not connected")
        return self._client.kv

    def _leases(self) -> etcd3aio.lease.LeaseService:
        if self._client.lease is None:
            raise RuntimeError("etcd client is not connected")
        return self._client.lease

    async def _run(self) -> None:
        interval, failures = self.ttl_s / 3, 0 if self._connected else 1
        while True:
            await asyncio.sleep(min(interval, 0.05 * 2**failures) if failures else interval)
            failures = 0 if await self._tick() else min(failures + 1, 16)

    async def _tick(self) -> bool:
        """One renewal (or grant + puts); ``False`` when etcd could not be reached."""
        async with self._lock:
            try:
                if self._lease is not None and await self._keepalive(self._lease) <= 0:
                    log.warning("etcd lease %x expired; registering again", self._lease)
                    self.counters["lost"] += 1
                    self._lease = None
                if self._lease is None:
                    grant = await self._leases().grant(self.ttl_s, timeout=self._timeout_s)
                    self._lease, self._dirty = int(grant.ID), True
                    self._stale.clear()  # keys of the lost lease are gone with it
                    self.counters["grants"] += 1
                if self._dirty:
                    await self._put_all(self._lease)
            except ETCD_ERRORS as exc:
                self._failed(exc)
                return False
        if not self._connected:
            log.info("etcd lease %x: %d key(s) registered", self._lease, len(self._keys))
        self._connected = True
        return True

    async def _put_all(self, lease: int) -> None:
        kv = self._kv()
        for key in sorted(self._stale):
            await kv.delete(key, timeout=self._timeout_s)
            self._stale.discard(key)
        for key, value in list(self._keys.items()):
            await kv.put(key, value, lease=lease, timeout=self._timeout_s)
        self._dirty = False

    async def _keepalive(self, lease: int) -> int:
        """Renew once; the TTL etcd reports (0: the lease no longer exists)."""
        call = self._leases().keep_alive(lease)
        try:
            async with asyncio.timeout(self._timeout_s):
                async for response in call:
                    return int(response.TTL)
        finally:
            call.cancel()
        raise TimeoutError("lease keepalive stream closed without an answer")

    def _failed(self, exc: BaseException) -> None:
        self.counters["errors"] += 1
        if self._connected:
            log.warning("etcd unreachable for lease renewal: %s", describe_error(exc))
        self._connected = False


def describe_error(exc: BaseException) -> str:
    """A one-line reason for an etcd failure (gRPC errors carry multi-line text), for logs and CLIs."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
