"""runtime.feed.server with runtime.feed.client over real gRPC on 127.0.0.1: live batches, replays,
snapshots, slow subscribers, restarts (plaintext and mTLS with certificates minted by certs/)."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from certs.store import dev_bundle
from contracts.events import (
    SUBSCRIBE_METHOD,
    Batch,
    Cleared,
    EndpointId,
    IndexEvent,
    Load,
    SequenceTracker,
    Stored,
    decode_batch,
    encode,
)
from runtime.feed.client import FeedClient
from runtime.feed.log import FeedLog
from runtime.feed.server import FeedServer
from runtime.tls import (
    ClientTlsFiles,
    ReloadingClientCerts,
    RotatingChannel,
    ServerTlsFiles,
    channel_credentials,
)
from tests.extproc.migration.test_identity import copy_of, rotate

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


async def subscribe_status(srv: FeedServer, files: ClientTlsFiles) -> grpc.StatusCode:
    """The status a raw Subscribe call ends with when the server answers it (not a handshake failure)."""
    async with grpc.aio.secure_channel(addr(srv), channel_credentials(files)) as channel:
        method = channel.unary_stream(SUBSCRIBE_METHOD, request_serializer=encode, response_deserializer=None)
        call = method(SequenceTracker().request("probe"), timeout=10)
        try:
            async for _ in call:
                break
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


@pytest.mark.parametrize("role", ["agent", "kvcached-b", "envoy-edge", "operator-ops", "client-x"])
async def test_mtls_refuses_a_certificate_of_a_role_that_may_not_subscribe(tmp_path: Path, role: str) -> None:
    """Issue 26.1: chaining to the CA is not enough; only a gateway's (``extproc``) identity subscribes."""
    bundle = dev_bundle(tmp_path / "pki", ["agent-node-a", "extproc", role], dt.datetime.now(dt.UTC))
    agent = bundle["agent-node-a"]
    srv = FeedServer(FeedLog("node-a"), Held(), tls=ServerTlsFiles(agent.cert, agent.key, agent.ca))
    await srv.start()
    wrong, right = bundle[role], bundle["extproc"]
    try:
        refused = Recorder()
        other = FeedClient(
            addr(srv),
            refused,
            subscriber="wrong",
            credentials=channel_credentials(ClientTlsFiles(ca=wrong.ca, cert=wrong.cert, key=wrong.key)),
        )
        other.start()
        try:
            await eventually(lambda: refused.lost == [addr(srv)])
            assert other.last_error.startswith("PERMISSION_DENIED") and refused.batches == []
        finally:
            await other.aclose()
        files = ClientTlsFiles(ca=wrong.ca, cert=wrong.cert, key=wrong.key)
        assert await subscribe_status(srv, files) == grpc.StatusCode.PERMISSION_DENIED
        assert srv.subscriptions == 0
        files = ClientTlsFiles(ca=right.ca, cert=right.cert, key=right.key)
        assert await subscribe_status(srv, files) == grpc.StatusCode.OK and srv.subscriptions == 1
    finally:
        await srv.aclose()


async def test_mtls_refuses_a_client_certificate_from_another_ca(tmp_path: Path) -> None:
    """An API client's certificate (its own CA, as ``kvgate up --secure`` issues them) fails the handshake."""
    now = dt.datetime.now(dt.UTC)
    agent = dev_bundle(tmp_path / "pki", ["agent"], now)["agent"]
    client = dev_bundle(tmp_path / "clients", ["client-x"], now)["client-x"]
    srv = FeedServer(FeedLog("node-a"), Held(), tls=ServerTlsFiles(agent.cert, agent.key, agent.ca))
    await srv.start()
    try:
        files = ClientTlsFiles(ca=agent.ca, cert=client.cert, key=client.key)
        assert await subscribe_status(srv, files) == grpc.StatusCode.UNAVAILABLE
        assert srv.subscriptions == 0
    finally:
        await srv.aclose()


