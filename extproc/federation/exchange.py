"""The summary exchange, its gRPC shell: :class:`SummaryService` serves this cluster's reports to linked
peers, :class:`SummaryFollower` subscribes to every linked peer's service and hands what arrives to the
:class:`~extproc.federation.peers.Federation` core.

Wire: :data:`contracts.federation.SUBSCRIBE_METHOD` (server streaming, msgpack). Security: with
``[federation] tls_*`` the service requires a client certificate chaining to ``tls_ca`` whose URI SAN is
a linked cluster's ``identity`` (anything else: ``PERMISSION_DENIED`` before a report is sent; checked
again against the links in force before every report, so a link removed or changed ends its stream), and the
follower presents this cluster's certificate and verifies the peer's against ``tls_ca`` (chain and
address; gRPC's Python client offers no hook to check the server's URI SAN as well). Both follow
rotation of the ``tls_*`` files: the service through :class:`~runtime.tls.ReloadingServerCerts`, the
follower through :class:`~runtime.tls.ReloadingClientCerts` (each new subscription, a running one keeps
its connection). Without ``tls_*``
(local experiments only) both sides talk plaintext and any caller gets reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path

import grpc

from contracts.federation import (
    MAX_REPORT_BYTES,
    SUBSCRIBE_METHOD,
    FederationWireError,
    Hello,
    Report,
    decode_hello,
    decode_report,
    encode,
)
from extproc.federation.health import Outcome
from extproc.federation.links import FederationConfig, Link
from extproc.federation.peers import Federation
from runtime.identity import PeerCheck
from runtime.listen import add_grpc_port
from runtime.tls import (
    ClientTlsFiles,
    ReloadingClientCerts,
    ReloadingServerCerts,
    ServerTlsFiles,
    secure_channel,
)

log = logging.getLogger(__name__)

RETRY_S = (0.2, 5.0)
"""A lost subscription is retried after 0.2 s, doubling to 5 s."""
SILENT_TTLS = 3.0
"""A subscription on which nothing arrived for this many ``ttl_s`` (9 s by default) is dropped and made
again: a peer (or a path) that died without closing the stream; reports come every ``refresh_s``."""
CHANNEL_OPTIONS = (
    # Ping a quiet connection so a peer that vanished without closing it is noticed (as the index feeds).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
)


def server_files(config: FederationConfig) -> ServerTlsFiles | None:
    if config.tls_cert and config.tls_key and config.tls_ca:
        return ServerTlsFiles(Path(config.tls_cert), Path(config.tls_key), Path(config.tls_ca))
    return None


def client_files(config: FederationConfig) -> ClientTlsFiles | None:
    if config.tls_cert and config.tls_key and config.tls_ca:
        return ClientTlsFiles(ca=Path(config.tls_ca), cert=Path(config.tls_cert), key=Path(config.tls_key))
    return None


class SummaryService:
    """Serves :data:`SUBSCRIBE_METHOD`: each subscriber gets ``report()`` at once, then every
    ``refresh_s`` seconds (one report built per interval, shared by the subscribers)."""

    def __init__(
        self,
        federation: Federation,
        report: Callable[[], Report],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._federation = federation
        self._report = report
        self._clock = clock
        self._cached: tuple[float, bytes] | None = None
        self._server: grpc.aio.Server | None = None
        self._check: PeerCheck | None = None
        self.port = 0
        self.subscribers = 0

    def _linked(self, uris: Collection[str]) -> bool:
        links = self._federation.links
        return any(links.by_identity(uri) is not None for uri in uris)

    def _current(self) -> bytes:
        now = self._clock()
        cached = self._cached
        if cached is None or now - cached[0] >= self._federation.config.refresh_s:
            cached = self._cached = (now, encode(self._report()))
        return cached[1]

    async def _subscribe(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            hello = decode_hello(request)
        except FederationWireError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad hello")
            return
        log.info("federation: cluster %s subscribed to summaries", hello.cluster[:64])
        self.subscribers += 1
        try:
            while True:
                # the links in force now, not only when the stream opened: a link removed or changed
                # meanwhile ends the stream before its next report
                if self._check is not None and not self._check.permits(context):
                    await context.abort(
                        grpc.StatusCode.PERMISSION_DENIED, "this identity is no longer a linked cluster's"
                    )
                    return
                yield self._current()
                await asyncio.sleep(self._federation.config.refresh_s)
        finally:
            self.subscribers -= 1

    async def start(self) -> None:
        config = self._federation.config
        files = server_files(config)
        self._check = PeerCheck(self._linked, "the federation service") if files is not None else None
        interceptors = [self._check] if self._check is not None else []
        server = grpc.aio.server(
            interceptors=interceptors, options=[("grpc.max_send_message_length", MAX_REPORT_BYTES)]
        )
        handler = grpc.method_handlers_generic_handler(
            "kvgate.federation.v1.Federation",
            {"Subscribe": grpc.unary_stream_rpc_method_handler(self._subscribe)},
        )
        server.add_generic_rpc_handlers((handler,))
        if files is not None:
            self.port = add_grpc_port(server, config.listen, ReloadingServerCerts(files).credentials())
        else:
            self.port = add_grpc_port(server, config.listen)
        await server.start()
        self._server = server

    async def aclose(self, grace_s: float = 0.1) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None


class SummaryFollower:
    """One subscription per linked peer, kept open (retried with back-off) and reconciled with the link
    table on :meth:`sync`. A report goes to the core; a lost, refused or silent subscription (nothing for
    ``silent_s``, :data:`SILENT_TTLS` x ``ttl_s`` by default) counts as the peer ``unreachable``
    (:mod:`extproc.federation.health`) and is made again, the first report after it as ``ok``."""

    def __init__(
        self,
        federation: Federation,
        *,
        clock: Callable[[], float] = time.monotonic,
        silent_s: float | None = None,
    ) -> None:
        self._federation = federation
        self._clock = clock
        #: How long a subscription may stay silent (``SILENT_TTLS x ttl_s`` unless given).
        self._silent_s = silent_s if silent_s is not None else SILENT_TTLS * federation.config.ttl_s
        files = client_files(federation.config)
        # Each subscription presents the certificate in force when it starts (runtime.tls.RotatingChannel).
        self._tls = ReloadingClientCerts(files, where="federation") if files is not None else None
        self._tasks: dict[str, tuple[Link, asyncio.Task[None]]] = {}
        self.reports = 0

    def sync(self) -> None:
        """Start, restart (changed service address) or stop subscriptions to match the links in force."""
        links = self._federation.links.links()
        for name in list(self._tasks):
            link, task = self._tasks[name]
            if links.get(name) is None or links[name].service != link.service:
                task.cancel()
                del self._tasks[name]
        for name, link in links.items():
            if name not in self._tasks:
                task = asyncio.create_task(self._follow(link), name=f"kvgate-federation-{name}")
                self._tasks[name] = (link, task)

    def _channel(self, address: str) -> grpc.aio.Channel:
        options = [("grpc.max_receive_message_length", MAX_REPORT_BYTES), *CHANNEL_OPTIONS]
        if self._tls is not None:
            return secure_channel(address, self._tls, options)
        return grpc.aio.insecure_channel(address, options=options)

    async def _follow(self, link: Link) -> None:
        fed = self._federation
        delay = RETRY_S[0]
        hello = Hello(fed.cluster)
        while True:
            fresh = True
            try:
                async with self._channel(link.service) as channel:
                    method = channel.unary_stream(
                        SUBSCRIBE_METHOD, request_serializer=encode, response_deserializer=None
                    )
                    call = method(hello)
                    while True:
                        try:  # asyncio.timeout, not wait_for (which can swallow a cancellation in 3.11)
                            async with asyncio.timeout(self._silent_s):
                                data = await call.read()
                        except TimeoutError:
                            call.cancel()
                            raise FederationWireError(f"nothing for {self._silent_s:g} s") from None
                        if data is grpc.aio.EOF:
                            raise FederationWireError("the stream ended")
                        assert isinstance(data, bytes)
                        report = decode_report(data)
                        if report.cluster != link.cluster:
                            raise FederationWireError(f"{link.service} reports as {report.cluster[:64]!r}")
                        now = self._clock()
                        if fresh:
                            fed.observe(link.cluster, Outcome.OK, now)
                            fresh = False
                        fed.received(report, now, len(data))
                        self.reports += 1
                        delay = RETRY_S[0]
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, FederationWireError) as exc:
                detail = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.warning("federation: summaries from %s lost (%s)", link.cluster, detail)
            fed.observe(link.cluster, Outcome.UNREACHABLE, self._clock())
            await asyncio.sleep(delay)
            delay = min(RETRY_S[1], delay * 2)

    async def aclose(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
