"""The agent's index-event feed: a numbered log of recent batches and the gRPC stream that serves it.

Every ext_proc replica subscribes to every agent (active-active: each replica holds the whole index), so
the agent publishes each batch once and fans it out to any number of subscribers.

:class:`FeedLog` is the sans-IO core. It numbers batches (``seq`` from 1 within a random 63-bit ``epoch``;
an empty batch is published at creation, so ``seq >= 1`` always), keeps the recent ones in a ring bounded
by count and by total encoded bytes, answers "replay everything after ``(epoch, seq)``" when the ring
still covers it, and builds snapshot batches (a :class:`~extproc.events.Cleared` per endpoint, what the
caller says is held, then the latest :class:`~extproc.events.Load` per endpoint).

:class:`FeedServer` is the asyncio shell: it serves :data:`~extproc.events.SUBSCRIBE_METHOD` (generic
gRPC handler, msgpack (de)serialisers from :mod:`extproc.events`, optional mTLS with a required client
certificate). A subscriber gets a replay or a snapshot, then live batches through a bounded queue; one
that falls more than ``queue_batches`` behind is disconnected with ``RESOURCE_EXHAUSTED`` (it resubscribes
and gets a replay or a snapshot), so publishing never waits for a slow reader.

Ordering: attaching a subscriber (computing its replay or snapshot, and adding its queue to the fan-out)
and publishing are both synchronous code on the event loop, with no ``await`` inside either; so every batch
published before the attach is inside the replay or the snapshot (seq <= its seq), and every batch after it
reaches the queue (seq > its seq). For that to hold for snapshots, the agent's translators must change
their held state and publish the matching batch in one synchronous step, and :meth:`FeedServer.publish`
must be called on the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from itertools import islice
from typing import Any

import grpc

from extproc.events import (
    SUBSCRIBE_METHOD,
    Batch,
    Cleared,
    Event,
    IndexEvent,
    Load,
    Subscribe,
    decode_subscribe,
    encode,
)
from extproc.feeds import EPOCH_HEADER
from extproc.tls import ReloadingServerCerts, ServerTlsFiles

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCHES = 4096
"""Batches the ring keeps for replay."""
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
"""Total encoded bytes the ring keeps for replay."""
DEFAULT_QUEUE_BATCHES = 1024
"""Live batches a subscriber may have pending before it is disconnected."""
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
"""gRPC message limit: a snapshot of a large node is one message, well above gRPC's 4 MiB default."""

SERVER_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", 1024 * 1024),
    # Subscribers ping every 10 s on quiet streams to notice a vanished agent; accept that.
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
)


class FeedLog:
    """Numbered batches of one source and the ring that replays them (see the module docstring).

    ``max_batches``/``max_bytes``: bounds of the ring (the oldest batches go first; a batch larger than
    ``max_bytes`` is not kept at all). ``epoch``: fixed for tests; default a random 63-bit integer.
    ``ts``: wall-clock seconds stamped on the initial empty batch.
    """

    def __init__(
        self,
        source: str,
        *,
        max_batches: int = DEFAULT_MAX_BATCHES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        epoch: int | None = None,
        ts: float = 0.0,
    ) -> None:
        if max_batches < 1 or max_bytes < 1:
            raise ValueError("max_batches and max_bytes must be >= 1")
        self.source = source
        self.epoch = secrets.randbits(63) if epoch is None else epoch
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self._seq = 0
        self._ring: deque[tuple[Batch, int]] = deque()
        self._bytes = 0
        self._endpoints: set[str] = set()
        self._loads: dict[str, Load] = {}
        self.publish([], ts)

    @property
    def seq(self) -> int:
        """The last published ``seq``."""
        return self._seq

    @property
    def held_batches(self) -> int:
        return len(self._ring)

    @property
    def held_bytes(self) -> int:
        """Encoded bytes of the batches in the ring."""
        return self._bytes

    @property
    def oldest_seq(self) -> int | None:
        """The oldest ``seq`` still in the ring (``None``: the ring is empty)."""
        return self._ring[0][0].seq if self._ring else None

    @property
    def endpoints(self) -> frozenset[str]:
        """Every endpoint this source has mentioned (each gets a ``Cleared`` in a snapshot)."""
        return frozenset(self._endpoints)

    def publish(self, events: Sequence[Event], ts: float) -> Batch:
        """Number ``events`` as the next batch, keep it for replay and return it."""
        self._seq += 1
        batch = Batch(self.source, self.epoch, self._seq, list(events), ts=ts)
        for event in events:
            self._endpoints.add(event.endpoint)
            if isinstance(event, Load):
                self._loads[event.endpoint] = event
        size = len(encode(batch))
        self._ring.append((batch, size))
        self._bytes += size
        while self._ring and (len(self._ring) > self.max_batches or self._bytes > self.max_bytes):
            _, dropped = self._ring.popleft()
            self._bytes -= dropped
        return batch

    def replay_after(self, epoch: int | None, after_seq: int) -> list[Batch] | None:
        """The batches after ``after_seq`` of ``epoch``, oldest first; ``None`` when the ring cannot cover
        them (another epoch, a position this log never reached, or batches already dropped): the
        subscriber needs a snapshot."""
        if epoch != self.epoch or after_seq < 0 or after_seq > self._seq:
            return None
        if after_seq == self._seq:
            return []
        oldest = self.oldest_seq
        if oldest is None or after_seq + 1 < oldest:
            return None
        return [batch for batch, _ in islice(self._ring, after_seq + 1 - oldest, None)]

    def snapshot(self, held: Iterable[IndexEvent], ts: float) -> Batch:
        """A snapshot batch at the last published ``seq``: ``Cleared`` for every endpoint, ``held`` (what
        the caller's translators hold now), then the latest ``Load`` of each endpoint. Not kept in the
        ring; the receiver applies live batches after it from ``seq + 1``."""
        held = list(held)
        for event in held:
            self._endpoints.add(event.endpoint)
        events: list[Event] = [Cleared(endpoint) for endpoint in sorted(self._endpoints)]
        events.extend(held)
        events.extend(self._loads[endpoint] for endpoint in sorted(self._loads))
        return Batch(self.source, self.epoch, self._seq, events, snapshot=True, ts=ts)

    def forget(self, endpoint: str) -> None:
        """Stop mentioning ``endpoint`` in snapshots (after its engine was removed and a ``Cleared`` for
        it was published)."""
        self._endpoints.discard(endpoint)
        self._loads.pop(endpoint, None)


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
    re-read when they change (:class:`extproc.tls.ReloadingServerCerts`). ``wall``: wall clock for
    batch timestamps (seconds since the epoch).
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
    ) -> None:
        if queue_batches < 1:
            raise ValueError("queue_batches must be >= 1")
        self.log = feed_log
        self._snapshot_source = snapshot_source
        self._listen = listen
        self._certs = ReloadingServerCerts(tls) if tls is not None else None
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
        server = grpc.aio.server(handlers=[handler], options=SERVER_OPTIONS)
        if self._certs is not None:
            self.port = server.add_secure_port(self._listen, self._certs.credentials())
        else:
            self.port = server.add_insecure_port(self._listen)
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
