"""The etcd client side shared by every process: the connection, leased keys, and what a failure looks like.

The schema, the settings and the value codecs are :mod:`contracts.etcd` (pure). Only :mod:`etcd3aio`
(grpc.aio) talks to etcd in kvgate: one etcd client library per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path

import etcd3aio
import etcd3aio.connections
import grpc
import grpc.aio

from contracts.errors import ConfigError
from contracts.etcd import EtcdSettings
from runtime.tls import ClientTlsFiles, ReloadingClientCerts, RotatingChannel

log = logging.getLogger(__name__)

#: What a failed etcd call raises: etcd3aio's mapped errors, unmapped gRPC statuses, timeouts.
ETCD_ERRORS: tuple[type[BaseException], ...] = (etcd3aio.EtcdError, grpc.aio.AioRpcError, TimeoutError)


def _pem(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"etcd {what} {path}: {exc.strerror}") from exc


class _RotatingConnections(etcd3aio.connections.ConnectionManager):
    """etcd3aio's channel maker, making a :class:`~runtime.tls.RotatingChannel` instead: every etcd call
    (a KV call, a lease keepalive, a watch stream, also one etcd3aio retries) made after the client
    certificate rotated goes on a connection that presents the new one, whose CN etcd reads as the user;
    streams under way keep theirs."""

    def __init__(self, endpoints: list[str], tls: ReloadingClientCerts) -> None:
        super().__init__(endpoints)
        self.tls = tls

    def get_channel(
        self,
        ca_cert: bytes | None = None,
        cert_key: bytes | None = None,
        cert_chain: bytes | None = None,
        tls_server_name: str | None = None,
    ) -> grpc.aio.Channel:
        options = list(self.grpc_options)
        if tls_server_name is not None:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        return RotatingChannel(self.target, self.tls, options)


async def connect(settings: EtcdSettings) -> etcd3aio.Etcd3Client:
    """An etcd client with its channel open (no call made yet: an unreachable etcd fails later calls).
    With a CA, a certificate and a key, the certificate follows rotation (:class:`_RotatingConnections`).

    The caller owns it and closes it with ``await client.close()``."""
    client = etcd3aio.Etcd3Client(
        list(settings.endpoints),
        tls_server_name=settings.tls_server_name,
        watch_max_reconnect_backoff_seconds=1.0,
        ca_cert=_pem(settings.tls_ca, "tls_ca"),
        cert_chain=_pem(settings.tls_cert, "tls_cert"),
        cert_key=_pem(settings.tls_key, "tls_key"),
    )
    if settings.tls_ca is not None and settings.tls_cert is not None and settings.tls_key is not None:
        files = ClientTlsFiles(Path(settings.tls_ca), Path(settings.tls_cert), Path(settings.tls_key))
        client._manager = _RotatingConnections(
            list(settings.endpoints), ReloadingClientCerts(files, where="etcd")
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
