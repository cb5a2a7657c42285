"""Peer fetch over QUIC (aioquic): a node asks a peer for blocks it lacks, with mTLS both ways.

Protocol (:mod:`kvcached.wire`): one fetch request is one bidirectional stream naming up to
:data:`~kvcached.wire.MAX_REQUEST_DIGESTS` digests; the server streams back one length-prefixed frame per
block it holds and ends the stream. A framed multi-block stream rather than a stream per block: one round
trip and one request per chain instead of one per block, blocks leave in chain order so the client can use
a leading run as soon as it lands, and the server's per-connection concurrency bound (streams) counts
requests, not blocks. Longer digest lists are split into several streams on the same connection.

Connections are kept per peer address and reused (the handshake costs a round trip and a few ms of CPU);
a connection that failed or timed out is dropped and the next fetch dials again; one that closed while
unused (its peer stopped, or left and it idled out) is closed, socket included, by the next dial.

mTLS: the client verifies the server certificate against the CA and the address's host (aioquic's own
check), then, before its first request, that the certificate names the ``kvcached`` role
(:data:`certs.roles.SERVERS`; another role: the connection is closed and the peer is unavailable).
aioquic has no setting that makes a *server* require a client certificate (its
``_request_client_certificate`` is marked "for test purposes only" and, when set, still neither rejects an
empty certificate nor verifies the chain), so :func:`_require_client_cert` hooks each server connection's
TLS context: it requests a certificate, rejects an empty one with ``certificate_required``, and after
aioquic has checked the CertificateVerify signature (proof of the key) verifies the chain against the CA
and the ``clientAuth`` usage, failing the handshake with ``bad_certificate``, and the identity: only a
``kvcached`` certificate (URI SAN ``spiffe://kvgate.local/kvcached[-suffix]``, :data:`certs.roles.CALLERS`)
may fetch, another role fails the handshake with ``access_denied``. Only then is the connection
marked authenticated; stream data on a connection that is not is never served (belt and braces). The hook
uses aioquic internals (``QuicConnection._initialize``, ``tls.Context._server_handle_certificate*``),
pinned by the tests that reject a client without a valid certificate.

Bounds: per connection at most ``max_concurrent_streams`` requests are served at once (the QUIC
``max_streams_bidi`` limit advertised to the client and a semaphore); per client at most
``max_in_flight`` requests; server egress is paced by one token bucket (bytes/s) shared by all
connections; at most :data:`HIGH_WATER_BYTES` of unacknowledged data is queued per stream; a client may
open no unidirectional stream (one opened anyway closes its connection). What every connection's requests
and responses buffer is charged to one server-wide :class:`~kvcached.budget.ByteBudget` (``buffer_bytes``):
a request stream :data:`REQUEST_CHARGE_BYTES` from its first byte until its response ends, a response each
frame while it is queued and its stream's unacknowledged queue until the client acknowledged all of it
(a response ends only then); a stream that does not fit is reset with :data:`ERR_BUSY` (a miss for the
blocks not yet whole), and every charge is given back on every path (done, failed, reset or stopped by the
client, connection lost, server closed). The client
keeps only the first frame of each digest it asked for (dropped as they complete) and abandons a response
(STOP_SENDING) past one largest record per digest asked (its highest offset counts: aioquic zero-fills
gaps) and grants the server no stream of its own; a fetch cancelled by its caller sends
STOP_SENDING (``ERR_CANCELLED``), which ends the server's response task. Timeouts:
dialing must finish within ``timeout_s`` and a response must make progress at least every ``timeout_s``,
else :class:`~kvcached.errors.PeerUnavailable` (a miss; never a hang); the server resets a response whose
queued data no acknowledgement reduces for ``stall_timeout_s`` (the daemon's ``quic.timeout_s``).

Threading: everything runs on one asyncio loop; the store is called from it directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from aioquic import tls
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer, serve
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import Limit, QuicConnection
from aioquic.quic.packet import QuicErrorCode, QuicFrameType
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from contracts.errors import ConfigError
from contracts.kvcached import MAX_BLOCK_BYTES_DEFAULT
from kvcached.block import HEADER_BYTES, check_digest, encode_record, verify_record
from kvcached.budget import ByteBudget
from kvcached.datagrams import HANDSHAKE_DATAGRAM_MAX, grow_datagrams
from kvcached.errors import BadRequest, CorruptBlock, KvcachedConfigError, KvcachedError, PeerUnavailable
from kvcached.wire import (
    ALPN,
    FRAME_HEADER_BYTES,
    MAX_REQUEST_DIGESTS,
    RECORD_OVERHEAD_MAX,
    Frame,
    FrameReader,
    TokenBucket,
    decode_request,
    encode_request,
    frame_header,
    max_request_bytes,
)
from runtime.identity import KVCACHED_PEERS, certificate_uris, permits, serves
from runtime.listen import binding
from runtime.tls import ClientTlsFiles, Pem, ReloadingClientCerts

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024
"""Largest piece handed to QUIC at once (the unit of egress pacing and back-pressure)."""
HIGH_WATER_BYTES = 4 * 1024 * 1024
"""Unacknowledged bytes a server stream may queue before its sender waits for acknowledgements."""
STREAM_WINDOW_BYTES = 16 * 1024 * 1024
"""Client receive window per stream (QUIC flow control; aioquic's 1 MiB default caps throughput)."""
REQUEST_WINDOW_BYTES = max_request_bytes()
"""Server receive window per request stream: one largest request. aioquic doubles a window once more than
half of it arrived and zero-fills gaps before out-of-order data, so with the check on each stream's highest
offset (past :func:`~kvcached.wire.max_request_bytes`: refused) a request stream makes the server hold at
most about twice this, however its client sends."""
CONNECTION_WINDOW_BYTES = 64 * 1024 * 1024
"""Client receive window per connection."""
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
"""UDP socket send/receive buffers asked for (the kernel caps them at net.core.[rw]mem_max): the 208 KiB
default drops bursts on loopback, which halves the congestion window."""
DATAGRAM_BYTES_DEFAULT = 1200
"""QUIC datagram payload size: QUIC's minimum, safe on any path (aioquic has no path MTU discovery)."""
DATAGRAM_BYTES_MAX = 65_000
"""Largest ``max_datagram_size`` accepted: loopback (MTU 65,536) or jumbo frames; it must fit the path MTU
minus 28 bytes (:mod:`kvcached.datagrams`). Fewer, larger packets cut aioquic's per-packet Python cost."""
ERR_BAD_REQUEST = 0x1
"""Application error code of a stream reset for a malformed request."""
ERR_INTERNAL = 0x2
"""Application error code of a response stream the server could not finish (an unexpected error)."""
ERR_CANCELLED = 0x3
"""Application error code of a STOP_SENDING from a client that no longer wants the response."""
ERR_BUSY = 0x4
"""Application error code of a stream the server refused or ended because its buffers would exceed the
server-wide budget (:class:`~kvcached.budget.ByteBudget`); a client treats it like any reset: the blocks
not yet whole are a prompt miss."""
QUEUE_BYTES_MAX = HIGH_WATER_BYTES + CHUNK_BYTES
"""Most bytes a response stream queues unacknowledged (:data:`HIGH_WATER_BYTES`, then one more chunk)."""
REQUEST_CHARGE_BYTES = 4 * REQUEST_WINDOW_BYTES
"""What a request stream is charged to the server's budget from its first byte until its response ends:
aioquic's receive buffer (at most about twice the window), our copy of the request and its decoded
digests (~50 bytes of Python objects per 16-byte digest)."""
BUFFER_BYTES_DEFAULT = 1 << 30
"""The server-wide buffer budget by default (1 GiB; :func:`buffer_bytes_default`)."""


def response_charge_max(max_block_bytes: int) -> int:
    """Most a response of one block of ``max_block_bytes`` is charged at once: its record and frame header
    while queued, and its stream's queue (:data:`QUEUE_BYTES_MAX`)."""
    return FRAME_HEADER_BYTES + max_block_bytes + RECORD_OVERHEAD_MAX + QUEUE_BYTES_MAX


def buffer_bytes_default(max_block_bytes: int) -> int:
    """The default server-wide budget: :data:`BUFFER_BYTES_DEFAULT`, or room for two responses of the
    largest block (and their requests) when that is more."""
    return max(BUFFER_BYTES_DEFAULT, 2 * (response_charge_max(max_block_bytes) + REQUEST_CHARGE_BYTES))


class BlockSource(Protocol):
    """What the server reads blocks from (:class:`kvcached.tiers.TieredStore` satisfies it)."""

    def get(self, digest: bytes) -> bytes | None: ...


def _material(*, cert: Path, key: Path, ca: Path) -> ReloadingClientCerts:
    """The peer TLS files, followed through rotation (:class:`runtime.tls.ReloadingClientCerts`: stat on
    use; a new pair is adopted only when its key matches its certificate)."""
    try:
        return ReloadingClientCerts(ClientTlsFiles(ca, cert, key), where="kvcached peers")
    except ConfigError as exc:
        raise KvcachedConfigError(f"cannot load peer TLS files ({cert}, {key}, {ca}): {exc}") from exc


def _configuration(
    *, is_client: bool, pem: Pem, max_datagram_size: int = DATAGRAM_BYTES_DEFAULT
) -> QuicConfiguration:
    if not DATAGRAM_BYTES_DEFAULT <= max_datagram_size <= DATAGRAM_BYTES_MAX:
        raise KvcachedConfigError(
            f"max_datagram_size must be in [{DATAGRAM_BYTES_DEFAULT}, {DATAGRAM_BYTES_MAX}],"
            f" got {max_datagram_size}"
        )
    config = QuicConfiguration(
        is_client=is_client,
        max_datagram_size=min(max_datagram_size, HANDSHAKE_DATAGRAM_MAX),
        alpn_protocols=[ALPN],
        verify_mode=ssl.CERT_REQUIRED,
        max_data=CONNECTION_WINDOW_BYTES,
        max_stream_data=STREAM_WINDOW_BYTES,
        cadata=pem.ca,
    )
    try:  # what QuicConfiguration.load_cert_chain does with files, from the checked bytes
        chain = tls.load_pem_x509_certificates(pem.cert)
        config.certificate, config.certificate_chain = chain[0], chain[1:]
        config.private_key = tls.load_pem_private_key(pem.key)
    except (ValueError, TypeError, IndexError) as exc:
        raise KvcachedConfigError(f"cannot load peer TLS material: {exc}") from exc
    return config


class _CertificateRequired(tls.Alert):
    description = tls.AlertDescription.certificate_required


class _AccessDenied(tls.Alert):
    description = tls.AlertDescription.access_denied


def _require_client_cert(
    quic: QuicConnection,
    config: QuicConfiguration,
    on_verified: Callable[[], None],
    on_rejected: Callable[[str], None],
) -> None:
    """Make the server connection ``quic`` demand and verify a client certificate (module docstring);
    it presents ``config``'s certificate and verifies clients against ``config``'s CA (the material in
    force when the connection arrived)."""
    initialize = quic._initialize
    assert config.cadata is not None
    ca_data = config.cadata

    def hooked_initialize(peer_cid: bytes) -> None:
        initialize(peer_cid)
        ctx = quic.tls
        ctx.certificate, ctx.certificate_chain = config.certificate, config.certificate_chain
        ctx.certificate_private_key = config.private_key
        ctx._request_client_certificate = True
        handle_certificate = ctx._server_handle_certificate
        handle_verify = ctx._server_handle_certificate_verify

        def on_certificate(buf: Any) -> None:
            handle_certificate(buf)
            if ctx._peer_certificate is None:
                on_rejected("no client certificate")
                raise _CertificateRequired("a client certificate is required")

        def on_verify(buf: Any) -> None:
            handle_verify(buf)  # checks the CertificateVerify signature
            cert = ctx._peer_certificate
            assert cert is not None
            try:
                tls.verify_certificate(certificate=cert, chain=ctx._peer_certificate_chain, cadata=ca_data)
                try:
                    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
                except x509.ExtensionNotFound:
                    usage = None
                if usage is not None and ExtendedKeyUsageOID.CLIENT_AUTH not in usage:
                    raise tls.AlertBadCertificate("certificate not valid for client authentication")
                if not permits(KVCACHED_PEERS, certificate_uris(cert)):
                    raise _AccessDenied("certificate identity may not fetch blocks (not a kvcached)")
            except tls.Alert as exc:
                on_rejected(f"client certificate: {exc}")
                raise
            on_verified()

        ctx._server_handle_certificate = on_certificate  # type: ignore[method-assign, assignment]
        ctx._server_handle_certificate_verify = on_verify  # type: ignore[method-assign, assignment]

    quic._initialize = hooked_initialize  # type: ignore[method-assign]


def _grow_buffers(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError as exc:  # best effort: the default still works, only slower
            log.debug("cannot grow UDP socket buffer: %s", exc)


def _unacked(quic: QuicConnection, stream_id: int) -> int:
    """Bytes queued on a stream and not yet acknowledged (aioquic has no public drain signal)."""
    stream = quic._streams.get(stream_id)
    return len(stream.sender._buffer) if stream is not None else 0


class _Busy(KvcachedError):
    """A response's next frame does not fit the server's buffer budget."""


class _ServerProtocol(QuicConnectionProtocol):
    """One peer connection on the server: buffers each request stream, then serves it in a task."""

    def __init__(self, quic: QuicConnection, stream_handler: Any = None, *, server: PeerServer) -> None:
        super().__init__(quic, stream_handler)
        self._server = server
        self._authenticated = False
        self._requests: dict[int, bytearray] = {}
        #: What each request stream is charged to the server's budget (given back when it ends).
        self._charged: dict[int, int] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._wakeups: list[asyncio.Future[None]] = []
        self._slots = asyncio.Semaphore(server.max_concurrent_streams)
        self._terminated = False
        bound = server.max_concurrent_streams
        quic._local_max_streams_bidi = Limit(QuicFrameType.MAX_STREAMS_BIDI, "max_streams_bidi", bound)
        # The protocol has no unidirectional streams: none is granted (aioquic's default, 128 of a 16 MiB
        # window each, would let a client make the server zero-fill 2 GiB with a few packets); a client
        # that opens one anyway has its connection closed (STREAM_LIMIT_ERROR).
        quic._local_max_streams_uni = Limit(QuicFrameType.MAX_STREAMS_UNI, "max_streams_uni", 0)
        # Request streams (the client's) get a window of one largest request, not the client's 16 MiB:
        # aioquic zero-fills a gap up to out-of-order data, so the window bounds what a stream allocates.
        quic._local_max_stream_data_bidi_remote = REQUEST_WINDOW_BYTES
        _require_client_cert(quic, server.configuration(), self._mark_authenticated, self._count_rejected)

    def _mark_authenticated(self) -> None:
        self._authenticated = True

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        super().datagram_received(data, addr)
        self._check_request_streams()
        self._wake()

    def _check_request_streams(self) -> None:
        """Refuse every request stream whose highest offset seen is past the largest request: aioquic grows
        a stream's window as data arrives (doubling it past half) and zero-fills gaps, so a client sending
        out of order could otherwise make the server hold buffers of its growing window. Charge every other
        one that holds data (out-of-order data raises no event, but its gap is allocated)."""
        limit = max_request_bytes()
        for sid, stream in list(self._quic._streams.items()):
            receiver = stream.receiver
            if sid % 4 != 0 or receiver.is_finished or receiver.highest_offset == 0:
                continue
            if receiver.highest_offset > limit:
                self._refuse_request(sid, f"stream offset {receiver.highest_offset} past {limit}")
            elif not self._charge_request(sid):
                self._refuse_request(sid, "the server's buffer budget is spent", ERR_BUSY)

    def _wake(self) -> None:
        for waiter in self._wakeups:
            if not waiter.done():
                waiter.set_result(None)
        self._wakeups.clear()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.HandshakeCompleted):
            if not self._authenticated:
                self._reject("client certificate not verified")
            else:
                grow_datagrams(self._quic, self._server.max_datagram_size)
        elif isinstance(event, events.StreamDataReceived):
            self._on_data(event)
        elif isinstance(event, events.StreamReset | events.StopSendingReceived):
            sid = event.stream_id
            task = self._tasks.pop(sid, None)
            if task is not None:
                task.cancel()  # its done callback gives its charge back
            else:
                self._drop_request(sid)
            self._end_with_error(sid, ERR_CANCELLED)  # the client wants nothing more: free what is queued
        elif isinstance(event, events.ConnectionTerminated):
            self._terminated = True
            self.abort_tasks()
            self._wake()
            self._server.connection_closed(self)

    def _count_rejected(self, reason: str) -> None:
        self._server.rejected += 1
        log.warning("peer handshake rejected: %s", reason)

    def _reject(self, reason: str) -> None:
        self._count_rejected(reason)
        self.close(error_code=QuicErrorCode.CONNECTION_REFUSED, reason_phrase=reason)

    def _on_data(self, event: events.StreamDataReceived) -> None:
        sid = event.stream_id
        if not self._authenticated:
            self._reject("stream data before client authentication")
            return
        if sid % 4 != 0 or sid in self._tasks:  # not a client-initiated bidirectional request stream
            return
        if not self._charge_request(sid):
            self._refuse_request(sid, "the server's buffer budget is spent", ERR_BUSY)
            return
        buf = self._requests.setdefault(sid, bytearray())
        buf += event.data
        if len(buf) > max_request_bytes():
            self._refuse_request(sid, f"request over {max_request_bytes()} bytes")
            return
        if event.end_stream:
            raw = bytes(self._requests.pop(sid))
            task = asyncio.get_running_loop().create_task(self._serve(sid, raw))
            self._tasks[sid] = task
            task.add_done_callback(partial(self._forget, sid))

    def _refuse_request(self, sid: int, why: str, code: int = ERR_BAD_REQUEST) -> None:
        """Count a request stream as bad (``ERR_BAD_REQUEST``) or busy (``ERR_BUSY``), drop what it sent,
        give its charge back, reset and stop it with ``code``."""
        if code == ERR_BUSY:
            self._server.busy += 1
            log.info("peer request on stream %d refused: %s", sid, why)
        else:
            self._server.bad_requests += 1
            log.info("bad peer request on stream %d: %s", sid, why)
        self._drop_request(sid)
        self._quic.reset_stream(sid, code)
        self._quic.stop_stream(sid, code)
        self.transmit()

    def _drop_request(self, sid: int) -> None:
        """Drop what request stream ``sid`` sent and give its charge back; what else arrives on it is
        dropped unread (never buffered, never charged again), and aioquic's buffered part freed."""
        self._requests.pop(sid, None)
        self._give_back(sid)
        stream = self._quic._streams.get(sid)
        if stream is not None:
            stream.receiver.is_finished = True
            stream.receiver._buffer = bytearray()

    def _charge_request(self, sid: int) -> bool:
        """Charge request stream ``sid`` to the server's budget once (True: charged, now or before)."""
        if sid in self._charged or sid in self._tasks:
            return True
        if not self._server.budget.take(REQUEST_CHARGE_BYTES):
            return False
        self._charged[sid] = REQUEST_CHARGE_BYTES
        return True

    def _give_back(self, sid: int) -> None:
        """Give back what request stream ``sid`` was charged (nothing if it holds no charge)."""
        charged = self._charged.pop(sid, 0)
        if charged:
            self._server.budget.give(charged)

    def _forget(self, sid: int, _task: asyncio.Task[None]) -> None:
        """A response task ended (done, failed or cancelled, even before it started)."""
        self._tasks.pop(sid, None)
        self._give_back(sid)

    async def _serve(self, sid: int, raw: bytes) -> None:
        try:
            digests = decode_request(raw)
        except BadRequest as exc:
            self._server.bad_requests += 1
            log.info("bad peer request on stream %d: %s", sid, exc)
            self._quic.reset_stream(sid, ERR_BAD_REQUEST)
            self.transmit()
            return
        async with self._slots:
            self._server.requests += 1
            try:
                await self._respond(sid, digests)
            except _Busy as exc:  # the server's buffer budget is spent: a prompt miss for the rest
                self._server.busy += 1
                log.info("peer response on stream %d refused: %s", sid, exc)
                self._end_with_error(sid, ERR_BUSY)
            except (ConnectionError, RuntimeError) as exc:  # connection gone, or stream reset by the peer
                log.debug("peer response on stream %d abandoned: %s", sid, exc)
                self._end_with_error(sid)
            except Exception as exc:  # a bug or an untranslated store error: end the stream, not the task
                self._server.errors += 1
                log.error("peer response on stream %d failed: unexpected %s", sid, type(exc).__name__)
                self._end_with_error(sid)

    def _end_with_error(self, sid: int, code: int = ERR_INTERNAL) -> None:
        """Reset our side of stream ``sid`` (``code``) so the client stops waiting for it, and free the
        data queued on it (a reset stream never sends it, but aioquic keeps it until the client
        acknowledges the reset); a no-op when the stream already ended or the connection is gone."""
        if self._terminated:
            return
        try:
            self._quic.reset_stream(sid, code)
        except (ValueError, RuntimeError) as exc:  # a stream that cannot be reset any more
            log.debug("cannot reset peer stream %d: %s", sid, exc)
            return
        stream = self._quic._streams.get(sid)
        if stream is not None and stream.sender._reset_error_code is not None:
            stream.sender._buffer = bytearray()
        self.transmit()

    async def _respond(self, sid: int, digests: list[bytes]) -> None:
        """Send a frame per held block of ``digests`` in order, end the stream and wait until the client
        acknowledged all of it. Each frame is charged to the server's budget while it is queued, and the
        stream's queue (at most :data:`QUEUE_BYTES_MAX`, at most what was sent) until the response ends;
        a charge that does not fit raises :class:`_Busy`."""
        budget = self._server.budget
        queue_charge = 0
        try:
            for digest in digests:
                queue_charge = await self._send_block(sid, digest, queue_charge)
            self._quic.send_stream_data(sid, b"", end_stream=True)
            self.transmit()
            await self._drain(sid, 0)  # the queued bytes stay held (and charged) until acknowledged
        finally:
            budget.give(queue_charge)

    async def _send_block(self, sid: int, digest: bytes, queue_charge: int) -> int:
        """Send the frame of ``digest`` if the store holds it; the stream's queue charge after it. The
        record is this function's local, so it is freed when the block has been queued."""
        try:
            data = self._server.store.get(digest)
        except KvcachedError as exc:
            log.warning("store read failed for a peer request: %s", exc)
            return queue_charge
        if data is None:
            return queue_charge
        record = self._server.encode(digest, data)
        del data  # an SSD read's copy; the record is what is sent
        frame_bytes = FRAME_HEADER_BYTES + len(record)
        grow = min(QUEUE_BYTES_MAX, queue_charge + frame_bytes) - queue_charge
        budget = self._server.budget
        if not budget.take(frame_bytes + grow):
            raise _Busy(f"a {frame_bytes}-byte frame does not fit the server's buffer budget")
        queue_charge += grow
        try:
            head = CHUNK_BYTES - FRAME_HEADER_BYTES
            await self._send(sid, frame_header(digest, len(record)) + record[:head])
            for at in range(head, len(record), CHUNK_BYTES):
                await self._send(sid, record[at : at + CHUNK_BYTES])
        except BaseException:
            budget.give(grow)  # the caller gives back the queue charge it knows of
            raise
        finally:
            budget.give(frame_bytes)
        self._server.served_blocks += 1
        return queue_charge

    async def _send(self, sid: int, chunk: bytes) -> None:
        """Queue ``chunk`` on stream ``sid`` once the egress bucket and the stream's back-pressure allow."""
        if not chunk:
            return
        delay = self._server.reserve(len(chunk))
        if delay > 0:
            await asyncio.sleep(delay)  # egress pacing
        await self._drain(sid, HIGH_WATER_BYTES)
        self._quic.send_stream_data(sid, chunk)
        self._server.served_bytes += len(chunk)
        self.transmit()

    async def _drain(self, sid: int, down_to: int) -> None:
        """Wait until at most ``down_to`` bytes of stream ``sid`` are unacknowledged; ConnectionError when
        the connection closed or no acknowledgement reduced them for ``stall_timeout_s``."""
        loop = asyncio.get_running_loop()
        queued, since = _unacked(self._quic, sid), loop.time()
        while queued > down_to:
            if self._terminated:
                raise ConnectionError("peer connection closed")
            left = since + self._server.stall_timeout_s - loop.time()
            if left <= 0:  # alive (PINGs, say) but acknowledging nothing: the stream is reset
                raise ConnectionError(f"nothing acknowledged for {self._server.stall_timeout_s}s")
            waiter = loop.create_future()
            self._wakeups.append(waiter)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, left)
            now_queued = _unacked(self._quic, sid)
            if now_queued < queued:
                since = loop.time()
            queued = now_queued
        if self._terminated:
            raise ConnectionError("peer connection closed")

    def abort_tasks(self) -> list[asyncio.Task[None]]:
        """Cancel every response task (each gives its charges back as it ends) and drop the requests
        still arriving, giving back their charges; the tasks, to be awaited."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for sid in [sid for sid in self._charged if sid not in self._tasks]:
            self._requests.pop(sid, None)
            self._give_back(sid)
        return tasks


class PeerServer:
    """Serves this node's blocks to peers over QUIC with mTLS (see the module docstring)."""

    def __init__(
        self,
        store: BlockSource,
        *,
        host: str,
        port: int,
        cert: Path,
        key: Path,
        ca: Path,
        max_concurrent_streams: int = 64,
        egress_bytes_per_s: float | None = None,
        max_datagram_size: int = DATAGRAM_BYTES_DEFAULT,
        stall_timeout_s: float = 2.0,
        buffer_bytes: int = BUFFER_BYTES_DEFAULT,
    ) -> None:
        if max_concurrent_streams < 1:
            raise KvcachedConfigError("max_concurrent_streams must be at least 1")
        if buffer_bytes < REQUEST_CHARGE_BYTES:
            raise KvcachedConfigError(f"buffer_bytes must be at least {REQUEST_CHARGE_BYTES}")
        self.budget = ByteBudget(buffer_bytes)
        """What every connection's requests and responses may buffer together (the module docstring)."""
        if stall_timeout_s <= 0:
            raise KvcachedConfigError("stall_timeout_s must be positive")
        self.stall_timeout_s = stall_timeout_s
        """A response whose queued data no acknowledgement reduces for this long is reset."""
        if egress_bytes_per_s is not None and egress_bytes_per_s <= 0:
            raise KvcachedConfigError("egress_bytes_per_s must be positive")
        self.store = store
        self.max_concurrent_streams = max_concurrent_streams
        self._host, self._port = host, port
        self._tls = _material(cert=cert, key=key, ca=ca)
        self._config = _configuration(
            is_client=False, pem=self._tls.pem(), max_datagram_size=max_datagram_size
        )
        self._generation = self._tls.reloads
        self.max_datagram_size = max_datagram_size
        # Bursts of up to 50 ms of the rate (at least one chunk), so pacing stays smooth.
        self._bucket = (
            TokenBucket(egress_bytes_per_s, max(egress_bytes_per_s * 0.05, CHUNK_BYTES))
            if egress_bytes_per_s is not None
            else None
        )
        self._server: QuicServer | None = None
        self._protocols: set[_ServerProtocol] = set()
        self.requests = self.served_blocks = self.served_bytes = self.rejected = self.bad_requests = 0
        self.errors = 0
        """Responses ended early by an unexpected error (the stream is reset with ``ERR_INTERNAL``)."""
        self.busy = 0
        """Requests refused and responses ended because the buffer budget was spent (``ERR_BUSY``)."""
        self.encode: Callable[[bytes, bytes], bytes] = encode_record
        """How a block becomes a record (a seam for tests that inject corruption)."""

    async def start(self) -> int:
        """Bind and serve; returns the bound UDP port (useful with ``port=0``)."""
        where = f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"
        with binding(where):
            self._server = await serve(
                self._host, self._port, configuration=self._config, create_protocol=self._protocol
            )
        transport = self._server._transport
        assert transport is not None
        _grow_buffers(transport)
        sockname: tuple[Any, ...] = transport.get_extra_info("sockname")
        log.info("peer server listening on udp %s:%d", self._host, sockname[1])
        return int(sockname[1])

    def configuration(self) -> QuicConfiguration:
        """The TLS material for a new connection: the files are stat'ed, and a rotated certificate (whose
        key matches) is presented from then on; connections under way keep theirs."""
        pem = self._tls.pem()
        if self._tls.reloads != self._generation:
            self._config = _configuration(is_client=False, pem=pem, max_datagram_size=self.max_datagram_size)
            self._generation = self._tls.reloads
        return self._config

    def _protocol(self, quic: QuicConnection, stream_handler: Any = None) -> _ServerProtocol:
        protocol = _ServerProtocol(quic, stream_handler, server=self)
        self._protocols.add(protocol)
        return protocol

    def connection_closed(self, protocol: _ServerProtocol) -> None:
        self._protocols.discard(protocol)

    def reserve(self, nbytes: int) -> float:
        """Seconds to wait before ``nbytes`` may leave (0 without an egress limit)."""
        if self._bucket is None:
            return 0.0
        return self._bucket.reserve(nbytes, asyncio.get_running_loop().time())

    def stats(self) -> dict[str, int]:
        """Counters since start: requests served, blocks and bytes sent, peers rejected, bad requests,
        responses ended by an unexpected error, requests and responses refused for the buffer budget
        (``busy``); and the budget's bytes held now, at most and in all (``buffer_*``)."""
        return {
            "requests": self.requests,
            "errors": self.errors,
            "busy": self.busy,
            "buffer_bytes": self.budget.held_bytes,
            "buffer_peak_bytes": self.budget.peak_bytes,
            "buffer_capacity_bytes": self.budget.capacity_bytes,
            "served_blocks": self.served_blocks,
            "served_bytes": self.served_bytes,
            "rejected": self.rejected,
            "bad_requests": self.bad_requests,
            "connections": len(self._protocols),
        }

    async def aclose(self) -> None:
        """Stop serving: cancel in-flight responses, close every connection and the socket."""
        tasks = [t for p in self._protocols for t in p.abort_tasks()]
        if self._server is not None:
            self._server.close()
            self._server = None
        self._protocols.clear()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(slots=True)
