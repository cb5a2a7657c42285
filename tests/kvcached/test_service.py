"""The local gRPC API in process: a real TieredStore (RAM + RocksDB) served on a unix socket and on TCP
with mTLS, driven through KvcachedClient; peer fallback with a stand-in PeerClient."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3
import grpc
import msgspec
import pytest
from prometheus_client import generate_latest

from certs.store import LOCAL_SANS, LeafFiles, dev_bundle, issue
from contracts.kvcached import GET, PUT, PutReply, PutRequest
from kvcached.block import checksum
from kvcached.config import TlsFiles
from kvcached.errors import BadRequest, KvcachedError, PeerUnavailable
from kvcached.service import ApiServer, KvcachedService
from kvcached.tiers import TieredStore
from runtime.kvcached import KvcachedClient
from tests.extproc.migration.test_identity import copy_of, rotate

MAX_BLOCK = 64 * 1024


def digest(i: int) -> bytes:
    return blake3.blake3(i.to_bytes(8, "little")).digest(16)


@dataclass
class Api:
    service: KvcachedService
    server: ApiServer
    store: TieredStore
    sock: Path
    leaves: dict[str, LeafFiles]


@pytest.fixture
def leaves(tmp_path: Path) -> dict[str, LeafFiles]:
    now = dt.datetime.now(dt.UTC)
    return dev_bundle(tmp_path / "certs", ["kvcached-a", "agent-a", "extproc", "client-test"], now)


def api_server(
    service: KvcachedService, tmp_path: Path, leaves: dict[str, LeafFiles], **options: int
) -> ApiServer:
    """``service``'s API on ``tmp_path/api.sock`` and TCP (mTLS, kvcached-a's certificate)."""
    a = leaves["kvcached-a"]
    return ApiServer(
        service,
        listen_unix=str(tmp_path / "api.sock"),
        listen_tcp="127.0.0.1:0",
        tls=TlsFiles(a.cert, a.key, a.ca),
        max_block_bytes=MAX_BLOCK,
        **options,
    )


@pytest.fixture
async def api(tmp_path: Path, leaves: dict[str, LeafFiles]) -> AsyncIterator[Api]:
    store = TieredStore(3 * 1024, tmp_path / "ssd", 1 << 20, max_block_bytes=MAX_BLOCK)
    service = KvcachedService(store)
    server = api_server(service, tmp_path, leaves)
    await server.start()
    yield Api(service, server, store, tmp_path / "api.sock", leaves)
    await server.aclose()
    store.close()


@pytest.fixture
async def client(api: Api) -> AsyncIterator[KvcachedClient]:
    c = KvcachedClient(f"unix:{api.sock}", timeout_s=5.0)
    yield c
    await c.aclose()


async def test_round_trip_through_both_tiers(api: Api, client: KvcachedClient) -> None:
    blocks = {digest(i): bytes([i]) * 1024 for i in range(5)}  # RAM holds 3: the first 2 are demoted
    for d, data in blocks.items():
        assert await client.put(d, data, checksum(data)) == "ram"
    chain = [*blocks, digest(99)]
    assert await client.contains(chain) == [True] * 5 + [False]
    prefix, tiers = await client.longest_prefix(chain)
    assert prefix == 5 and tiers[:2] == ["ssd", "ssd"] and tiers[2:] == ["ram"] * 3
    reply = await client.lookup(digest(0))
    assert reply.data == blocks[digest(0)] and reply.source == "ssd"
    assert (await client.lookup(digest(0))).source == "ram"  # promoted on the hit
    assert await client.get(digest(99)) is None
    assert await client.delete(digest(4)) is True
    assert await client.delete(digest(4)) is False
    assert await client.get(digest(4)) is None
    stats = await client.stats()
    assert stats["ssd_hits"] == 1 and stats["ram_evictions"] >= 2 and stats["ram_misses"] >= 1
    text = generate_latest(api.service.metrics.registry).decode()
    assert 'kvcached_tier_hits_total{tier="ssd"} 1.0' in text
    assert 'kvcached_get_seconds_count{source="ssd"} 1.0' in text
    assert 'kvcached_requests_total{code="OK",method="Put"} 5.0' in text


@pytest.mark.parametrize(
    ("d", "data", "check", "message"),
    [
        (b"short", b"x", None, "16"),
        (digest(1), b"x" * (MAX_BLOCK + 1), None, str(MAX_BLOCK)),
        (digest(1), b"x", checksum(b"y"), "checksum"),
    ],
)
async def test_bad_input_is_invalid_argument_and_nothing_stored(
    api: Api, client: KvcachedClient, d: bytes, data: bytes, check: bytes | None, message: str
) -> None:
    with pytest.raises(BadRequest, match=message) as info:
        await client.put(d, data, check)
    assert str(info.value).startswith("Put: ")
    assert api.store.held() == {"ram": [], "ssd": []}
    assert api.store.stats()["ram_blocks"] == 0


async def test_bad_digest_on_reads_and_undecodable_messages(api: Api, client: KvcachedClient) -> None:
    with pytest.raises(BadRequest, match="Get: "):
        await client.get(b"\x00" * 15)
    with pytest.raises(BadRequest, match="Contains: "):
        await client.contains([digest(1), b"x"])
    with pytest.raises(BadRequest, match="Delete: "):
        await client.delete(b"")
    async with grpc.aio.insecure_channel(f"unix:{api.sock}") as channel:
        for method in (PUT, GET):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary(method)(b"\xc1garbage", timeout=5.0)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "Expected" in (info.value.details() or "") or "invalid" in (info.value.details() or "")


async def test_tcp_requires_a_client_certificate(api: Api, tmp_path: Path) -> None:
    target = f"127.0.0.1:{api.server.tcp_port}"
    leaf = api.leaves["agent-a"]
    good = KvcachedClient(target, ca=leaf.ca, cert=leaf.cert, key=leaf.key, timeout_s=5.0)
    try:
        await good.put(digest(7), b"seven")
        assert await good.get(digest(7)) == b"seven"
    finally:
        await good.aclose()
    anonymous = KvcachedClient(target, ca=leaf.ca, timeout_s=3.0)
    other = dev_bundle(tmp_path / "other", ["client-evil"], dt.datetime.now(dt.UTC))["client-evil"]
    stranger = KvcachedClient(target, ca=leaf.ca, cert=other.cert, key=other.key, timeout_s=3.0)
    try:
        for refused in (anonymous, stranger):
            with pytest.raises(KvcachedError, match="UNAVAILABLE"):
                await refused.get(digest(7))
    finally:
        await anonymous.aclose()
        await stranger.aclose()


@pytest.mark.parametrize("name", ["client-test", "extproc", "kvcached-a"])
async def test_tcp_refuses_a_certificate_of_a_role_that_may_not_call(api: Api, name: str) -> None:
    """Same CA, wrong role: refused before anything is read or written; the Unix socket is not affected."""
    leaf = api.leaves[name]
    target = f"127.0.0.1:{api.server.tcp_port}"
    wrong = KvcachedClient(target, ca=leaf.ca, cert=leaf.cert, key=leaf.key, timeout_s=5.0)
    local = KvcachedClient(f"unix:{api.sock}", timeout_s=5.0)
    try:
        with pytest.raises(KvcachedError, match="PERMISSION_DENIED"):
            await wrong.put(digest(8), b"eight")
        with pytest.raises(KvcachedError, match="PERMISSION_DENIED"):
            await wrong.stats()
        assert await local.contains([digest(8)]) == [False]
    finally:
        await wrong.aclose()
        await local.aclose()


class FakePeers:
    """Stands in for PeerClient: per address, blocks it holds, or None (down: PeerUnavailable)."""

    def __init__(self, held: dict[str, dict[bytes, bytes] | None], delay_s: float = 0.0) -> None:
        self.held = held
        self.delay_s = delay_s
        self.calls: list[tuple[str, list[bytes]]] = []

    async def fetch(self, address: str, digests: Sequence[bytes]) -> dict[bytes, bytes]:
        self.calls.append((address, list(digests)))
        await asyncio.sleep(self.delay_s)  # simulated network time, not a readiness wait
        blocks = self.held[address]
        if blocks is None:
            raise PeerUnavailable(f"{address} down")
        return {d: blocks[d] for d in digests if d in blocks}


async def test_local_miss_is_fetched_from_a_peer_and_kept_in_ram(tmp_path: Path) -> None:
    store = TieredStore(1 << 20, None, 0)
    peers = FakePeers({"down:1": None, "empty:1": {}, "full:1": {digest(3): b"three"}}, delay_s=0.01)
    service = KvcachedService(store, peer_client=peers, peers=lambda: sorted(peers.held))  # type: ignore[arg-type]
    from contracts.kvcached import GetRequest

    replies = await asyncio.gather(*(service.get(GetRequest(digest(3))) for _ in range(4)))
    assert {(r.data, r.source) for r in replies} == {(b"three", "peer")}
    assert len(peers.calls) == 3  # one fetch per peer, shared by the four concurrent Gets
    assert store.tier_of(digest(3)) == "ram"
    assert (await service.get(GetRequest(digest(3)))).source == "ram"
    assert (await service.get(GetRequest(digest(4)))).data is None
    assert (await service.get(GetRequest(digest(5), peers=False))).data is None
    assert len(peers.calls) == 6
    assert service.peer_counters["hits"] == 1 and service.peer_counters["misses"] == 1
    assert service.peer_counters["unavailable"] == 2
    text = generate_latest(service.metrics.registry).decode()
    assert "kvcached_peer_fetch_bytes_total 5.0" in text
    assert 'kvcached_peer_fetch_seconds_count{outcome="unavailable"} 2.0' in text
    store.close()


async def test_a_hanging_peer_is_a_timely_miss() -> None:
    store = TieredStore(1 << 20, None, 0)
    peers = FakePeers({"slow:1": {digest(1): b"x"}}, delay_s=30.0)
    service = KvcachedService(store, peer_client=peers, peers=lambda: ["slow:1"], peer_timeout_s=0.2)  # type: ignore[arg-type]
    from contracts.kvcached import GetRequest

    loop = asyncio.get_running_loop()
    started = loop.time()
    assert (await service.get(GetRequest(digest(1)))).data is None
    assert loop.time() - started < 1.0
    store.close()


async def test_a_rotated_client_certificate_is_presented_by_the_next_call(api: Api, tmp_path: Path) -> None:
    """The TCP client follows rotation (``runtime.tls.RotatingChannel``): a key without its certificate
    yet keeps the pair in force; rotated to a role the API refuses, the next call is refused; rotated
    back to an agent's, the next call is served, without a new client."""
    mine = copy_of(api.leaves["agent-a"], tmp_path)
    assert mine.ca is not None and mine.cert is not None and mine.key is not None
    target = f"127.0.0.1:{api.server.tcp_port}"
    client = KvcachedClient(target, ca=mine.ca, cert=mine.cert, key=mine.key, timeout_s=5.0)
    try:
        await client.put(digest(9), b"nine")
        fresh = issue(mine.ca.parent, "extproc-2", LOCAL_SANS, dt.datetime.now(dt.UTC))
        os.replace(fresh.key, mine.key)  # half done: the key landed, its certificate not yet
        assert await client.get(digest(9)) == b"nine"
        os.replace(fresh.cert, mine.cert)  # now an ext_proc's: the TCP API refuses that role
        with pytest.raises(KvcachedError, match="PERMISSION_DENIED"):
            await client.get(digest(9))
        rotate(mine, "agent-b")
        assert await client.get(digest(9)) == b"nine"
    finally:
        await client.aclose()


