"""A receiver's side of an index-event feed (:mod:`runtime.feed.server`): one subscription to one source.

:class:`FeedClient` holds one gRPC stream to one source (a node agent, a kvcached daemon) and checks each
batch with its :class:`~contracts.events.SequenceTracker`: APPLY -> ``handler.on_batch``; RESET (a
snapshot) -> ``handler.on_reset(source, endpoints in it)`` then ``on_batch``; DUPLICATE -> skipped; GAP
-> counted, the stream is cancelled and a new one asks at once for what follows the last applied ``seq``
(the source replays it or sends a snapshot); :meth:`FeedClient.resync` forgets the position, so the next
batch ends the stream the same way (not counted as a gap) and the next one starts with a snapshot. An
unreachable source or a broken stream calls ``handler.on_lost`` once per outage, then the client
reconnects with capped exponential backoff (50 ms doubling to 2 s) and calls ``handler.on_restored`` once
attached again. A subscription that ends before
applying anything (a failed apply, a gap or a lag at its first batch) is paced by the same backoff: it
starts over only once a stream has applied a batch, so a receiver that keeps failing asks for a snapshot
every 2 s at most, not every 50 ms. A stream the source ends because
this client fell behind (``RESOURCE_EXHAUSTED``) is resubscribed at once, without ``on_lost``.

Versions (:mod:`contracts.versions`): a batch of a feed version this client does not read (newer than
its own, or older than the one before), or whose digests are of another digest version, is delivered
without its index events (:func:`contracts.events.decode_batch_skewed`): its loads still count, its KV
data is absent. Logged once per feed and version, counted in ``FeedStats.version_skew``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import grpc

from contracts import events as ev
from contracts.events import EPOCH_HEADER, Batch, EndpointId, SequenceTracker, Verdict
from contracts.versions import DIGEST_VERSION, FEED_VERSION, Skew, SkewLog, describe
from runtime.tls import ReloadingClientCerts, secure_channel

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 512 * 1024 * 1024
"""Largest batch accepted: a snapshot of a large node is one message."""
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Ping quiet streams so an agent that vanished without closing its connection is noticed.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
)


class FeedHandler(Protocol):
    """What a :class:`FeedClient` reports to."""

    def on_batch(self, batch: Batch) -> None: ...
    def on_reset(self, source: str, endpoints: frozenset[EndpointId]) -> None: ...
    def on_lost(self, address: str) -> None: ...
    def on_restored(self, address: str) -> None: ...


class Backoff:
    """Capped exponential delays, seconds: ``initial_s``, doubling up to ``max_s``; :meth:`reset` after a
    success."""

    def __init__(self, initial_s: float = 0.05, max_s: float = 2.0) -> None:
        self.initial_s, self.max_s, self._next = initial_s, max_s, initial_s

    def next(self) -> float:
        delay = self._next
        self._next = min(self.max_s, delay * 2)
        return delay

    def reset(self) -> None:
        self._next = self.initial_s


@dataclass(slots=True)
class FeedStats:
    """Counters of one or many clients (a manager shares one among its clients).

    ``batches``/``events``: applied (APPLY and RESET); ``reconnects``: subscriptions opened after a
    client's first, whatever the reason; ``staleness_s``: recent samples of wall now - ``batch.ts`` at
    apply time, seconds (``on_staleness`` sees every sample, e.g. a histogram's ``observe``).
    """

    batches: int = 0
    events: int = 0
    gaps: int = 0
    resets: int = 0
    duplicates: int = 0
    reconnects: int = 0
    #: Batches of a feed or digest version this receiver does not read (delivered without KV data).
    version_skew: int = 0
    #: Events the receiver refused although they decoded (a ``Load`` with a NaN, infinite or negative
    #: queue: :func:`contracts.events.load_problem`); the rest of their batch is applied.
    malformed: int = 0
    #: Events naming an endpoint registered with another feed (or a node store another daemon's feed
    #: reports), dropped by the receiver (:class:`extproc.control.feeds.FeedManager`).
    foreign: int = 0
    staleness_s: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    on_staleness: Callable[[float], object] | None = None

    def observe_staleness(self, seconds: float) -> None:
        self.staleness_s.append(seconds)
        if self.on_staleness is not None:
            self.on_staleness(seconds)


_SKEW_LOG = SkewLog()
"""One warning per feed address and version, for the whole process."""

_Outcome = Literal["gap", "lagged", "failed", "broken"]
"""Why a stream was replaced; all but ``broken`` (agent unreachable, stream broken) keep the channel."""


class FeedClient:
    """One subscription to the feed at ``address`` (``host:port``), reporting to ``handler``.

    ``tracker``: the position to resume from (default: none, so the first batch is a snapshot).
    ``credentials``: TLS (``None``: plaintext; a :class:`~runtime.tls.ReloadingClientCerts`: each new
    subscription presents the certificate in force, :class:`~runtime.tls.RotatingChannel`, while a running
    stream keeps its connection); ``server_name`` overrides the name checked against the
    agent's certificate. ``connect_timeout_s``: how long a subscription may take to be attached.
    ``wall``: wall clock for staleness (seconds since the epoch).
    """

    def __init__(
        self,
        address: str,
        handler: FeedHandler,
        *,
        subscriber: str,
        tracker: SequenceTracker | None = None,
        stats: FeedStats | None = None,
        credentials: grpc.ChannelCredentials | ReloadingClientCerts | None = None,
        server_name: str | None = None,
        backoff: Backoff | None = None,
        connect_timeout_s: float = 5.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.address = address
        self.tracker = tracker if tracker is not None else SequenceTracker()
        self.stats = stats if stats is not None else FeedStats()
        self._handler, self._subscriber, self._credentials = handler, subscriber, credentials
        self._options: list[tuple[str, str | int]] = list(CHANNEL_OPTIONS)
        if server_name:
            self._options.append(("grpc.ssl_target_name_override", server_name))
        self._backoff = backoff if backoff is not None else Backoff()
        self._connect_timeout, self._wall = connect_timeout_s, wall
        self._task: asyncio.Task[None] | None = None
        #: Whether a stream is attached now.
        self.connected = False
        #: Why the last stream broke or could not be attached (for logs).
        self.last_error = ""
        self._lost, self._streams = False, 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kvgate-feed-{self.address}")

    def resync(self) -> None:
        """Read the source again from a snapshot: the position is forgotten, so the stream attached now
        ends at its next batch (a gap) and the next subscription starts with a snapshot."""
        self.tracker = SequenceTracker()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _open(self) -> Any:
        if self._credentials is not None:
            return secure_channel(self.address, self._credentials, self._options)
        return grpc.aio.insecure_channel(self.address, options=self._options)

    async def _run(self) -> None:
        channel = self._open()
        try:
            while True:
                if self._streams:
                    self.stats.reconnects += 1
                self._streams += 1
                outcome, applied = await self._stream(channel)
                self.connected = False
                if outcome != "broken":
                    if not applied:  # the same answer again at once would loop: pace it
                        await asyncio.sleep(self._backoff.next())
                    continue
                if not self._lost:
                    self._lost = True
                    log.warning("feed %s lost: %s", self.address, self.last_error)
                    self._handler.on_lost(self.address)
                await channel.close()
                await asyncio.sleep(self._backoff.next())
                channel = self._open()  # a fresh channel: gRPC's own reconnect backoff reaches 2 min
        finally:
            self.connected = False
            await channel.close()

    async def _stream(self, channel: Any) -> tuple[_Outcome, int]:
        """One subscription until it must be replaced; returns why and how many batches it applied."""
        method = channel.unary_stream(
            ev.SUBSCRIBE_METHOD, request_serializer=ev.encode, response_deserializer=ev.decode_batch_skewed
        )
        call = method(self.tracker.request(self._subscriber))
        applied = 0
        try:
            metadata = await asyncio.wait_for(call.initial_metadata(), self._connect_timeout)
            if metadata is None or metadata.get(EPOCH_HEADER) is None:
                code = await call.code()  # not attached: the call ended without a subscription
                self.last_error = f"{code.name}: {await call.details()}"
                return "broken", 0
            self.connected = True
            if self._lost:
                self._lost = False
                self._handler.on_restored(self.address)
            while True:
                batch = await call.read()
                if batch is grpc.aio.EOF:
                    self.last_error = "stream ended by the agent"
                    return "broken", applied
                if ev.batch_skew(batch) is not Skew.OK:
                    self._skewed(batch)
                verdict = self.tracker.check(batch)
                if verdict is Verdict.GAP:
                    if self.tracker.epoch is None:  # resync(): not a gap, the snapshot it asks for
                        return "gap", applied
                    self.stats.gaps += 1
                    log.info("feed %s: gap before seq %d, resubscribing", self.address, batch.seq)
                    return "gap", applied
                if verdict is Verdict.DUPLICATE:
                    self.stats.duplicates += 1
                    continue
                try:
                    self._deliver(batch, verdict)
                except Exception:
                    # The receiver's state is unknown now: start over from a snapshot.
                    log.exception("feed %s: applying seq %d failed; resubscribing", self.address, batch.seq)
                    self.tracker = SequenceTracker()
                    return "failed", 0
                if not applied:  # the backoff starts over once a stream works, not once it attaches
                    self._backoff.reset()
                applied += 1
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                log.info("feed %s: fell behind, resubscribing", self.address)
                return "lagged", applied
            self.last_error = f"{exc.code().name}: {exc.details()}"
            return "broken", applied
        except TimeoutError:
            self.last_error = f"no subscription within {self._connect_timeout:g} s"
            return "broken", applied
        finally:
            call.cancel()

    def _skewed(self, batch: Batch) -> None:
        self.stats.version_skew += 1
        if batch.digest != DIGEST_VERSION:
            line = _SKEW_LOG.note(
                "feed digests",
                self.address,
                batch.digest,
                "digests of another version: its KV data is ignored",
            )
        else:
            line = _SKEW_LOG.note("feed", self.address, batch.version, describe(batch.version, FEED_VERSION))
        if line is not None:
            log.warning("%s", line)

    def _deliver(self, batch: Batch, verdict: Verdict) -> None:
        stats = self.stats
        if verdict is Verdict.RESET:
            stats.resets += 1
            self._handler.on_reset(batch.source, frozenset(EndpointId(e.endpoint) for e in batch.events))
        self._handler.on_batch(batch)
        stats.batches += 1
        stats.events += len(batch.events)
        if batch.ts > 0:
            stats.observe_staleness(self._wall() - batch.ts)
