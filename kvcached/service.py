"""The local API of kvcached, served: the methods and messages of :mod:`contracts.kvcached` over a store.

Bad input (a digest that is not 16 bytes, a block over ``max_block_bytes``, a checksum that does not
match the bytes, an undecodable message) is answered ``INVALID_ARGUMENT`` with the reason; nothing is
stored. A message over the gRPC limit (``max_block_bytes`` + 1 MiB) is refused by gRPC itself with
``RESOURCE_EXHAUSTED``. A store failure (:class:`~kvcached.errors.KvcachedError`: a disk that refuses a
write) is ``INTERNAL`` with its reason; any other exception is ``INTERNAL`` with a generic message and is
logged by type and place only (its message may quote the request). Every answer is counted in
``kvcached_requests_total{method,code}``.

Get on a local miss, when peers are known and the request allows it, asks every peer at once over QUIC
(:class:`~kvcached.peers.PeerClient`; only whole, checksum-verified blocks come back), takes the first
answer, stores it in the RAM tier and answers with it; concurrent Gets of one missing digest share one
fetch. A peer that is down costs at most the QUIC timeout and counts as a miss.

The store is called directly on the event loop, never from threads: :class:`~kvcached.tiers.TieredStore`
is single-threaded, its listener publishes to the feed (which must run on the loop), and a RAM hit
(tens of microseconds) would pay more for a thread hop than for the lookup. A large SSD read or write
blocks the loop for its duration (about a millisecond per MiB).

Served on a unix socket (plaintext: the socket's file mode is the access control) and/or TCP (mTLS only,
client certificate required, files re-read on rotation via :class:`runtime.tls.ReloadingServerCerts`;
only agents' and operators' identities may call it, :mod:`certs.roles` hop ``kvcached-api``: any other
gets PERMISSION_DENIED).

Memory: gRPC receives a call's whole message (up to ``max_block_bytes`` + 1 MiB) before the handler runs
and keeps a Get's reply until it is sent, so each listener serves at most ``max_concurrent_rpcs`` calls at
once (gRPC's ``maximum_concurrent_rpcs``, counted from a call's arrival until its reply is sent); one
more is answered ``RESOURCE_EXHAUSTED`` at once, before its message is read, and nothing of it is
stored. The messages the API holds are then at most ``listeners x max_concurrent_rpcs x (max_block_bytes
+ 1 MiB)`` (a call holds one large message: a Put its request, a Get its reply).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import msgspec

from contracts.errors import MSGPACK_ERRORS
from contracts.kvcached import (
    MAX_BLOCK_BYTES_DEFAULT,
    MESSAGE_SLACK,
    SERVICE,
    ContainsReply,
    ContainsRequest,
    DeleteReply,
    DeleteRequest,
    GetReply,
    GetRequest,
    PutReply,
    PutRequest,
    StatsReply,
    StatsRequest,
)
from contracts.versions import DIGEST_VERSION
from kvcached.block import check_digest
from kvcached.config import MAX_CONCURRENT_RPCS_DEFAULT, TlsFiles
from kvcached.errors import BadRequest, KvcachedError, PeerUnavailable
from kvcached.metrics import KvcachedMetrics
from kvcached.peers import PeerClient
from kvcached.remote import RemoteFetchPolicy
from kvcached.tiers import TieredStore
from runtime.identity import KVCACHED_API, PeerCheck, hop_callers
from runtime.listen import add_grpc_port
from runtime.tls import ReloadingServerCerts, ServerTlsFiles
from runtime.tracing.tracer import TRACE_HEADERS, Span, SpanKind, Tracer, active, current_span

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=msgspec.Struct)
_encoder = msgspec.msgpack.Encoder()


#: The methods of the fetch path, traced when tracing is on.
TRACED_METHODS = ("Get", "Contains")


def _where(exc: BaseException) -> str:
    """``file:line in function`` where ``exc`` was raised: enough to find the bug, while the message,
    which may quote a request's bytes, stays out of the log."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    last = frames[-1]
    return f"{os.path.basename(last.filename)}:{last.lineno} in {last.name}"