class _Fetch:
    """One request stream on the client: frames received so far and when bytes last arrived.

    ``wanted``: the digests asked for; a frame of another digest, or a second frame of one, is dropped as
    it completes (counted in ``unasked``). ``max_bytes``: what the whole response may carry (a frame per
    digest asked, each at most the largest record): past it the stream is abandoned, so a peer cannot make
    the client buffer more than one record per digest asked."""

    reader: FrameReader
    done: asyncio.Future[None]
    progress_at: float
    wanted: frozenset[bytes] = frozenset()
    max_bytes: int = 0
    frames: list[Frame] = field(default_factory=list)
    received: int = 0
    unasked: int = 0
    torn: bool = False

    def take(self, data: bytes) -> bool:
        """Feed ``data``; keep each completed frame of a digest asked for and not yet received. False when
        the response exceeded ``max_bytes`` (the bytes within it are still fed)."""
        room = self.max_bytes - self.received
        self.received += len(data)
        for frame in self.reader.feed(data[: max(room, 0)]):  # whole frames before a bad one count
            if frame.digest in self.wanted and all(f.digest != frame.digest for f in self.frames):
                self.frames.append(frame)
            else:
                self.unasked += 1
        return self.received <= self.max_bytes


class _ClientProtocol(QuicConnectionProtocol):
    """The client side of one peer connection: routes stream data to the fetch waiting on it."""

    def __init__(self, quic: QuicConnection, stream_handler: Any = None) -> None:
        super().__init__(quic, stream_handler)
        self.fetches: dict[int, _Fetch] = {}
        self.closed_reason: str | None = None
        # The server never opens a stream: none is granted (aioquic's default, 128 of each kind with a
        # 16 MiB window, would let a peer make the client zero-fill gigabytes); one opened anyway closes
        # the connection (STREAM_LIMIT_ERROR).
        quic._local_max_streams_bidi = Limit(QuicFrameType.MAX_STREAMS_BIDI, "max_streams_bidi", 0)
        quic._local_max_streams_uni = Limit(QuicFrameType.MAX_STREAMS_UNI, "max_streams_uni", 0)

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        super().datagram_received(data, addr)
        self._abandon_overreaching()

    def _abandon_overreaching(self) -> None:
        """Abandon every response whose highest offset seen is past its byte budget: aioquic zero-fills a
        gap before out-of-order data (and grows the window as data arrives), so bytes that are never
        delivered in order could otherwise make the client hold any amount."""
        for sid, fetch in list(self.fetches.items()):
            stream = self._quic._streams.get(sid)
            if (
                stream is not None
                and not fetch.done.done()
                and stream.receiver.highest_offset > fetch.max_bytes
            ):
                self._abandon(sid, fetch, f"data past the {fetch.max_bytes} bytes asked for")

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamDataReceived):
            fetch = self.fetches.get(event.stream_id)
            if fetch is None or fetch.done.done():
                return
            fetch.progress_at = self._loop.time()
            if not fetch.take(event.data):
                self._abandon(event.stream_id, fetch, f"more than the {fetch.max_bytes} bytes asked for")
                return
            if fetch.reader.broken is not None:
                self._abandon(event.stream_id, fetch, fetch.reader.broken)
                return
            if event.end_stream:
                fetch.torn = fetch.reader.pending() > 0
                fetch.done.set_result(None)
        elif isinstance(event, events.StreamReset):
            fetch = self.fetches.get(event.stream_id)
            if fetch is not None and not fetch.done.done():
                fetch.torn = True
                fetch.done.set_result(None)  # keep what arrived whole; the rest is a miss
        elif isinstance(event, events.ConnectionTerminated):
            self.closed_reason = event.reason_phrase or f"error {event.error_code:#x}"
            for fetch in self.fetches.values():
                if not fetch.done.done():
                    fetch.done.set_exception(PeerUnavailable(f"connection closed: {self.closed_reason}"))

    def _abandon(self, sid: int, fetch: _Fetch, why: str) -> None:
        log.warning("peer sent a malformed response on stream %d (%s): abandoning the stream", sid, why)
        fetch.torn = True
        fetch.done.set_result(None)
        self.stop(sid, ERR_BAD_REQUEST)

    def stop(self, sid: int, code: int) -> None:
        """Ask the peer to stop sending on stream ``sid`` (STOP_SENDING with ``code``) and send it now, then
        finish our side of it: what else arrives is dropped unread (not zero-filled before out-of-order
        data), and the buffered part freed. A no-op for a stream that already ended or a connection that
        is gone."""
        if self.is_closed:
            return
        try:
            self._quic.stop_stream(sid, code)
        except ValueError:  # the stream finished and was discarded
            return
        self.transmit()  # before finishing: a finished stream is discarded before its STOP_SENDING is sent
        stream = self._quic._streams.get(sid)
        if stream is not None:
            stream.receiver.is_finished = True
            stream.receiver._buffer = bytearray()

    @property
    def is_closed(self) -> bool:
        return self.closed_reason is not None or self._closed.is_set()