async def test_a_rotated_client_certificate_is_presented_by_the_next_subscription(tmp_path: Path) -> None:
    """A feed client with a :class:`~runtime.tls.ReloadingClientCerts` (the ext_proc's ``[feeds]``
    files) keeps its running stream through a rotation and presents the new certificate when it
    subscribes again: rotated to a role the agent refuses, the agent's restart leaves it refused;
    rotated back to an ext_proc's, its next retry is attached, without a new client."""
    bundle = dev_bundle(tmp_path / "pki", ["agent", "extproc"], dt.datetime.now(dt.UTC))
    agent = bundle["agent"]
    files = ServerTlsFiles(agent.cert, agent.key, agent.ca)
    mine = copy_of(bundle["extproc"], tmp_path)
    tls = ReloadingClientCerts(mine, where="feeds")
    srv = FeedServer(FeedLog("node-a"), Held(), tls=files)
    await srv.start()
    port = srv.port
    rec = Recorder()
    client = await started(addr(srv), rec, credentials=tls)
    try:
        srv.publish([stored("e1", D1)])
        await eventually(lambda: rec.seqs() == [1, 2])
        rotate(mine, "operator-ops")  # may not subscribe
        srv.publish([stored("e1", D2)])  # the stream under way is not cut
        await eventually(lambda: rec.seqs() == [1, 2, 3])
        assert client.connected and tls.reloads == 0  # nothing new was opened yet
        await srv.aclose()
        await eventually(lambda: rec.lost == [f"127.0.0.1:{port}"])
        srv = FeedServer(FeedLog("node-a"), Held(), listen=f"127.0.0.1:{port}", tls=files)
        await srv.start()
        await eventually(lambda: "PERMISSION_DENIED" in client.last_error, 10.0)
        assert not client.connected and rec.restored == [] and tls.reloads == 1
        rotate(mine, "extproc-2")
        await eventually(lambda: client.connected, 10.0)
        assert rec.restored == [f"127.0.0.1:{port}"] and tls.reloads == 2
    finally:
        await client.aclose()
        await srv.aclose()


async def test_a_rotating_channel_moves_new_calls_and_closes_the_old_channel_after_its_last(
    tmp_path: Path,
) -> None:
    """``runtime.tls.RotatingChannel``: after a rotation a new call goes on a new channel (the agent
    sees two subscriptions); the stream opened before keeps its channel until it ends, then that channel
    is closed."""
    bundle = dev_bundle(tmp_path / "pki", ["agent", "extproc"], dt.datetime.now(dt.UTC))
    agent = bundle["agent"]
    srv = FeedServer(FeedLog("node-a"), Held(), tls=ServerTlsFiles(agent.cert, agent.key, agent.ca))
    await srv.start()
    mine = copy_of(bundle["extproc"], tmp_path)
    channel = RotatingChannel(addr(srv), ReloadingClientCerts(mine, where="feeds"))
    subscribe = channel.unary_stream(SUBSCRIBE_METHOD, request_serializer=encode, response_deserializer=None)
    try:
        first = subscribe(SequenceTracker().request("first"))
        assert (await first.initial_metadata()) is not None
        old = channel.current()
        rotate(mine, "extproc-2")
        second = subscribe(SequenceTracker().request("second"))
        assert (await second.initial_metadata()) is not None
        assert channel.rebuilds == 1 and channel.current() is not old
        await eventually(lambda: srv.subscriptions == 2)
        srv.publish([stored("e1", D1)])
        for call in (first, second):  # both streams carry the snapshot, then the batch: none was cut
            got = [decode_batch(await call.read()) for _ in range(2)]
            assert [b.snapshot for b in got] == [True, False] and got[1].events == [stored("e1", D1)]
        first.cancel()
        await eventually(lambda: old.get_state() is grpc.ChannelConnectivity.SHUTDOWN)
        assert channel.current().get_state() is not grpc.ChannelConnectivity.SHUTDOWN
        second.cancel()
    finally:
        await channel.close()
        await srv.aclose()