def _server_span(tracer: Tracer, name: str, context: Any) -> Span:
    """A server span for one call, its parent the caller's ``traceparent`` metadata (if any)."""
    carrier = {k: v for k, v in context.invocation_metadata() or () if k in TRACE_HEADERS}
    return tracer.start(name, parent=tracer.extract(carrier), kind=SpanKind.SERVER)


class KvcachedService:
    """The API's behaviour over a store; ``peers()`` gives the QUIC addresses to ask on a local miss
    (``None`` or no ``peer_client``: never ask). ``peer_timeout_s``: a fetch that has not finished by
    then is abandoned (the client's own timeout should fire first). ``remote_peers``: other clusters'
    daemons (QUIC addresses), asked only after every peer of this cluster missed and only while
    ``remote`` (:class:`~kvcached.remote.RemoteFetchPolicy`) allows it; ``clock``: monotonic seconds."""

    def __init__(
        self,
        store: TieredStore,
        *,
        metrics: KvcachedMetrics | None = None,
        peer_client: PeerClient | None = None,
        peers: Callable[[], Sequence[str]] | None = None,
        peer_timeout_s: float = 2.0,
        tracer: Tracer | None = None,
        remote_peers: Sequence[str] = (),
        remote: RemoteFetchPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        #: Spans of Get and Contains (the fetch path); ``None``: tracing off.
        self._tracer = tracer
        self.metrics = metrics if metrics is not None else KvcachedMetrics()
        self.metrics.watch_store(store.stats)
        self._peer_client = peer_client
        self._peers = peers
        self._peer_timeout_s = peer_timeout_s
        self._inflight: dict[bytes, asyncio.Task[bytes | None]] = {}
        #: Peer fetches: hits, misses (no peer had it), unavailable (peer down or timed out), bytes.
        self.peer_counters = {"hits": 0, "misses": 0, "unavailable": 0, "bytes": 0}
        self._remote_peers = tuple(remote_peers)
        self._remote = remote
        self._clock = clock
        #: Cross-cluster fetches: hits, misses, refused (policy or budget), bytes.
        self.remote_counters = {"hits": 0, "misses": 0, "refused": 0, "bytes": 0}

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic gRPC handler serving every method (raw bytes in and out)."""
        table: dict[str, Callable[[bytes, Any], Awaitable[bytes]]] = {
            "Put": self._wrap("Put", PutRequest, self.put),
            "Get": self._wrap("Get", GetRequest, self.get),
            "Contains": self._wrap("Contains", ContainsRequest, self.contains),
            "Delete": self._wrap("Delete", DeleteRequest, self.delete),
            "Stats": self._wrap("Stats", StatsRequest, self.stats),
        }
        return grpc.method_handlers_generic_handler(
            SERVICE, {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in table.items()}
        )

    def _wrap(
        self, method: str, kind: type[Req], fn: Callable[[Req], Awaitable[msgspec.Struct]]
    ) -> Callable[[bytes, Any], Awaitable[bytes]]:
        decoder = msgspec.msgpack.Decoder(kind)
        seconds = self.metrics.request_seconds.labels(method)

        tracer = self._tracer if method in TRACED_METHODS else None

        async def serve(raw: bytes, context: Any) -> bytes:
            started = time.perf_counter()
            code, message, reply = grpc.StatusCode.OK, "", b""
            span = None if tracer is None else _server_span(tracer, f"kvcached.{method}", context)
            self.metrics.api_in_flight.inc()
            try:
                if span is None:
                    reply = _encoder.encode(await fn(decoder.decode(raw)))
                else:
                    with active(span):
                        reply = _encoder.encode(await fn(decoder.decode(raw)))
            except (*MSGPACK_ERRORS, BadRequest) as exc:
                code, message = grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {exc}"
            except KvcachedError as exc:
                code, message = grpc.StatusCode.INTERNAL, f"{method}: {exc}"
                log.warning("%s failed: %s", method, exc)
            except Exception as exc:  # a bug or an untranslated library error: answered, counted, logged
                code, message = grpc.StatusCode.INTERNAL, f"{method}: internal error"
                log.error("%s failed: unexpected %s at %s", method, type(exc).__name__, _where(exc))
            finally:
                self.metrics.api_in_flight.dec()
                seconds.observe(time.perf_counter() - started)
                if span is not None:
                    span.set_attribute("rpc.grpc.status_code", code.value[0])
                    span.end()
            self.metrics.requests.labels(method, code.name).inc()
            if code is not grpc.StatusCode.OK:
                await context.abort(code, message)
            return reply

        return serve

    # -- methods (also callable in process) -------------------------------------------------------------

    async def put(self, request: PutRequest) -> PutReply:
        self.store.put(request.digest, request.data, request.checksum)
        return PutReply(self.store.tier_of(request.digest))

    async def get(self, request: GetRequest) -> GetReply:
        started = time.perf_counter()
        digest = check_digest(request.digest)
        tier = self.store.tier_of(digest)
        data = self.store.get(digest)
        source = tier if data is not None else None
        if data is None and request.peers:
            if self._tracer is None:
                data = await self._from_peers(digest)
            else:  # a child of the current kvcached.Get span
                span = self._tracer.start("kvcached.peer_fetch", kind=SpanKind.CLIENT)
                data = await self._from_peers(digest)
                span.set_attribute("kvcached.hit", data is not None)
                span.end()
            source = "peer" if data is not None else None
        self.metrics.get_seconds.labels(source or "miss").observe(time.perf_counter() - started)
        if self._tracer is not None:
            current_span().set_attribute("kvcached.source", source or "miss")
        return GetReply(data, source)

    async def contains(self, request: ContainsRequest) -> ContainsReply:
        for digest in request.digests:
            check_digest(digest)
        prefix, tiers = self.store.longest_prefix(request.digests)
        return ContainsReply(self.store.contains(request.digests), prefix, list(tiers))

    async def delete(self, request: DeleteRequest) -> DeleteReply:
        return DeleteReply(self.store.delete(check_digest(request.digest)))

    async def stats(self, request: StatsRequest) -> StatsReply:
        stats = {k: float(v) for k, v in self.store.stats().items()}
        stats.update({f"peer_{k}": float(v) for k, v in self.peer_counters.items()})
        if self._remote is not None:
            stats.update({f"remote_{k}": float(v) for k, v in self.remote_counters.items()})
        return StatsReply(stats, DIGEST_VERSION)

    # -- peers -----------------------------------------------------------------------------------------

    async def _from_peers(self, digest: bytes) -> bytes | None:
        if self._peer_client is None or self._peers is None:
            return None
        task = self._inflight.get(digest)
        if task is None:
            task = asyncio.ensure_future(self._fetch_any(digest))
            self._inflight[digest] = task
            task.add_done_callback(lambda _: self._inflight.pop(digest, None))
        return await asyncio.shield(task)

    async def _fetch_any(self, digest: bytes) -> bytes | None:
        """Ask every peer of this cluster at once; the first block wins and is stored in RAM. If none has
        it, other clusters' daemons, when policy allows (:meth:`_fetch_remote`)."""
        addresses = list(self._peers() if self._peers is not None else ())
        if addresses:
            data = await self._first(addresses, digest)
            if data is not None:
                self.peer_counters["hits"] += 1
                self.peer_counters["bytes"] += len(data)
                self.metrics.peer_fetch_bytes.inc(len(data))
                self._keep(digest, data)
                return data
            self.peer_counters["misses"] += 1
        return await self._fetch_remote(digest)

    async def _fetch_remote(self, digest: bytes) -> bytes | None:
        remote = self._remote
        if remote is None or not self._remote_peers or self._peer_client is None:
            return None
        if not remote.may_fetch(self._clock()):
            self.remote_counters["refused"] += 1
            return None
        held = self.store.max_block_bytes  # what one fetch may pull: misses meanwhile may find a debt
        remote.hold(held, self._clock())
        try:
            data = await self._first(list(self._remote_peers), digest)
        finally:
            remote.release(held, self._clock())
        if data is None:
            self.remote_counters["misses"] += 1
            return None
        remote.charge(len(data), self._clock())
        self.remote_counters["hits"] += 1
        self.remote_counters["bytes"] += len(data)
        self._keep(digest, data)
        return data

    def _keep(self, digest: bytes, data: bytes) -> None:
        with contextlib.suppress(KvcachedError):  # e.g. over our own size limit
            self.store.put(digest, data)

    async def _first(self, addresses: list[str], digest: bytes) -> bytes | None:
        """The first block any of ``addresses`` returns (the others are cancelled), or ``None``."""
        tasks = [asyncio.ensure_future(self._fetch_one(address, digest)) for address in addresses]
        try:
            for next_done in asyncio.as_completed(tasks):
                data = await next_done
                if data is not None:
                    return data
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return None

    async def _fetch_one(self, address: str, digest: bytes) -> bytes | None:
        assert self._peer_client is not None
        started = time.perf_counter()
        outcome = "miss"
        try:
            async with asyncio.timeout(self._peer_timeout_s):
                blocks = await self._peer_client.fetch(address, [digest])
        except (PeerUnavailable, TimeoutError) as exc:
            self.peer_counters["unavailable"] += 1
            log.info("peer %s unavailable: %s", address, exc or "timed out")
            outcome, blocks = "unavailable", {}
        data = blocks.get(digest)
        if data is not None:
            outcome = "hit"
        self.metrics.peer_fetch_seconds.labels(outcome).observe(time.perf_counter() - started)
        return data


class ApiServer:
    """The gRPC server of a :class:`KvcachedService`: a unix socket (plaintext) and/or TCP (mTLS).
    ``max_concurrent_rpcs``: calls each listener serves at once; one more is ``RESOURCE_EXHAUSTED``
    before its message is read (module docstring). :attr:`tcp_port` is the bound TCP port after
    :meth:`start` (0: no TCP listener)."""

    def __init__(
        self,
        service: KvcachedService,
        *,
        listen_unix: str | None = None,
        listen_tcp: str | None = None,
        tls: TlsFiles | None = None,
        max_block_bytes: int = MAX_BLOCK_BYTES_DEFAULT,
        max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS_DEFAULT,
    ) -> None:
        if listen_tcp is not None and tls is None:
            raise ValueError("the TCP API is mTLS only: tls files are required")
        if max_concurrent_rpcs < 1:
            raise ValueError("max_concurrent_rpcs must be >= 1")
        self.max_concurrent_rpcs = max_concurrent_rpcs
        service.metrics.api_max_concurrent_rpcs.set(max_concurrent_rpcs)
        self._service = service
        self._unix = listen_unix
        self._tcp = listen_tcp
        self._certs = None if tls is None else ReloadingServerCerts(ServerTlsFiles(tls.cert, tls.key, tls.ca))
        limit = max_block_bytes + MESSAGE_SLACK
        self._options = (("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit))
        self._servers: list[Any] = []
        self.tcp_port = 0

    async def start(self) -> None:
        # Two servers: the role check applies to TCP callers only (the Unix socket's file mode guards it).
        servers = []
        if self._unix is not None:
            _remove_stale_socket(Path(self._unix))
            local = grpc.aio.server(
                handlers=[self._service.handler()],
                options=self._options,
                maximum_concurrent_rpcs=self.max_concurrent_rpcs,
            )
            add_grpc_port(local, f"unix:{self._unix}")
            servers.append(local)
        if self._tcp is not None and self._certs is not None:
            agents = [PeerCheck(hop_callers(KVCACHED_API), "kvcached's API")]
            remote = grpc.aio.server(
                handlers=[self._service.handler()],
                options=self._options,
                interceptors=agents,
                maximum_concurrent_rpcs=self.max_concurrent_rpcs,
            )
            self.tcp_port = add_grpc_port(remote, self._tcp, self._certs.credentials())
            servers.append(remote)
        for server in servers:
            await server.start()
        self._servers = servers
        log.info(
            "kvcached API on %s", ", ".join(filter(None, [self._unix, self._tcp and f"tcp:{self.tcp_port}"]))
        )

    async def aclose(self, grace_s: float = 0.0) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            await server.stop(grace_s)
        if self._unix is not None:
            with contextlib.suppress(OSError):
                _remove_stale_socket(Path(self._unix))


def _remove_stale_socket(path: Path) -> None:
    """Remove a socket file left by a previous run (never a regular file: that is a config mistake)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise KvcachedError(f"{path} exists and is not a socket")
    path.unlink()