@dataclass(slots=True)
class _Link:
    protocol: _ClientProtocol
    transport: asyncio.DatagramTransport

    def close(self) -> None:
        self.protocol.close()  # queues and sends CONNECTION_CLOSE at once
        self.transport.close()


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> ``(host, port)``; :class:`KvcachedConfigError` if malformed."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KvcachedConfigError(f"bad peer address {address!r}: expected host:port")
    return host, int(port)


class PeerClient:
    """Fetches blocks from peers over QUIC with mTLS; one kept connection per peer address."""

    def __init__(
        self,
        *,
        cert: Path,
        key: Path,
        ca: Path,
        timeout_s: float = 2.0,
        max_in_flight: int = 8,
        max_datagram_size: int = DATAGRAM_BYTES_DEFAULT,
        max_block_bytes: int = MAX_BLOCK_BYTES_DEFAULT,
    ) -> None:
        if timeout_s <= 0 or max_in_flight < 1 or max_block_bytes < 1:
            raise KvcachedConfigError(
                "timeout_s must be positive, max_in_flight and max_block_bytes at least 1"
            )
        self._tls = _material(cert=cert, key=key, ca=ca)
        self.max_datagram_size = max_datagram_size
        self._new_config()  # fail early on bad settings
        self.timeout_s = timeout_s
        self.max_record_bytes = max_block_bytes + RECORD_OVERHEAD_MAX
        """Largest record a peer may send (this daemon's ``max_block_bytes``): a larger frame is refused."""
        self._in_flight = asyncio.Semaphore(max_in_flight)
        self._links: dict[str, _Link] = {}
        self._dialing: dict[str, asyncio.Lock] = {}
        self.fetched_blocks = self.fetched_bytes = self.corrupt = self.unavailable = 0

    async def fetch(self, address: str, digests: Sequence[bytes]) -> dict[bytes, bytes]:
        """Blocks of ``digests`` that the peer at ``address`` holds, each verified: digest -> payload.

        Blocks the peer lacks, and blocks whose record fails verification (dropped, counted in
        ``corrupt``), are absent. :class:`PeerUnavailable` if the peer cannot be reached within
        ``timeout_s``, a response stalls for ``timeout_s`` or ``address`` names no host and port (an etcd
        record's ``[]:80``); :class:`BadRequest` for a malformed digest.
        """
        wanted = list(dict.fromkeys(check_digest(d) for d in digests))
        try:
            host, port = split_address(address)
        except KvcachedConfigError as exc:  # a miss like a peer down: the other peers are still asked
            self.unavailable += 1
            raise PeerUnavailable(str(exc)) from exc
        out: dict[bytes, bytes] = {}
        for at in range(0, len(wanted), MAX_REQUEST_DIGESTS):
            chunk = wanted[at : at + MAX_REQUEST_DIGESTS]
            async with self._in_flight:
                link = await self._link(address, host, port)
                frames = await self._request(address, link, chunk)
            for digest, head, body in frames:  # each asked for, once (_Fetch.take)
                try:
                    out[digest] = verify_record(digest, head, body)
                except CorruptBlock as exc:
                    self.corrupt += 1
                    log.warning("peer %s sent a corrupt block: dropped (%s)", address, exc)
                    continue
                self.fetched_blocks += 1
                self.fetched_bytes += len(out[digest])
        return out

    def _new_config(self) -> QuicConfiguration:
        """A configuration for a new connection, from the files in force (a rotated certificate is
        presented by the next connection; kept connections keep theirs)."""
        return _configuration(is_client=True, pem=self._tls.pem(), max_datagram_size=self.max_datagram_size)

    async def _link(self, address: str, host: str, port: int) -> _Link:
        lock = self._dialing.setdefault(address, asyncio.Lock())
        async with lock:
            link = self._links.get(address)
            if link is not None and not link.protocol.is_closed:
                return link
            if link is not None:
                link.close()
                del self._links[address]
            self._release_closed()
            link = await self._dial(address, host, port)
            self._links[address] = link
            return link

    def _release_closed(self) -> None:
        """Close and forget the kept links whose connection closed (a peer that stopped, or left the table
        and idled out) and the dial locks of addresses without a link, so churning addresses do not pile
        up open sockets. A lock that is held or awaited (a dial under way or about to be) stays."""
        for address, link in list(self._links.items()):
            if link.protocol.is_closed:
                link.close()
                del self._links[address]
        for address, lock in list(self._dialing.items()):
            if address not in self._links and not lock.locked() and not lock._waiters:
                del self._dialing[address]

    async def _dial(self, address: str, host: str, port: int) -> _Link:
        loop = asyncio.get_running_loop()
        config = self._new_config()
        config.server_name = host
        try:
            async with asyncio.timeout(self.timeout_s):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
                family, addr = infos[0][0], infos[0][4]
                local = ("::", 0) if family == socket.AF_INET6 else ("0.0.0.0", 0)
                transport, protocol = await loop.create_datagram_endpoint(
                    partial(_ClientProtocol, QuicConnection(configuration=config)), local_addr=local
                )
        except (OSError, TimeoutError) as exc:
            self.unavailable += 1
            raise PeerUnavailable(f"peer {address}: cannot resolve or bind: {exc}") from exc
        _grow_buffers(transport)
        link = _Link(protocol, transport)
        try:
            async with asyncio.timeout(self.timeout_s):
                protocol.connect(addr)
                await protocol.wait_connected()
            grow_datagrams(protocol._quic, self.max_datagram_size)
        except (ConnectionError, TimeoutError) as exc:
            link.close()
            self.unavailable += 1
            why = protocol.closed_reason or f"no handshake within {self.timeout_s}s"
            raise PeerUnavailable(f"peer {address} unavailable: {why}") from exc
        cert = protocol._quic.tls._peer_certificate
        if cert is None or not serves(KVCACHED_PEERS, certificate_uris(cert)):  # nothing was asked yet
            link.close()
            self.unavailable += 1
            log.warning("peer %s refused: its certificate does not name the kvcached role", address)
            raise PeerUnavailable(f"peer {address}: its certificate does not name the kvcached role")
        return link

    async def _request(self, address: str, link: _Link, digests: list[bytes]) -> list[Frame]:
        protocol, quic, loop = link.protocol, link.protocol._quic, asyncio.get_running_loop()
        sid = quic.get_next_available_stream_id()
        reader = FrameReader(self.max_record_bytes, head_bytes=HEADER_BYTES)
        max_bytes = len(digests) * (FRAME_HEADER_BYTES + self.max_record_bytes)
        fetch = _Fetch(reader, loop.create_future(), loop.time(), frozenset(digests), max_bytes)
        protocol.fetches[sid] = fetch
        try:
            quic.send_stream_data(sid, encode_request(digests), end_stream=True)
            protocol.transmit()
            while not fetch.done.done():
                remaining = fetch.progress_at + self.timeout_s - loop.time()
                if remaining <= 0:
                    raise TimeoutError
                try:
                    await asyncio.wait_for(asyncio.shield(fetch.done), remaining)
                except TimeoutError:
                    continue  # re-check: bytes may have arrived meanwhile
            fetch.done.result()
        except (TimeoutError, PeerUnavailable) as exc:
            self.unavailable += 1
            if self._links.get(address) is link:
                del self._links[address]
            link.close()
            if isinstance(exc, PeerUnavailable):
                raise PeerUnavailable(f"peer {address}: {exc}") from exc
            raise PeerUnavailable(f"peer {address}: no progress within {self.timeout_s}s") from exc
        except asyncio.CancelledError:  # the caller gave up (another peer answered first): stop the sender
            protocol.stop(sid, ERR_CANCELLED)
            raise
        finally:
            del protocol.fetches[sid]
        if fetch.unasked:
            log.warning("peer %s sent %d blocks that were not asked for: dropped", address, fetch.unasked)
        if fetch.torn:
            log.warning("peer %s ended a response mid-frame: the torn block is a miss", address)
        return fetch.frames

    def stats(self) -> dict[str, int]:
        """Counters: blocks and payload bytes fetched (verified), corrupt blocks dropped, failed fetches."""
        return {
            "fetched_blocks": self.fetched_blocks,
            "fetched_bytes": self.fetched_bytes,
            "corrupt": self.corrupt,
            "unavailable": self.unavailable,
        }

    async def aclose(self) -> None:
        """Close every kept connection."""
        for link in self._links.values():
            link.close()
        self._links.clear()