async def test_an_unexpected_error_is_internal_counted_and_logged_without_its_message(
    api: Api, client: KvcachedClient, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_put(*_: object) -> None:
        raise Exception("IO error: While appending to file: SECRET-BLOCK-BYTES")  # as rocksdict raises

    monkeypatch.setattr(api.store, "put", broken_put)
    with pytest.raises(KvcachedError, match="internal error"):
        await client.put(digest(1), b"x", None)
    async with grpc.aio.insecure_channel(f"unix:{api.sock}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary(PUT)(msgspec.msgpack.encode(PutRequest(digest(2), b"x")), timeout=5.0)
    assert info.value.code() is grpc.StatusCode.INTERNAL
    assert "SECRET" not in (info.value.details() or "")
    text = generate_latest(api.service.metrics.registry).decode()
    assert 'kvcached_requests_total{code="INTERNAL",method="Put"} 2.0' in text
    assert "Put failed: unexpected Exception at" in caplog.text
    assert "SECRET" not in caplog.text


@pytest.mark.parametrize("listener", ["unix", "tcp"])
async def test_calls_over_the_concurrency_cap_are_refused_at_once_and_store_nothing(
    tmp_path: Path, leaves: dict[str, LeafFiles], listener: str
) -> None:
    """``max_concurrent_rpcs`` per listener: with that many Puts held in the handler, every further call
    is RESOURCE_EXHAUSTED at once (the client's KvcachedError, not BadRequest), the bytes the handlers
    hold stay at the cap's, nothing refused is stored, and the cap is free again once the calls end."""
    cap, size, sent = 3, MAX_BLOCK // 2, 8
    store = TieredStore(1 << 20, None, 0, max_block_bytes=MAX_BLOCK)
    service = KvcachedService(store)
    release, full = asyncio.Event(), asyncio.Event()
    held: dict[bytes, int] = {}
    put = service.put

    async def held_put(request: PutRequest) -> PutReply:
        held[request.digest] = len(request.data)
        if len(held) == cap:
            full.set()
        await release.wait()
        return await put(request)

    service.put = held_put  # type: ignore[method-assign]
    server = api_server(service, tmp_path, leaves, max_concurrent_rpcs=cap)
    await server.start()
    agent = leaves["agent-a"]
    client = (
        KvcachedClient(f"unix:{tmp_path / 'api.sock'}", timeout_s=10.0)
        if listener == "unix"
        else KvcachedClient(
            f"127.0.0.1:{server.tcp_port}", ca=agent.ca, cert=agent.cert, key=agent.key, timeout_s=10.0
        )
    )
    sample = service.metrics.registry.get_sample_value
    try:
        calls = [asyncio.ensure_future(client.put(digest(i), bytes([i]) * size)) for i in range(sent)]
        await asyncio.wait_for(full.wait(), 5.0)
        refused = [c for i, c in enumerate(calls) if digest(i) not in held]
        _, pending = await asyncio.wait(refused, timeout=5.0)
        assert not pending and len(refused) == sent - cap and len(held) == cap
        for call in refused:
            exc = call.exception()
            assert type(exc) is KvcachedError and "RESOURCE_EXHAUSTED" in str(exc)
        assert sum(held.values()) == cap * size
        assert sample("kvcached_api_rpcs_in_flight") == cap
        assert sample("kvcached_api_max_concurrent_rpcs") == cap
        with pytest.raises(KvcachedError, match="RESOURCE_EXHAUSTED"):
            await client.stats()  # any method, not only Put
        release.set()
        assert await asyncio.gather(*(c for c in calls if c not in refused)) == ["ram"] * cap
        stored = [i for i in range(sent) if store.contains([digest(i)]) == [True]]
        assert len(stored) == cap
        assert sample("kvcached_api_rpcs_in_flight") == 0
        # The cap is free again (gRPC counts a call until its reply's send completed: poll for that).
        tier: list[str | None] = []

        async def after() -> None:
            try:
                tier.append(await client.put(digest(100), b"after"))
            except KvcachedError as exc:
                assert "RESOURCE_EXHAUSTED" in str(exc)

        for _ in range(100):
            await after()
            if tier:
                break
            await asyncio.sleep(0.01)  # another poll of the server's own count, bounded by the range
        assert tier == ["ram"]
    finally:
        release.set()
        await client.aclose()
        await server.aclose()
        store.close()


def test_the_concurrency_cap_must_be_positive(tmp_path: Path) -> None:
    store = TieredStore(1024, None, 0, max_block_bytes=MAX_BLOCK)
    try:
        with pytest.raises(ValueError, match="max_concurrent_rpcs"):
            ApiServer(KvcachedService(store), listen_unix=str(tmp_path / "s"), max_concurrent_rpcs=0)
    finally:
        store.close()
