"""The agent's index-event feed: FeedLog tables (sans IO), then FeedServer and ext_proc's FeedClient over
real gRPC on 127.0.0.1 (plaintext and mTLS with certificates minted by certs/)."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from agent.feed import FeedLog, FeedServer
from certs.store import dev_bundle
from extproc.events import Batch, Cleared, IndexEvent, Load, SequenceTracker, Stored, encode
from extproc.feeds import FeedClient, channel_credentials
from extproc.fleet import EndpointId
from extproc.tls import ClientTlsFiles, ServerTlsFiles

D1, D2, D3 = (bytes([i]) * 16 for i in (1, 2, 3))


def stored(endpoint: str, *digests: bytes) -> Stored:
    return Stored(endpoint, list(digests))


async def eventually(cond: Callable[[], bool], within_s: float = 5.0) -> None:
    """Poll ``cond`` until true or fail after ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


# --- FeedLog -------------------------------------------------------------------------------------------


def test_log_starts_with_an_empty_batch() -> None:
    log = FeedLog("node-a", epoch=7)
    assert (log.seq, log.held_batches, log.oldest_seq) == (1, 1, 1)
    assert log.replay_after(7, 0) == [Batch("node-a", 7, 1, [])]
    assert 0 <= FeedLog("node-b").epoch < 2**63


def test_publish_numbers_batches() -> None:
    log = FeedLog("node-a", epoch=7)
    b = log.publish([stored("e1", D1)], ts=12.5)
    assert (b.source, b.epoch, b.seq, b.ts, b.snapshot) == ("node-a", 7, 2, 12.5, False)
    assert log.publish([], ts=13.0).seq == 3


# 10 batches in all (seq 1..10) with a ring of 4: seqs 7..10 held.
@pytest.mark.parametrize(
    ("epoch", "after", "expected"),
    [
        (7, 10, []),  # up to date
        (7, 9, [10]),
        (7, 6, [7, 8, 9, 10]),  # exactly what the ring covers
        (7, 5, None),  # batch 6 dropped: snapshot
        (7, 0, None),
        (7, 11, None),  # a position this log never reached
        (7, -1, None),
        (8, 9, None),  # another epoch (the agent restarted)
        (None, 0, None),  # a new subscriber
    ],
)
def test_replay_coverage(epoch: int | None, after: int, expected: list[int] | None) -> None:
    log = FeedLog("node-a", epoch=7, max_batches=4)
    for _ in range(9):
        log.publish([stored("e1", D1)], ts=1.0)
    replay = log.replay_after(epoch, after)
    assert (None if replay is None else [b.seq for b in replay]) == expected


def test_ring_bounded_by_bytes() -> None:
    one = len(encode(Batch("node-a", 7, 2, [stored("e1", D1, D2)], ts=1.0)))
    log = FeedLog("node-a", epoch=7, max_bytes=3 * one)
    for _ in range(10):
        log.publish([stored("e1", D1, D2)], ts=1.0)
    assert log.held_bytes <= 3 * one
    assert log.held_batches == 3
    assert log.oldest_seq == 9
    assert log.replay_after(7, 8) is not None and log.replay_after(7, 7) is None


def test_batch_larger_than_the_ring_is_not_kept() -> None:
    log = FeedLog("node-a", epoch=7, max_bytes=64)
    log.publish([stored("e1", *[bytes([i]) * 16 for i in range(10)])], ts=1.0)
    assert log.held_batches == 0 and log.held_bytes == 0
    assert log.replay_after(7, 2) == []  # up to date needs nothing
    assert log.replay_after(7, 1) is None


def test_ring_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="max_batches"):
        FeedLog("node-a", max_batches=0)


def test_snapshot_at_last_seq_clears_every_endpoint_then_holds_then_loads() -> None:
    log = FeedLog("node-a", epoch=7)
    log.publish([stored("e1", D1), Load("e1", 1, 2, 0.5)], ts=1.0)
    log.publish([Cleared("e0"), Load("e1", 3, 4, 0.25)], ts=2.0)
    snap = log.snapshot([stored("e2", D2)], ts=3.0)
    assert (snap.seq, snap.epoch, snap.snapshot, snap.ts) == (3, 7, True, 3.0)
    assert snap.events == [
        Cleared("e0"),
        Cleared("e1"),
        Cleared("e2"),
        stored("e2", D2),
        Load("e1", 3, 4, 0.25),
    ]
    assert log.held_batches == 3  # the snapshot is not part of the ring
    log.forget("e0")
    log.forget("e1")
    assert log.snapshot([], ts=4.0).events == [Cleared("e2")]


# --- over gRPC -------------------------------------------------------------------------------------------


