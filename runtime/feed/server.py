"""The source side of an index-event feed, its gRPC shell: :class:`FeedServer` serves a
:class:`~runtime.feed.log.FeedLog` to any number of subscribers.

It serves :data:`~contracts.events.SUBSCRIBE_METHOD` (generic gRPC handler, msgpack (de)serialisers from
:mod:`contracts.events`, optional mTLS with a required client certificate whose identity must be an allowed
caller: by default the roles :mod:`certs.roles` lets call a feed, i.e. gateways' ``extproc`` certificates;
another gets ``PERMISSION_DENIED`` before anything is sent). A subscriber gets a replay or a
snapshot, then live batches through a bounded queue; one that falls more than ``queue_batches`` behind is
disconnected with ``RESOURCE_EXHAUSTED`` (it resubscribes and gets a replay or a snapshot), so publishing
never waits for a slow reader.

Ordering: attaching a subscriber (computing its replay or snapshot, and adding its queue to the fan-out)
and publishing are both synchronous code on the event loop, with no ``await`` inside either; so every batch
published before the attach is inside the replay or the snapshot (seq <= its seq), and every batch after it
reaches the queue (seq > its seq). For that to hold for snapshots, the source (an agent's translators)
must change its held state and publish the matching batch in one synchronous step, and
:meth:`FeedServer.publish` must be called on the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Any

import grpc

from contracts.events import (
    EPOCH_HEADER,
    SUBSCRIBE_METHOD,
    Batch,
    Event,
    IndexEvent,
    Subscribe,
    decode_subscribe,
    encode,
)
from runtime.feed.log import FeedLog
from runtime.identity import FEED, PeerCheck, hop_callers
from runtime.listen import add_grpc_port
from runtime.tls import ReloadingServerCerts, ServerTlsFiles

log = logging.getLogger(__name__)

DEFAULT_QUEUE_BATCHES = 1024
"""Live batches a subscriber may have pending before it is disconnected."""
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
"""gRPC message limit: a snapshot of a large node is one message, well above gRPC's 4 MiB default."""

FEED_CALLERS = hop_callers(FEED)
"""Who may subscribe under TLS by default: identities whose role :data:`certs.roles.CALLERS` allows."""

SERVER_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", 1024 * 1024),
    # Subscribers ping every 10 s on quiet streams to notice a vanished agent; accept that.
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
)


class _Subscriber:
    """One subscriber's pending live batches; ``lagged`` once it fell ``limit`` batches behind."""

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.lagged = False
        self._pending: deque[Batch] = deque()
        self._wake = asyncio.Event()

    def offer(self, batch: Batch) -> bool:
        """Queue ``batch`` without waiting; False (and ``lagged``) when the queue is full."""
        if len(self._pending) >= self.limit:
            self.lagged = True
            self._pending.clear()
            self._wake.set()
            return False
        self._pending.append(batch)
        self._wake.set()
        return True

    async def next(self) -> Batch | None:
        """The next live batch; ``None`` once the subscriber lagged."""
        while not self._pending and not self.lagged:
            self._wake.clear()
            await self._wake.wait()
        return None if self.lagged else self._pending.popleft()


