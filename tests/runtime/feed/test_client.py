"""runtime.feed.client: the receiver's backoff, and a gap filled by a resubscription (a real gRPC server
on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from contracts.events import (
    EPOCH_HEADER,
    SUBSCRIBE_METHOD,
    Batch,
    EndpointId,
    SequenceTracker,
    Stored,
    Subscribe,
    decode_subscribe,
    encode,
)
from runtime.feed.client import Backoff, FeedClient, FeedStats
from runtime.feed.log import FeedLog
from tests.runtime.feed.test_server import D1, D2, D3, eventually


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    b = Backoff()
    assert [b.next() for _ in range(8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    b.reset()
    assert b.next() == 0.05


class GapServer:
    """A feed of seq 1..5 that loses seq 3 on its first stream (as a dropped message would), then serves
    replays faithfully."""

    def __init__(self) -> None:
        self.log = FeedLog("node-g", epoch=5)
        for digest in (D1, D2, D3, D1):
            self.log.publish([Stored("e1", [digest])], ts=time.time())
        self.requests: list[Subscribe] = []
        self._server: Any = None
        self.port = 0

    async def start(self) -> None:
        service, method = SUBSCRIBE_METHOD.split("/")[1:]
        handler = grpc.method_handlers_generic_handler(
            service,
            {
                method: grpc.unary_stream_rpc_method_handler(
                    self._subscribe, request_deserializer=decode_subscribe, response_serializer=encode
                )
            },
        )
        self._server = grpc.aio.server(handlers=[handler])
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    async def aclose(self) -> None:
        await self._server.stop(0)

    async def _subscribe(self, request: Subscribe, context: Any) -> AsyncIterator[Batch]:
        self.requests.append(request)
        await context.send_initial_metadata(((EPOCH_HEADER, str(self.log.epoch)),))
        replay = self.log.replay_after(request.epoch, request.after_seq) or []
        first = len(self.requests) == 1
        for batch in replay:
            if not (first and batch.seq == 3):
                yield batch
        await asyncio.Event().wait()  # stay open, as a live feed does


class Recorder:
    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.lost: list[str] = []

    def on_batch(self, batch: Batch) -> None:
        self.seqs.append(batch.seq)

    def on_reset(self, source: str, endpoints: frozenset[EndpointId]) -> None:
        raise AssertionError("a replay covers the gap: no snapshot")

    def on_lost(self, address: str) -> None:
        self.lost.append(address)

    def on_restored(self, address: str) -> None:
        pass


async def test_gap_triggers_a_resubscription_that_fills_it() -> None:
    srv = GapServer()
    await srv.start()
    rec, stats = Recorder(), FeedStats()
    tracker = SequenceTracker(epoch=5, last_seq=1)  # it had applied seq 1
    client = FeedClient(f"127.0.0.1:{srv.port}", rec, subscriber="t", stats=stats, tracker=tracker)
    client.start()
    try:
        await eventually(lambda: rec.seqs[-1:] == [5])
        assert rec.seqs == [2, 3, 4, 5]  # 4 was skipped on the broken stream and came back in order
        assert stats.gaps == 1 and stats.reconnects == 1 and stats.duplicates == 0 and rec.lost == []
        assert [(r.epoch, r.after_seq) for r in srv.requests] == [(5, 1), (5, 2)]
    finally:
        await client.aclose()
        await srv.aclose()


class RecordingBackoff(Backoff):
    """A fast backoff (1 ms doubling to 8 ms) that records each delay it hands out."""

    def __init__(self) -> None:
        super().__init__(initial_s=0.001, max_s=0.008)
        self.delays: list[float] = []

    def next(self) -> float:
        delay = super().next()
        self.delays.append(delay)
        return delay


class FailingHandler(Recorder):
    """A receiver whose every apply fails (a bug on its side): each subscription ends "failed"."""

    def __init__(self) -> None:
        super().__init__()
        self.resets = 0

    def on_reset(self, source: str, endpoints: frozenset[EndpointId]) -> None:
        self.resets += 1

    def on_batch(self, batch: Batch) -> None:
        raise RuntimeError("receiver bug")


async def test_a_receiver_that_keeps_failing_resubscribes_with_growing_waits() -> None:
    """Each failed apply asks the source for a whole snapshot again: those asks back off (doubling to the
    cap), not a fixed first delay each time because the subscription itself was attached."""
    from runtime.feed.server import FeedServer

    feed_log = FeedLog("node-f", epoch=9)
    feed_log.publish([Stored("e1", [D1])], ts=time.time())
    server = FeedServer(feed_log, lambda: [Stored("e1", [D1])])
    await server.start()
    handler, backoff = FailingHandler(), RecordingBackoff()
    client = FeedClient(f"127.0.0.1:{server.port}", handler, subscriber="t", backoff=backoff)
    client.start()
    try:
        await eventually(lambda: len(backoff.delays) >= 5)
        assert backoff.delays[:5] == [0.001, 0.002, 0.004, 0.008, 0.008]
        assert handler.lost == []  # the source is fine: not an outage
    finally:
        await client.aclose()
        await server.aclose()