class Recorder:
    """A FeedHandler that records what it is told."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.resets: list[tuple[str, frozenset[EndpointId]]] = []
        self.lost: list[str] = []
        self.restored: list[str] = []

    def on_batch(self, batch: Batch) -> None:
        self.batches.append(batch)

    def on_reset(self, source: str, endpoints: frozenset[EndpointId]) -> None:
        self.resets.append((source, endpoints))

    def on_lost(self, address: str) -> None:
        self.lost.append(address)

    def on_restored(self, address: str) -> None:
        self.restored.append(address)

    def seqs(self) -> list[int]:
        return [b.seq for b in self.batches]


class Held:
    """What the agent's translators hold: the snapshot source."""

    def __init__(self) -> None:
        self.events: list[IndexEvent] = []

    def __call__(self) -> list[IndexEvent]:
        return list(self.events)


@pytest.fixture
def held() -> Held:
    return Held()


@pytest.fixture
async def server(held: Held) -> AsyncIterator[FeedServer]:
    srv = FeedServer(FeedLog("node-a", max_batches=8), held)
    await srv.start()
    yield srv
    await srv.aclose()


async def started(
    address: str, handler: Recorder, *, tracker: SequenceTracker | None = None, credentials: Any = None
) -> FeedClient:
    client = FeedClient(address, handler, subscriber="test", tracker=tracker, credentials=credentials)
    client.start()
    await eventually(lambda: client.connected)
    return client


def addr(srv: FeedServer) -> str:
    return f"127.0.0.1:{srv.port}"


async def test_live_batches_arrive_in_order(server: FeedServer) -> None:
    rec = Recorder()
    client = await started(addr(server), rec)
    try:
        for i in range(5):
            server.publish([stored("e1", D1), Load("e1", i, 0)])
        await eventually(lambda: rec.seqs() == [1, 2, 3, 4, 5, 6])
        assert rec.batches[0].snapshot and rec.resets == [("node-a", frozenset())]
        assert [b.events[1] for b in rec.batches[1:]] == [Load("e1", i, 0) for i in range(5)]
        assert client.stats.batches == 6 and client.stats.events == 10 and client.stats.gaps == 0
        assert len(client.stats.staleness_s) == 6 and all(s >= 0 for s in client.stats.staleness_s)
        assert rec.lost == [] and server.subscribers == 1
    finally:
        await client.aclose()
    await eventually(lambda: server.subscribers == 0)


async def test_reconnect_after_missing_batches_gets_a_replay(server: FeedServer) -> None:
    rec = Recorder()
    client = await started(addr(server), rec)
    server.publish([stored("e1", D1)])
    await eventually(lambda: rec.seqs() == [1, 2])
    await client.aclose()
    await eventually(lambda: server.subscribers == 0)
    for _ in range(3):
        server.publish([stored("e1", D2)])
    rec2 = Recorder()
    client = await started(addr(server), rec2, tracker=client.tracker)
    try:
        await eventually(lambda: rec2.seqs() == [3, 4, 5])
        assert rec2.resets == [] and not any(b.snapshot for b in rec2.batches)
        assert (server.replays, server.snapshots) == (1, 1)
    finally:
        await client.aclose()


async def test_too_far_behind_gets_a_snapshot(server: FeedServer, held: Held) -> None:
    held.events = [stored("e1", D1, D2)]  # what the translators hold now
    rec = Recorder()
    client = await started(addr(server), rec)
    await eventually(lambda: rec.seqs() == [1])
    await client.aclose()
    for _ in range(20):  # the ring holds 8
        server.publish([stored("e1", D3)])
    rec2 = Recorder()
    client = await started(addr(server), rec2, tracker=client.tracker)
    try:
        await eventually(lambda: rec2.seqs() == [21])
        snap = rec2.batches[0]
        assert snap.snapshot and snap.seq == server.log.seq == 21
        assert snap.events == [Cleared("e1"), stored("e1", D1, D2)]
        assert rec2.resets == [("node-a", frozenset({EndpointId("e1")}))]
        server.publish([stored("e1", D3)])
        await eventually(lambda: rec2.seqs() == [21, 22])  # live batches continue from the snapshot
    finally:
        await client.aclose()


async def test_two_clients_see_the_same_sequence(server: FeedServer) -> None:
    recs = [Recorder(), Recorder()]
    clients = [await started(addr(server), r) for r in recs]
    try:
        for i in range(10):
            server.publish([stored(f"e{i % 3}", D1)])
        await eventually(lambda: all(len(r.batches) == 11 for r in recs))
        assert recs[0].batches[1:] == recs[1].batches[1:]  # each got its own snapshot first, then the same
        assert recs[0].seqs() == recs[1].seqs() == list(range(1, 12))
    finally:
        for c in clients:
            await c.aclose()