class FeedServer:
    """Serves a :class:`FeedLog` to subscribers over gRPC (see the module docstring).

    ``snapshot_source`` returns what the agent's translators hold now (index events, no ``Load``).
    ``listen``: ``host:port`` (port 0: ephemeral; the bound port is :attr:`port` after :meth:`start`).
    ``tls``: serve mTLS, requiring a client certificate that chains to ``tls.client_ca``; the files are
    re-read when they change (:class:`runtime.tls.ReloadingServerCerts`). ``callers``: whether a TLS
    peer with these identity URIs may subscribe (default: the roles :data:`certs.roles.CALLERS` allows
    on the feed hop); others get ``PERMISSION_DENIED``. ``wall``: wall clock for batch timestamps
    (seconds since the epoch).
    """

    def __init__(
        self,
        feed_log: FeedLog,
        snapshot_source: Callable[[], list[IndexEvent]],
        *,
        listen: str = "127.0.0.1:0",
        tls: ServerTlsFiles | None = None,
        queue_batches: int = DEFAULT_QUEUE_BATCHES,
        wall: Callable[[], float] = time.time,
        callers: Callable[[Collection[str]], bool] = FEED_CALLERS,
    ) -> None:
        if queue_batches < 1:
            raise ValueError("queue_batches must be >= 1")
        self.log = feed_log
        self._snapshot_source = snapshot_source
        self._listen = listen
        self._certs = ReloadingServerCerts(tls) if tls is not None else None
        self._callers = callers
        self._queue_batches = queue_batches
        self._wall = wall
        self._subscribers: set[_Subscriber] = set()
        self._server: Any = None
        self.port = 0
        #: Subscriptions served, and how each started: replay or snapshot; ``lagged``: disconnected slow.
        self.subscriptions = 0
        self.replays = 0
        self.snapshots = 0
        self.lagged = 0

    @property
    def subscribers(self) -> int:
        """Subscribers attached now."""
        return len(self._subscribers)

    async def start(self) -> None:
        handler = grpc.method_handlers_generic_handler(
            SUBSCRIBE_METHOD.split("/")[1],
            {
                SUBSCRIBE_METHOD.split("/")[2]: grpc.unary_stream_rpc_method_handler(
                    self._subscribe, request_deserializer=decode_subscribe, response_serializer=encode
                )
            },
        )
        peers = [PeerCheck(self._callers, "this feed")] if self._certs is not None else []
        server = grpc.aio.server(handlers=[handler], options=SERVER_OPTIONS, interceptors=peers)
        if self._certs is not None:
            self.port = add_grpc_port(server, self._listen, self._certs.credentials())
        else:
            self.port = add_grpc_port(server, self._listen)
        await server.start()
        self._server = server
        log.info("index feed of %s on port %d (epoch %d)", self.log.source, self.port, self.log.epoch)

    async def aclose(self, grace_s: float = 0.0) -> None:
        """Stop serving; open subscriptions are cancelled after ``grace_s`` seconds."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None

    def publish(self, events: Sequence[Event]) -> Batch:
        """Publish ``events`` as the next batch and hand it to every subscriber (never waits)."""
        batch = self.log.publish(events, self._wall())
        for sub in list(self._subscribers):
            if not sub.offer(batch):
                self._subscribers.discard(sub)
                self.lagged += 1
                log.warning("feed subscriber %s fell %d batches behind: disconnecting", sub.name, sub.limit)
        return batch

    def _attach(self, request: Subscribe) -> tuple[_Subscriber, list[Batch]]:
        """Replay or snapshot for ``request`` and its live queue, in one synchronous step (no ``await``:
        nothing is published in between)."""
        first = self.log.replay_after(request.epoch, request.after_seq)
        if first is None:
            first = [self.log.snapshot(self._snapshot_source(), self._wall())]
            self.snapshots += 1
        else:
            self.replays += 1
        sub = _Subscriber(request.subscriber, self._queue_batches)
        self._subscribers.add(sub)
        self.subscriptions += 1
        return sub, first

    async def _subscribe(self, request: Subscribe, context: Any) -> AsyncIterator[Batch]:
        try:
            sub, first = self._attach(request)
        except Exception:
            log.exception("feed snapshot failed for subscriber %s", request.subscriber)
            await context.abort(grpc.StatusCode.INTERNAL, "snapshot failed")
            return
        log.info(
            "feed subscriber %s attached at %s/%d: %s",
            request.subscriber,
            request.epoch,
            request.after_seq,
            "snapshot" if first and first[0].snapshot else f"replay of {len(first)}",
        )
        try:
            await context.send_initial_metadata(((EPOCH_HEADER, str(self.log.epoch)),))
            for batch in first:
                yield batch
            while True:
                live = await sub.next()
                if live is None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "subscriber fell behind")
                    return
                yield live
        finally:
            self._subscribers.discard(sub)