async def test_snapshots_and_live_batches_never_interleave_wrongly() -> None:
    """Subscribers attach while a translator keeps changing its state and publishing: each one's
    snapshot plus the live batches after it rebuilds exactly the translator's state, with no seq twice."""
    held: set[bytes] = set()

    def source() -> list[IndexEvent]:
        return [stored("e1", *sorted(held))]

    srv = FeedServer(FeedLog("node-a", max_batches=2), source, queue_batches=100_000)
    await srv.start()
    recs = [Recorder() for _ in range(3)]
    clients: list[FeedClient] = []
    attach = asyncio.create_task(attach_all(srv, recs, clients))
    n = 0
    while not attach.done() or n < 50:
        digest = n.to_bytes(16, "big")
        held.add(digest)  # the translator's state change and its batch, in one synchronous step
        srv.publish([stored("e1", digest)])
        n += 1
        await asyncio.sleep(0)
    await attach
    try:
        final = srv.log.seq
        for rec in recs:
            await eventually(lambda rec=rec: rec.seqs()[-1:] == [final])  # type: ignore[misc]
            state: set[bytes] = set()
            for batch in rec.batches:
                if batch.snapshot:
                    state = set()
                for event in batch.events:
                    if isinstance(event, Stored):
                        state.update(event.digests)
            assert state == held
            assert rec.batches[0].snapshot
            for before, after in itertools.pairwise(rec.batches):  # live batches follow on from a snapshot
                assert after.snapshot or after.seq == before.seq + 1
        assert srv.snapshots == 3 + srv.lagged and all(c.stats.gaps == 0 for c in clients)
        assert any(rec.batches[0].seq > 1 for rec in recs)  # snapshots were taken mid-stream
    finally:
        for c in clients:
            await c.aclose()
        await srv.aclose()


async def attach_all(srv: FeedServer, recs: list[Recorder], clients: list[FeedClient]) -> None:
    for rec in recs:
        clients.append(await started(addr(srv), rec))


async def test_slow_subscriber_is_disconnected_and_resumes() -> None:
    srv = FeedServer(FeedLog("node-a", max_batches=64), Held(), queue_batches=2)
    await srv.start()
    rec = Recorder()
    client = await started(addr(srv), rec)
    try:
        for _ in range(10):  # published in one go: the subscriber's queue of 2 overflows
            srv.publish([stored("e1", D1)])
        await eventually(lambda: rec.seqs()[-1:] == [11])
        assert rec.seqs() == list(range(1, 12))  # replayed what it missed, in order, no duplicates
        assert srv.lagged == 1 and client.stats.reconnects == 1
        assert rec.lost == []  # falling behind is not losing the agent
    finally:
        await client.aclose()
        await srv.aclose()


async def test_server_restart_resets_the_client() -> None:
    srv = FeedServer(FeedLog("node-a"), Held())
    await srv.start()
    port = srv.port
    rec = Recorder()
    client = await started(addr(srv), rec)
    try:
        srv.publish([stored("e1", D1)])
        await eventually(lambda: rec.seqs() == [1, 2])
        old_epoch = srv.log.epoch
        await srv.aclose()
        await eventually(lambda: rec.lost == [f"127.0.0.1:{port}"])
        held = Held()
        held.events = [stored("e1", D2)]
        srv = FeedServer(FeedLog("node-a"), held, listen=f"127.0.0.1:{port}")
        await srv.start()
        await eventually(lambda: len(rec.resets) == 2)
        assert rec.restored == [f"127.0.0.1:{port}"]
        snap = rec.batches[-1]
        assert snap.snapshot and snap.epoch == srv.log.epoch != old_epoch and snap.seq == 1
        assert client.tracker == SequenceTracker(srv.log.epoch, 1)
    finally:
        await client.aclose()
        await srv.aclose()


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, ServerTlsFiles | ClientTlsFiles]:
    bundle = dev_bundle(tmp_path / "pki", ["agent", "extproc"], dt.datetime.now(dt.UTC))
    agent, extproc = bundle["agent"], bundle["extproc"]
    return {
        "server": ServerTlsFiles(agent.cert, agent.key, agent.ca),
        "client": ClientTlsFiles(ca=extproc.ca, cert=extproc.cert, key=extproc.key),
        "anonymous": ClientTlsFiles(ca=extproc.ca),
    }


async def test_mtls_accepts_a_client_certificate_and_refuses_none(
    pki: dict[str, ServerTlsFiles | ClientTlsFiles],
) -> None:
    server_files = pki["server"]
    assert isinstance(server_files, ServerTlsFiles)
    srv = FeedServer(FeedLog("node-a"), Held(), tls=server_files)
    await srv.start()
    good, anonymous = pki["client"], pki["anonymous"]
    assert isinstance(good, ClientTlsFiles) and isinstance(anonymous, ClientTlsFiles)
    rec = Recorder()
    client = await started(addr(srv), rec, credentials=channel_credentials(good))
    refused = Recorder()
    other = FeedClient(addr(srv), refused, subscriber="anon", credentials=channel_credentials(anonymous))
    other.start()
    try:
        srv.publish([stored("e1", D1)])
        await eventually(lambda: rec.seqs() == [1, 2])
        await eventually(lambda: refused.lost == [addr(srv)])
        assert refused.batches == [] and not other.connected
        assert srv.subscriptions == 1
    finally:
        await other.aclose()
        await client.aclose()
        await srv.aclose()
