"""QUIC peer fetch on loopback with mTLS: round trips, rejections, timeouts, corruption, pacing.

Servers bind ``127.0.0.1:0``; certificates are minted per test into ``tmp_path`` with the certs/ tooling.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import shutil
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from aioquic.quic.configuration import QuicConfiguration
from cryptography import x509

from certs.store import LOCAL_SANS, LeafFiles, dev_bundle, issue
from kvcached import peers
from kvcached.block import HEADER_BYTES, decode_record, encode_record, verify_record
from kvcached.errors import BadRequest, KvcachedConfigError, PeerUnavailable
from kvcached.peers import PeerClient, PeerServer, split_address
from kvcached.tiers import TieredStore
from kvcached.wire import (
    FrameReader,
    TokenBucket,
    decode_request,
    encode_request,
    frame_header,
    max_request_bytes,
)

NOW = dt.datetime.now(dt.UTC)
#: Roles of the peers' CA with client usage that may not fetch blocks (issue 26.1: kvcached only).
WRONG = ("agent-node-b", "extproc", "operator-ops", "client-x")


class DictStore:
    """The one store method the server uses, over a dict."""

    def __init__(self, blocks: dict[bytes, bytes] | None = None) -> None:
        self.blocks = dict(blocks or {})

    def get(self, digest: bytes) -> bytes | None:
        return self.blocks.get(digest)


def digest(i: int) -> bytes:
    return i.to_bytes(16, "big")


@dataclass
class Pki:
    a: LeafFiles
    b: LeafFiles
    rogue: LeafFiles  # same name, another CA
    wrong: dict[str, LeafFiles]  # same CA, roles that may not fetch blocks


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    good = dev_bundle(tmp_path_factory.mktemp("pki"), ["kvcached-a", "kvcached-b", *WRONG], NOW)
    other = dev_bundle(tmp_path_factory.mktemp("rogue"), ["kvcached-a"], NOW)
    return Pki(good["kvcached-a"], good["kvcached-b"], other["kvcached-a"], {n: good[n] for n in WRONG})


def server_for(store: object, leaf: LeafFiles, **kw: object) -> PeerServer:
    return PeerServer(
        store,  # type: ignore[arg-type]
        host="127.0.0.1",
        port=0,
        cert=leaf.cert,
        key=leaf.key,
        ca=leaf.ca,
        **kw,  # type: ignore[arg-type]
    )


def client_for(leaf: LeafFiles, *, ca: Path | None = None, **kw: float) -> PeerClient:
    return PeerClient(cert=leaf.cert, key=leaf.key, ca=ca or leaf.ca, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def served(pki: Pki) -> AsyncIterator[tuple[PeerServer, DictStore, str]]:
    store = DictStore({digest(i): os.urandom(1000 + i) for i in range(200)})
    server = server_for(store, pki.a)
    port = await server.start()
    yield server, store, f"127.0.0.1:{port}"
    await server.aclose()


# -- sans-IO framing -----------------------------------------------------------------------------------


def test_request_round_trip_and_bad_requests() -> None:
    ds = [digest(i) for i in range(5)]
    raw = encode_request(ds)
    assert decode_request(raw) == ds
    assert decode_request(encode_request([])) == []
    for bad in (b"", b"XXXX" + raw[4:], raw[:-1], raw + b"\0"):
        with pytest.raises(BadRequest):
            decode_request(bad)
    with pytest.raises(BadRequest):
        encode_request([b"short"])
    assert len(encode_request([digest(0)] * 4096)) == max_request_bytes()
    with pytest.raises(BadRequest):
        encode_request([digest(0)] * 4097)


def test_frame_reader_reassembles_any_split() -> None:
    records = [(digest(i), encode_record(digest(i), os.urandom(i * 37))) for i in range(6)]
    stream = b"".join(frame_header(d, len(r)) + r for d, r in records)
    for step in (1, 7, 100, len(stream)):
        reader = FrameReader(max_record_bytes=10_000)
        got = [f for at in range(0, len(stream), step) for f in reader.feed(stream[at : at + step])]
        assert [(f.digest, f.head + f.body) for f in got] == records
        assert all(f.head == b"" for f in got)
        assert reader.pending() == 0
        # split at the record header, as the client reads: the body is the payload, verified as is
        reader = FrameReader(max_record_bytes=10_000, head_bytes=HEADER_BYTES)
        got = [f for at in range(0, len(stream), step) for f in reader.feed(stream[at : at + step])]
        assert [len(f.head) for f in got] == [HEADER_BYTES] * len(records)
        assert [verify_record(f.digest, f.head, f.body) for f in got] == [
            decode_record(d, r) for d, r in records
        ]
    reader = FrameReader(max_record_bytes=10_000)
    reader.feed(stream[:-3])
    assert reader.pending() > 0  # a torn last frame
    # an announced length over the bound stops the reader; a whole frame before it in the same chunk is kept
    first = encode_record(digest(1), b"x" * 5)
    reader = FrameReader(max_record_bytes=len(first))
    got = reader.feed(frame_header(digest(1), len(first)) + first + frame_header(digest(2), len(first) + 1))
    assert [(f.digest, f.body) for f in got] == [(digest(1), first)]
    assert reader.broken is not None and "out of bounds" in reader.broken
    assert reader.feed(frame_header(digest(1), len(first)) + first) == []  # nothing after it


def test_token_bucket_paces_to_rate() -> None:
    bucket = TokenBucket(rate=1000.0, burst=500.0)
    assert bucket.reserve(500, now=0.0) == 0.0
    assert bucket.reserve(1000, now=0.0) == pytest.approx(1.0)
    assert bucket.reserve(500, now=1.0) == pytest.approx(0.5)  # debt repaid at 1.0, then 500 more
    assert bucket.reserve(100, now=10.0) == 0.0  # refilled, capped at burst
    with pytest.raises(ValueError):
        TokenBucket(rate=0.0, burst=1.0)


def test_bad_settings_are_config_errors(pki: Pki, tmp_path: Path) -> None:
    bad: list[dict[str, float]] = [
        {"max_datagram_size": 1000},
        {"max_datagram_size": 65001},
        {"timeout_s": 0},
        {"max_in_flight": 0},
    ]
    for kw in bad:
        with pytest.raises(KvcachedConfigError):
            client_for(pki.b, **kw)
    with pytest.raises(KvcachedConfigError):
        client_for(pki.b, ca=tmp_path / "missing.pem")
    for skw in ({"max_concurrent_streams": 0}, {"egress_bytes_per_s": 0.0}, {"max_datagram_size": 100}):
        with pytest.raises(KvcachedConfigError):
            server_for(DictStore(), pki.a, **skw)


def test_split_address() -> None:
    assert split_address("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert split_address("[::1]:443") == ("::1", 443)
    for bad in ("nohost", ":1", "h:0", "h:x", "h:70000"):
        with pytest.raises(KvcachedConfigError):
            split_address(bad)


# -- over QUIC -----------------------------------------------------------------------------------------


async def test_fetch_many_blocks_in_one_request_over_one_connection(
    pki: Pki, served: tuple[PeerServer, DictStore, str]
) -> None:
    server, store, address = served
    client = client_for(pki.b)
    try:
        wanted = [digest(i) for i in range(0, 250)]  # 200 held, 50 not
        got = await client.fetch(address, wanted)
        assert got == {d: store.blocks[d] for d in wanted if d in store.blocks}
        again = await client.fetch(address, [digest(7), digest(7), digest(999)])
        assert again == {digest(7): store.blocks[digest(7)]}
        assert await client.fetch(address, []) == {}
        assert server.stats()["connections"] == 1  # the connection was reused
        assert server.stats()["served_blocks"] == 201
        assert client.stats()["fetched_blocks"] == 201
        with pytest.raises(BadRequest):
            await client.fetch(address, [b"not a digest"])
    finally:
        await client.aclose()


async def test_long_digest_lists_split_across_streams(
    pki: Pki, served: tuple[PeerServer, DictStore, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _, address = served
    monkeypatch.setattr(peers, "MAX_REQUEST_DIGESTS", 16)
    client = client_for(pki.b)
    try:
        got = await client.fetch(address, [digest(i) for i in range(100)])
        assert set(got) == {digest(i) for i in range(100)}
        assert server.stats()["requests"] == 7
    finally:
        await client.aclose()


async def test_two_daemons_fetch_from_each_other(pki: Pki) -> None:
    store_a = TieredStore(ram_bytes=1 << 20, ssd_path=None, ssd_bytes=0)
    store_b = TieredStore(ram_bytes=1 << 20, ssd_path=None, ssd_bytes=0)
    store_a.put(digest(1), b"held by a")
    store_b.put(digest(2), b"held by b")
    server_a, server_b = server_for(store_a, pki.a), server_for(store_b, pki.b)
    port_a, port_b = await server_a.start(), await server_b.start()
    client_a, client_b = client_for(pki.a), client_for(pki.b)
    try:
        both = [digest(1), digest(2)]
        assert await client_a.fetch(f"127.0.0.1:{port_b}", both) == {digest(2): b"held by b"}
        assert await client_b.fetch(f"localhost:{port_a}", both) == {digest(1): b"held by a"}
    finally:
        await asyncio.gather(client_a.aclose(), client_b.aclose(), server_a.aclose(), server_b.aclose())
        store_a.close()
        store_b.close()


async def test_client_with_cert_from_another_ca_is_rejected(
    pki: Pki, served: tuple[PeerServer, DictStore, str]
) -> None:
    server, _, address = served
    client = client_for(pki.rogue, ca=pki.a.ca)  # trusts the server, but its own cert is foreign
    try:
        with pytest.raises(PeerUnavailable):
            await client.fetch(address, [digest(1)])
        assert server.stats()["rejected"] == 1
        assert server.stats()["served_blocks"] == 0
    finally:
        await client.aclose()


@pytest.mark.parametrize("name", WRONG)
async def test_client_cert_of_another_role_is_rejected(
    pki: Pki, served: tuple[PeerServer, DictStore, str], name: str, caplog: pytest.LogCaptureFixture
) -> None:
    server, _, address = served
    client = client_for(pki.wrong[name])  # chains to the CA, clientAuth usage, but not a kvcached
    try:
        with pytest.raises(PeerUnavailable):
            await client.fetch(address, [digest(1)])
        assert server.stats()["rejected"] == 1
        assert server.stats()["served_blocks"] == 0
        assert "may not fetch" in caplog.text
    finally:
        await client.aclose()


async def test_client_without_cert_is_rejected(
    pki: Pki, served: tuple[PeerServer, DictStore, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _, address = served
    make = peers._configuration

    def no_cert(**kw: Path | bool) -> QuicConfiguration:
        config = make(**kw)  # type: ignore[arg-type]
        if config.is_client:
            config.certificate = None
            config.private_key = None
        return config

    monkeypatch.setattr(peers, "_configuration", no_cert)
    client = client_for(pki.b)
    try:
        with pytest.raises(PeerUnavailable):
            await client.fetch(address, [digest(1)])
        assert server.stats()["rejected"] == 1
        assert server.stats()["served_blocks"] == 0
    finally:
        await client.aclose()


async def test_server_with_cert_from_another_ca_is_refused(pki: Pki) -> None:
    server = server_for(DictStore({digest(1): b"x"}), pki.rogue)
    port = await server.start()
    client = client_for(pki.b)
    try:
        with pytest.raises(PeerUnavailable):
            await client.fetch(f"127.0.0.1:{port}", [digest(1)])
        assert server.stats()["served_blocks"] == 0
    finally:
        await client.aclose()
        await server.aclose()


@pytest.mark.parametrize("listening", [False, True], ids=["nothing-bound", "bound-but-silent"])
async def test_peer_down_is_a_timely_miss(pki: Pki, listening: bool) -> None:
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    port = silent.getsockname()[1]
    if not listening:
        silent.close()
    client = client_for(pki.b, timeout_s=0.4)
    try:
        started = time.monotonic()
        with pytest.raises(PeerUnavailable):
            await client.fetch(f"127.0.0.1:{port}", [digest(1)])
        assert time.monotonic() - started < 0.4 + 0.5
        assert client.stats()["unavailable"] == 1
    finally:
        await client.aclose()
        silent.close()


async def test_server_gone_after_connecting_is_a_timely_miss(pki: Pki) -> None:
    server = server_for(DictStore({digest(1): b"x"}), pki.a)
    port = await server.start()
    client = client_for(pki.b, timeout_s=0.4)
    try:
        assert await client.fetch(f"127.0.0.1:{port}", [digest(1)]) == {digest(1): b"x"}
        server._server._transport.pause_reading()  # type: ignore[union-attr]  # hung: reads nothing more
        started = time.monotonic()
        with pytest.raises(PeerUnavailable):
            await client.fetch(f"127.0.0.1:{port}", [digest(1)])
        assert time.monotonic() - started < 0.4 + 0.5
    finally:
        await client.aclose()
        await server.aclose()


async def test_corrupted_frame_is_dropped_not_returned(
    pki: Pki, served: tuple[PeerServer, DictStore, str]
) -> None:
    server, store, address = served

    def flip_one(d: bytes, data: bytes) -> bytes:
        record = bytearray(encode_record(d, data))
        if d == digest(3):
            record[-1] ^= 0x01
        return bytes(record)

    server.encode = flip_one
    client = client_for(pki.b)
    try:
        got = await client.fetch(address, [digest(i) for i in range(6)])
        assert set(got) == {digest(i) for i in (0, 1, 2, 4, 5)}
        assert all(got[d] == store.blocks[d] for d in got)
        assert client.stats()["corrupt"] == 1
    finally:
        await client.aclose()


async def test_block_over_the_clients_max_block_bytes_is_a_miss(pki: Pki) -> None:
    sizes = {digest(0): 4000, digest(1): 4000, digest(2): 16_000}
    store = DictStore({d: os.urandom(n) for d, n in sizes.items()})
    server = server_for(store, pki.a)
    address = f"127.0.0.1:{await server.start()}"
    # the record bound is max_block_bytes + RECORD_OVERHEAD_MAX (1,024): 16,000 bytes is well over it
    small, default = client_for(pki.b, max_block_bytes=8000), client_for(pki.b)
    try:
        assert await small.fetch(address, [digest(0)]) == {digest(0): store.blocks[digest(0)]}
        # a frame announcing more than the limit abandons the stream: what came before it is kept
        got = await small.fetch(address, [digest(1), digest(2), digest(0)])
        assert got == {digest(1): store.blocks[digest(1)]}
        assert len(await default.fetch(address, [digest(2)])) == 1  # the default limit takes it
    finally:
        await small.aclose()
        await default.aclose()
        await server.aclose()


async def test_egress_limit_is_respected_roughly(pki: Pki) -> None:
    block = 256 * 1024
    store = DictStore({digest(i): os.urandom(block) for i in range(8)})
    rate = 4 * 1024 * 1024.0
    server = server_for(store, pki.a, egress_bytes_per_s=rate)
    port = await server.start()
    client = client_for(pki.b, timeout_s=5.0)
    try:
        started = time.monotonic()
        got = await client.fetch(f"127.0.0.1:{port}", list(store.blocks))
        elapsed = time.monotonic() - started
        assert len(got) == 8
        floor = (8 * block - peers.CHUNK_BYTES) / rate  # all but one burst, at the rate
        assert floor * 0.9 <= elapsed < floor * 4 + 1.0
    finally:
        await client.aclose()
        await server.aclose()


async def test_bounded_streams_still_serve_concurrent_fetches(pki: Pki) -> None:
    store = DictStore({digest(i): os.urandom(5000) for i in range(40)})
    server = server_for(store, pki.a, max_concurrent_streams=2)
    port = await server.start()
    client = client_for(pki.b, max_in_flight=8)
    try:
        results = await asyncio.gather(
            *(client.fetch(f"127.0.0.1:{port}", [digest(i), digest(i + 20)]) for i in range(20))
        )
        assert all(len(r) == 2 for r in results)
        assert sum(len(r) for r in results) == 40
    finally:
        await client.aclose()
        await server.aclose()


@pytest.mark.parametrize(
    ("server_datagram", "client_datagram"),
    [
        (1200, 1200),
        (9000, 9000),
        (16_000, 16_000),
        (16_384, 16_384),
        (65_000, 65_000),
        (65_000, 1200),
        (1200, 65_000),
    ],
)
async def test_large_block_round_trip(pki: Pki, server_datagram: int, client_datagram: int) -> None:
    """Every datagram size the settings accept, on both sides independently: above 16,000 bytes the
    handshake runs at 16,000 and a packet carries several STREAM frames (kvcached.datagrams)."""
    data = os.urandom(5 * 1024 * 1024 + 3)
    server = server_for(DictStore({digest(9): data}), pki.a, max_datagram_size=server_datagram)
    port = await server.start()
    client = client_for(pki.b, timeout_s=5.0, max_datagram_size=client_datagram)
    try:
        got = await client.fetch(f"127.0.0.1:{port}", [digest(9)])
        assert got[digest(9)] == data
        assert decode_record(digest(9), encode_record(digest(9), data)) == data
    finally:
        await client.aclose()
        await server.aclose()


async def test_many_streams_share_large_datagrams(pki: Pki) -> None:
    """Concurrent fetches over one connection with 65,000-byte datagrams: frames of several streams in a
    packet, every block whole."""
    blocks = {digest(i): os.urandom(300_000 + i) for i in range(24)}
    server = server_for(DictStore(blocks), pki.a, max_datagram_size=65_000)
    port = await server.start()
    client = client_for(pki.b, timeout_s=5.0, max_datagram_size=65_000)
    try:
        results = await asyncio.gather(
            *(client.fetch(f"127.0.0.1:{port}", [digest(i), digest(i + 12)]) for i in range(12))
        )
        got = {d: v for r in results for d, v in r.items()}
        assert got == blocks
    finally:
        await client.aclose()
        await server.aclose()


async def test_server_closing_mid_response_is_a_prompt_miss(pki: Pki) -> None:
    store = DictStore({digest(i): os.urandom(256 * 1024) for i in range(16)})
    server = server_for(store, pki.a, egress_bytes_per_s=1024 * 1024.0)  # 4 s for everything
    port = await server.start()
    # The client's own no-progress timeout is far off, so a miss within it can only come from the close.
    client = client_for(pki.b, timeout_s=60.0)
    try:
        fetch = asyncio.ensure_future(client.fetch(f"127.0.0.1:{port}", list(store.blocks)))
        for _ in range(500):  # poll (5 s at most) until the response has started
            if server.stats()["served_bytes"] > 0:
                break
            await asyncio.sleep(0.01)
        started = time.monotonic()
        await server.aclose()
        with pytest.raises(PeerUnavailable, match="connection closed"):
            await fetch
        # Prompt: learned from the server's CONNECTION_CLOSE, not from waiting out the timeout (the bound is
        # loose because a shared 2-core CI machine has stalled this process for ~3 s).
        assert time.monotonic() - started < 10.0
    finally:
        await client.aclose()
        await server.aclose()


def serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def peer_serial(quic: object) -> int:
    """The serial of the certificate the other side presented on a connection (``QuicConnection``)."""
    cert = quic.tls._peer_certificate  # type: ignore[attr-defined]
    assert cert is not None
    return int(cert.serial_number)


def own_copy(leaf: LeafFiles, where: Path) -> tuple[LeafFiles, Path]:
    """``leaf``'s certificate and key copied under ``where``, and a copy of its CA directory's CA (so that
    rotating never touches the module's files)."""
    where.mkdir()
    for name in ("ca.pem", "ca.key"):
        shutil.copy(leaf.ca.parent / name, where / name)
    shutil.copy(leaf.cert, where / "mine.pem")
    shutil.copy(leaf.key, where / "mine.key")
    return LeafFiles(leaf.name, where / "mine.pem", where / "mine.key", leaf.ca), where


async def test_rotated_certificates_are_presented_by_the_next_connection(pki: Pki, tmp_path: Path) -> None:
    """Peer TLS follows rotation on both sides (``runtime.tls.ReloadingClientCerts``, stat per new
    connection): kept connections go on with the certificate they were opened with; a new one presents
    the rotated certificate; a key whose certificate has not landed yet keeps the pair in force."""
    store = DictStore({digest(1): b"one"})
    client_leaf, client_ca = own_copy(pki.b, tmp_path / "client")
    server_leaf, server_ca = own_copy(pki.a, tmp_path / "server")
    first = server_for(store, server_leaf)
    second = server_for(store, pki.a)
    client = client_for(client_leaf)
    other = client_for(pki.b)
    try:
        first_at = f"127.0.0.1:{await first.start()}"
        second_at = f"127.0.0.1:{await second.start()}"
        assert await client.fetch(first_at, [digest(1)]) == {digest(1): b"one"}
        # The client rotates: its kept connection goes on, a new one presents the new certificate.
        fresh = issue(client_ca, "kvcached-b", LOCAL_SANS, dt.datetime.now(dt.UTC))
        os.replace(fresh.key, client_leaf.key)
        os.replace(fresh.cert, client_leaf.cert)
        assert await client.fetch(first_at, [digest(1)]) == {digest(1): b"one"}
        assert len(first._protocols) == 1
        assert await client.fetch(second_at, [digest(1)]) == {digest(1): b"one"}
        (on_second,) = second._protocols
        assert peer_serial(on_second._quic) == serial(client_leaf.cert) != serial(pki.b.cert)
        # The server rotates, key first: until its certificate lands, new connections get the old pair.
        fresh = issue(server_ca, "kvcached-a", LOCAL_SANS, dt.datetime.now(dt.UTC))
        old = serial(server_leaf.cert)
        os.replace(fresh.key, server_leaf.key)
        assert await other.fetch(first_at, [digest(1)]) == {digest(1): b"one"}
        assert peer_serial(other._links[first_at].protocol._quic) == old
        os.replace(fresh.cert, server_leaf.cert)
        await other.aclose()  # its next fetch dials again
        assert await other.fetch(first_at, [digest(1)]) == {digest(1): b"one"}
        assert peer_serial(other._links[first_at].protocol._quic) == serial(server_leaf.cert) != old
        # The client's connection opened before the server rotated is still served.
        assert await client.fetch(first_at, [digest(1)]) == {digest(1): b"one"}
        assert peer_serial(client._links[first_at].protocol._quic) == old
    finally:
        for c in (client, other):
            await c.aclose()
        for s in (first, second):
            await s.aclose()


async def test_an_unexpected_store_error_ends_the_stream_not_the_connection(pki: Pki) -> None:
    """A store read that raises something unexpected resets that response stream (ERR_INTERNAL): the
    client's fetch is a prompt miss, not a wait for its timeout, and the connection stays usable."""

    class Broken(DictStore):
        def get(self, d: bytes) -> bytes | None:
            if d == digest(2):
                raise Exception("IO error: Input/output error")  # as rocksdict raises
            return super().get(d)

    server = server_for(Broken({digest(1): b"x" * 1000}), pki.a)
    address = f"127.0.0.1:{await server.start()}"
    client = client_for(pki.b, timeout_s=5.0)
    try:
        started = time.monotonic()
        assert await client.fetch(address, [digest(2)]) == {}
        assert time.monotonic() - started < 2.0
        assert server.stats()["errors"] == 1
        assert await client.fetch(address, [digest(1)]) == {digest(1): b"x" * 1000}
        assert server.stats()["connections"] == 1
        assert client.stats()["unavailable"] == 0
    finally:
        await client.aclose()
        await server.aclose()


async def _until(probe: Callable[[], bool], timeout_s: float) -> bool:
    """Whether ``probe`` came true within ``timeout_s`` (polled: a condition on the server's state)."""
    deadline = time.monotonic() + timeout_s
    while not probe():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)  # poll interval of the condition, not a stand-in for it
    return True


def _serving(server: PeerServer) -> bool:
    return any(p._tasks for p in server._protocols)


def _frame(d: bytes, data: bytes) -> bytes:
    record = encode_record(d, data)
    return frame_header(d, len(record)) + record


async def test_unasked_and_duplicate_frames_are_dropped_as_they_arrive(pki: Pki) -> None:
    """Sans-IO on the client's stream state: a frame of a digest not asked for, or a second frame of one,
    is not kept even while the stream goes on; past one record per digest asked the stream is abandoned."""
    client = client_for(pki.b, max_block_bytes=4096)
    fetch = peers._Fetch(
        FrameReader(client.max_record_bytes, head_bytes=HEADER_BYTES),
        asyncio.get_running_loop().create_future(),
        0.0,
        frozenset({digest(1), digest(2)}),
        2 * (len(frame_header(digest(1), 0)) + client.max_record_bytes),
    )
    assert fetch.take(_frame(digest(1), b"a" * 1000))
    assert fetch.take(_frame(digest(1), b"a" * 1000) + _frame(digest(9), b"z" * 1000))
    assert [f.digest for f in fetch.frames] == [digest(1)] and fetch.unasked == 2
    assert fetch.take(_frame(digest(2), b"b" * 1000))
    assert [f.digest for f in fetch.frames] == [digest(1), digest(2)]
    while fetch.take(_frame(digest(2), b"b" * 1000)):  # a flood of duplicates: cut off at the budget
        assert len(fetch.frames) == 2
    assert fetch.received > fetch.max_bytes and len(fetch.frames) == 2
    # a chunk that crosses the budget still delivers the whole frames within it
    one = peers._Fetch(
        FrameReader(client.max_record_bytes, head_bytes=HEADER_BYTES),
        asyncio.get_running_loop().create_future(),
        0.0,
        frozenset({digest(1)}),
        len(_frame(digest(1), b"a" * 1000)) + 10,
    )
    assert not one.take(_frame(digest(1), b"a" * 1000) + _frame(digest(1), b"a" * 1000))
    assert [f.digest for f in one.frames] == [digest(1)]


async def test_a_flooding_peer_has_its_stream_abandoned(pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    """flood.py's shape: the server sends duplicate frames of the one digest asked for without end. The
    client keeps the first, abandons the stream at its byte budget (STOP_SENDING), and the server's
    response task is stopped long before it sent them all."""
    frames = 1000
    block = b"z" * 16_000

    async def flood(self: peers._ServerProtocol, sid: int, digests: list[bytes]) -> None:
        frame = _frame(digests[0], block)
        for _ in range(frames):
            await self._send(sid, frame)
        self._quic.send_stream_data(sid, b"", end_stream=True)
        self.transmit()

    monkeypatch.setattr(peers._ServerProtocol, "_respond", flood)
    server = server_for(DictStore(), pki.a)
    address = f"127.0.0.1:{await server.start()}"
    client = client_for(pki.b, timeout_s=5.0, max_block_bytes=16_000)
    try:
        assert await client.fetch(address, [digest(1)]) == {digest(1): block}
        assert await _until(lambda: not _serving(server), 5.0)  # our STOP_SENDING ended its task
        # what the server queued before STOP_SENDING arrived (HIGH_WATER_BYTES unacknowledged), not 16 MB
        assert server.stats()["served_bytes"] < peers.HIGH_WATER_BYTES + 2 * peers.CHUNK_BYTES
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_cancelled_fetch_stops_the_sender(pki: Pki) -> None:
    """cancel.py's shape: a fetch cancelled mid-response (another peer answered first) sends STOP_SENDING,
    so the server stops sending instead of pushing the whole block."""
    size = 16 << 20
    server = server_for(DictStore({digest(1): b"z" * size}), pki.a, egress_bytes_per_s=8e6)
    address = f"127.0.0.1:{await server.start()}"
    client = client_for(pki.b, timeout_s=5.0)
    try:
        task = asyncio.ensure_future(client.fetch(address, [digest(1)]))
        assert await _until(lambda: server.stats()["served_bytes"] >= 1 << 20, 5.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _until(lambda: not _serving(server), 1.0)  # the whole block would take ~2 s
        assert server.stats()["served_bytes"] < size // 2
        assert await client.fetch(address, []) == {}
    finally:
        await client.aclose()
        await server.aclose()


async def test_request_streams_get_a_small_window_and_out_of_order_data_past_a_request_is_refused(
    pki: Pki, served: tuple[PeerServer, DictStore, str]
) -> None:
    """aioquic zero-fills a stream's gap before out-of-order data: the server grants a request stream one
    largest request of window (not 16 MiB), and a stream whose data reaches past a largest request (the
    window grows as data arrives) is reset and stopped, without waiting for its gap to be filled."""
    server, store, address = served
    client = client_for(pki.b)
    try:
        link = await client._link(address, *split_address(address))
        quic = link.protocol._quic
        window = max_request_bytes()
        assert quic._remote_max_stream_data_bidi_remote == window
        sid = quic.get_next_available_stream_id()
        end = 2 * window - 10  # past a largest request, within the window once it has doubled
        quic.send_stream_data(sid, bytes(end))
        sender = quic._streams[sid].sender
        sender._pending.subtract(0, window - 100)  # send only 100 bytes below the window, then the tail
        sender._pending.subtract(window, end - 100)
        link.protocol.transmit()
        assert await _until(lambda: server.stats()["bad_requests"] == 1, 5.0)
        assert await client.fetch(address, [digest(1)]) == {digest(1): store.blocks[digest(1)]}
        assert server.stats()["bad_requests"] == 1 and server.stats()["connections"] == 1
    finally:
        await client.aclose()


@pytest.mark.parametrize("name", WRONG)
async def test_server_cert_of_another_role_is_refused(pki: Pki, name: str) -> None:
    """A server whose certificate chains to the CA and matches the address but names another role is not
    asked for anything: the client closes the connection before its first request."""
    server = server_for(DictStore({digest(1): b"x"}), pki.wrong[name])
    port = await server.start()
    client = client_for(pki.b)
    try:
        with pytest.raises(PeerUnavailable, match="kvcached role"):
            await client.fetch(f"127.0.0.1:{port}", [digest(1)])
        assert server.stats()["requests"] == 0 and server.stats()["served_blocks"] == 0
        assert client.stats()["unavailable"] == 1
    finally:
        await client.aclose()
        await server.aclose()


def _largest_stream_buffer(server: PeerServer) -> int:
    """The largest receive buffer any of the server's streams holds (aioquic zero-fills gaps)."""
    return max(
        (len(s.receiver._buffer) for p in server._protocols for s in p._quic._streams.values()), default=0
    )


async def test_a_client_may_not_open_unidirectional_streams(
    pki: Pki, served: tuple[PeerServer, DictStore, str]
) -> None:
    """The protocol uses client bidirectional streams only. A unidirectional stream would get aioquic's
    default window (16 MiB, growing as data arrives) and, sent out of order, a zero-filled buffer of that
    size on the server: the server grants none, and a client that opens one anyway loses its connection
    before the server holds more than a largest request for it."""
    server, _store, address = served
    client = client_for(pki.b)
    try:
        link = await client._link(address, *split_address(address))
        quic = link.protocol._quic
        assert quic._remote_max_streams_uni == 0
        quic._remote_max_streams_uni = 8  # a hostile client ignores the limit
        sid = quic.get_next_available_stream_id(is_unidirectional=True)
        end = 16 << 20
        quic.send_stream_data(sid, bytes(end))
        quic._streams[sid].sender._pending.subtract(0, end - 100)  # only the tail: a 16 MiB gap
        link.protocol.transmit()
        assert await _until(lambda: server.stats()["connections"] == 0, 5.0)
        assert _largest_stream_buffer(server) <= max_request_bytes()
    finally:
        await client.aclose()


def _hold_open_with(push: Callable[[peers._ServerProtocol, int], None]) -> Callable[..., object]:
    """A server ``_respond`` that does ``push(protocol, sid)`` and then never ends the response."""

    async def respond(self: peers._ServerProtocol, sid: int, digests: list[bytes]) -> None:
        push(self, sid)
        self.transmit()
        await asyncio.Event().wait()

    return respond


def _send_tail(quic: object, sid: int, end: int) -> None:
    """Queue ``end`` bytes on ``sid`` but send only the last 100 (a gap of ``end - 100`` bytes)."""
    quic.send_stream_data(sid, bytes(end))  # type: ignore[attr-defined]
    quic._streams[sid].sender._pending.subtract(0, end - 100)  # type: ignore[attr-defined]


def _largest_client_buffer(client: PeerClient) -> int:
    return max(
        (
            len(s.receiver._buffer)
            for link in client._links.values()
            for s in link.protocol._quic._streams.values()
        ),
        default=0,
    )


async def test_out_of_order_response_data_past_the_budget_abandons_the_stream(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aioquic zero-fills a gap before out-of-order data, and a response stream's window is 16 MiB (and
    grows): a peer that sends only bytes past one largest record per digest asked has the stream
    abandoned at once (not after a stall), and the client does not keep the zero-filled buffer."""
    end = 16 << 20
    monkeypatch.setattr(
        peers._ServerProtocol, "_respond", _hold_open_with(lambda p, sid: _send_tail(p._quic, sid, end))
    )
    server = server_for(DictStore(), pki.a)
    address = f"127.0.0.1:{await server.start()}"
    client = client_for(pki.b, timeout_s=5.0, max_block_bytes=4096)
    try:
        started = time.monotonic()
        assert await client.fetch(address, [digest(1)]) == {}
        assert time.monotonic() - started < 2.0 and client.stats()["unavailable"] == 0
        assert _largest_client_buffer(client) <= 2 * client.max_record_bytes
    finally:
        await client.aclose()
        await server.aclose()


def _open_server_stream(p: peers._ServerProtocol, unidirectional: bool) -> None:
    quic = p._quic
    if unidirectional:  # a hostile server ignores the limits the client granted
        quic._remote_max_streams_uni = max(quic._remote_max_streams_uni, 8)
    else:
        quic._remote_max_streams_bidi = max(quic._remote_max_streams_bidi, 8)
    _send_tail(quic, quic.get_next_available_stream_id(is_unidirectional=unidirectional), 16 << 20)


@pytest.mark.parametrize("unidirectional", [False, True])
async def test_a_server_may_not_open_streams(
    pki: Pki, monkeypatch: pytest.MonkeyPatch, unidirectional: bool
) -> None:
    """The client never serves a stream: it grants the server none (aioquic's default, 128 of each kind
    with a 16 MiB window, would let a peer make it zero-fill gigabytes), and a server that opens one
    anyway loses the connection: the fetch is a prompt miss and the client holds no such buffer."""
    monkeypatch.setattr(
        peers._ServerProtocol,
        "_respond",
        _hold_open_with(lambda p, sid: _open_server_stream(p, unidirectional)),
    )
    server = server_for(DictStore(), pki.a)
    address = f"127.0.0.1:{await server.start()}"
    client = client_for(pki.b, timeout_s=5.0)
    try:
        link = await client._link(address, *split_address(address))
        assert await _until(lambda: len(server._protocols) == 1, 5.0)
        (served,) = server._protocols
        assert served._quic._remote_max_streams_bidi == 0 and served._quic._remote_max_streams_uni == 0
        started = time.monotonic()
        with pytest.raises(PeerUnavailable):
            await client.fetch(address, [digest(1)])
        assert time.monotonic() - started < 2.0
        assert (
            max((len(s.receiver._buffer) for s in link.protocol._quic._streams.values()), default=0) < 1 << 20
        )
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_peer_address_that_cannot_be_dialed_is_unavailable_not_an_error(
    pki: Pki, served: tuple[PeerServer, DictStore, str]
) -> None:
    """``[]:80`` passes the etcd record's host:port check but names no host: fetching from it is a miss
    (PeerUnavailable, counted), so a Get still takes the block from the other peers instead of failing."""
    from contracts.kvcached import GetRequest
    from kvcached.service import KvcachedService

    _server, store, address = served
    client = client_for(pki.b)
    local = TieredStore(1 << 20, None, 0)
    try:
        with pytest.raises(PeerUnavailable, match="bad peer address"):
            await client.fetch("[]:80", [digest(1)])
        assert client.stats()["unavailable"] == 1
        service = KvcachedService(local, peer_client=client, peers=lambda: ["[]:80", address])
        reply = await service.get(GetRequest(digest(1)))
        assert (reply.data, reply.source) == (store.blocks[digest(1)], "peer")
    finally:
        await client.aclose()
        local.close()


async def test_links_whose_connection_closed_are_released(pki: Pki) -> None:
    """Peers come and go (etcd): a kept connection that closed (its peer stopped, or it idled out) while
    nobody fetched from that address again is released, socket included, by the next dial, so addresses
    that churn do not pile up open UDP sockets."""
    gone = server_for(DictStore({digest(1): b"x"}), pki.a)
    gone_address = f"127.0.0.1:{await gone.start()}"
    other = server_for(DictStore({digest(1): b"y"}), pki.a)
    other_address = f"127.0.0.1:{await other.start()}"
    client = client_for(pki.b)
    try:
        assert await client.fetch(gone_address, [digest(1)]) == {digest(1): b"x"}
        link = client._links[gone_address]
        await gone.aclose()  # closes its connections (CONNECTION_CLOSE)
        assert await _until(lambda: link.protocol.is_closed, 5.0)
        assert await client.fetch(other_address, [digest(1)]) == {digest(1): b"y"}
        assert list(client._links) == [other_address] and list(client._dialing) == [other_address]
        assert link.transport.is_closing()
    finally:
        await client.aclose()
        await other.aclose()


async def test_a_cancelled_fetch_drops_what_its_stream_still_receives(pki: Pki) -> None:
    """After a cancelled fetch's STOP_SENDING, the stream may still receive data (in flight, or a peer
    that ignores it, out of order): nothing waits for it, so the client's side of the stream is finished
    and its buffer freed at once, and later data for it is dropped unread instead of zero-filled."""
    size = 16 << 20
    server = server_for(DictStore({digest(1): b"z" * size}), pki.a, egress_bytes_per_s=8e6)
    address = f"127.0.0.1:{await server.start()}"
    client = client_for(pki.b, timeout_s=5.0)
    try:
        task = asyncio.ensure_future(client.fetch(address, [digest(1)]))
        assert await _until(lambda: server.stats()["served_bytes"] >= 1 << 20, 5.0)
        quic = client._links[address].protocol._quic
        (sid,) = [s for s in quic._streams if s % 4 == 0]
        receiver = quic._streams[sid].receiver
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert receiver.is_finished and not receiver._buffer
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_response_whose_client_stops_acknowledging_is_ended(pki: Pki) -> None:
    """A client that keeps its connection alive (PINGs) but acknowledges nothing more would hold a
    response task, its block and 4 MiB of queued data forever: past ``stall_timeout_s`` without the
    unacknowledged bytes going down, the server resets the stream and the task ends."""
    server = server_for(DictStore({digest(1): b"z" * (16 << 20)}), pki.a, stall_timeout_s=0.5)
    address = f"127.0.0.1:{await server.start()}"
    client = client_for(pki.b, timeout_s=30.0)
    try:
        link = await client._link(address, *split_address(address))
        task = asyncio.ensure_future(client.fetch(address, [digest(1)]))
        assert await _until(lambda: server.stats()["served_bytes"] > peers.HIGH_WATER_BYTES, 5.0)
        link.transport.pause_reading()  # hears nothing more, so acknowledges nothing more

        async def keep_alive() -> None:
            for uid in range(1000):
                link.protocol._quic.send_ping(uid)
                link.protocol.transmit()
                await asyncio.sleep(0.05)  # the PING cadence, not a readiness wait

        pinging = asyncio.ensure_future(keep_alive())
        try:
            assert await _until(lambda: not _serving(server), 5.0)
            (served,) = server._protocols  # the reset stream keeps none of its queued data
            assert all(not s.sender._buffer for s in served._quic._streams.values())
        finally:
            pinging.cancel()
            task.cancel()
            await asyncio.gather(pinging, task, return_exceptions=True)
    finally:
        await client.aclose()
        await server.aclose()


# -- the server-wide buffer budget ---------------------------------------------------------------------


def _queued(server: PeerServer) -> int:
    """Response bytes the server holds queued (sent or not, unacknowledged), all connections together."""
    return sum(len(s.sender._buffer) for p in server._protocols for s in p._quic._streams.values())


async def test_many_connections_and_streams_stay_within_the_servers_buffer_budget(pki: Pki) -> None:
    """Per-stream bounds do not bound their sum: 4 clients that stop acknowledging, 2 streams each, of a
    1 MiB block made the server hold 8 MiB (and N clients N times that). With a 4 MiB budget it holds at
    most 4 MiB; the streams past it are reset (``ERR_BUSY``: a prompt miss for their clients), and every
    charge is given back when the connections are lost."""
    block, blocks = 1 << 20, [digest(1), digest(2)]
    store = DictStore({d: os.urandom(block) for d in blocks})
    budget = 4 << 20
    server = server_for(store, pki.a, buffer_bytes=budget, stall_timeout_s=30.0)
    address = f"127.0.0.1:{await server.start()}"
    clients = [client_for(pki.b, timeout_s=30.0) for _ in range(4)]
    fetches: list[asyncio.Future[dict[bytes, bytes]]] = []
    try:
        for client in clients:
            link = await client._link(address, *split_address(address))
            link.transport.pause_reading()  # a client that reads (and acknowledges) nothing more
            fetches += [asyncio.ensure_future(client.fetch(address, [d])) for d in blocks]
        assert await _until(lambda: server.stats()["requests"] + server.stats()["busy"] >= 8, 5.0)
        assert await _until(lambda: _queued(server) >= block, 5.0)
        assert server.stats()["busy"] >= 4  # a response holds its 1 MiB (and its request) until acknowledged
        assert _queued(server) <= budget
        assert server.budget.peak_bytes <= budget
        assert server.stats()["buffer_bytes"] == server.budget.held_bytes > 0
        for client in clients:
            await client.aclose()  # the connections are lost: every charge is given back
        assert await _until(lambda: server.budget.held_bytes == 0 and not _serving(server), 5.0)
        fresh = client_for(pki.b)
        try:
            assert await fresh.fetch(address, blocks) == {d: store.blocks[d] for d in blocks}
            assert await _until(lambda: server.budget.held_bytes == 0, 5.0)  # acknowledged: released
        finally:
            await fresh.aclose()
    finally:
        for task in fetches:
            task.cancel()
        await asyncio.gather(*fetches, return_exceptions=True)
        for client in clients:
            await client.aclose()
        await server.aclose()


async def test_a_block_over_the_budget_is_a_prompt_miss_and_nothing_stays_charged(pki: Pki) -> None:
    """A response whose next frame does not fit the budget is reset with ``ERR_BUSY`` after the frames that
    did: the client keeps those, misses the rest at once and keeps its connection; nothing stays charged."""
    store = DictStore({digest(1): os.urandom(1000), digest(2): os.urandom(2 << 20)})
    server = server_for(store, pki.a, buffer_bytes=1 << 20)
    address = f"127.0.0.1:{await server.start()}"
    client = client_for(pki.b, timeout_s=5.0)
    try:
        started = time.monotonic()
        got = await client.fetch(address, [digest(1), digest(2)])
        assert got == {digest(1): store.blocks[digest(1)]}
        assert time.monotonic() - started < 2.0  # a reset, not a timeout
        stats = server.stats()
        assert stats["busy"] == 1 and stats["errors"] == 0 and stats["connections"] == 1
        assert await _until(lambda: server.budget.held_bytes == 0, 5.0)
        assert await client.fetch(address, [digest(1)]) == {digest(1): store.blocks[digest(1)]}
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_request_stream_over_the_budget_is_refused_and_its_charge_given_back(pki: Pki) -> None:
    """Each request stream is charged from its first byte: with room for one, a second (on another
    connection) is refused with ``ERR_BUSY`` (a miss), and once the first is reset by its client the
    budget is whole again."""
    store = DictStore({digest(1): b"x" * 100})
    server = server_for(store, pki.a, buffer_bytes=peers.REQUEST_CHARGE_BYTES + 4096)
    address = f"127.0.0.1:{await server.start()}"
    holder, other = client_for(pki.b), client_for(pki.b)
    try:
        link = await holder._link(address, *split_address(address))
        quic = link.protocol._quic
        sid = quic.get_next_available_stream_id()
        quic.send_stream_data(sid, encode_request([digest(1)])[:10])  # a request that never ends
        link.protocol.transmit()
        assert await _until(lambda: server.budget.held_bytes == peers.REQUEST_CHARGE_BYTES, 5.0)
        assert await other.fetch(address, [digest(1)]) == {}
        assert server.stats()["busy"] == 1 and server.stats()["bad_requests"] == 0
        quic.reset_stream(sid, peers.ERR_CANCELLED)
        link.protocol.transmit()
        assert await _until(lambda: server.budget.held_bytes == 0, 5.0)
        assert await other.fetch(address, [digest(1)]) == {digest(1): b"x" * 100}
    finally:
        await holder.aclose()
        await other.aclose()
        await server.aclose()


async def test_a_cancelled_fetch_gives_its_charges_back(pki: Pki) -> None:
    server = server_for(DictStore({digest(1): b"z" * (16 << 20)}), pki.a, egress_bytes_per_s=8e6)
    address = f"127.0.0.1:{await server.start()}"
    client = client_for(pki.b, timeout_s=5.0)
    try:
        task = asyncio.ensure_future(client.fetch(address, [digest(1)]))
        assert await _until(lambda: server.budget.held_bytes > 16 << 20, 5.0)  # the record and its queue
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await _until(lambda: server.budget.held_bytes == 0 and not _serving(server), 2.0)
        assert _queued(server) == 0  # the stopped stream keeps none of its queued data
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_request_stream_with_only_out_of_order_data_is_charged(pki: Pki) -> None:
    """Out-of-order data raises no event, but aioquic zero-fills the gap before it: the stream is charged
    from that first byte too, so such streams cannot pile up outside the budget."""
    room = peers.REQUEST_CHARGE_BYTES + 4096  # one request and a small response
    server = server_for(DictStore({digest(1): b"x" * 100}), pki.a, buffer_bytes=room)
    address = f"127.0.0.1:{await server.start()}"
    holder, other = client_for(pki.b), client_for(pki.b)
    try:
        link = await holder._link(address, *split_address(address))
        sid = link.protocol._quic.get_next_available_stream_id()
        _send_tail(link.protocol._quic, sid, 1000)  # bytes 900..1000 only: a 900-byte gap, no event
        link.protocol.transmit()
        assert await _until(lambda: server.budget.held_bytes == peers.REQUEST_CHARGE_BYTES, 5.0)
        assert await other.fetch(address, [digest(1)]) == {}
        assert server.stats()["busy"] == 1
        await holder.aclose()  # the connection is lost: its stream's charge is given back
        assert await _until(lambda: server.budget.held_bytes == 0, 5.0)
        assert await other.fetch(address, [digest(1)]) == {digest(1): b"x" * 100}
    finally:
        await holder.aclose()
        await other.aclose()
        await server.aclose()


async def test_a_request_stopped_by_its_client_before_it_ends_gives_its_charge_back(pki: Pki) -> None:
    """STOP_SENDING on a request still arriving: the server drops it and reads no more of it, so what the
    client still sends on it is not charged again."""
    server = server_for(DictStore({}), pki.a)
    address = f"127.0.0.1:{await server.start()}"
    client = client_for(pki.b)
    try:
        link = await client._link(address, *split_address(address))
        quic = link.protocol._quic
        sid = quic.get_next_available_stream_id()
        quic.send_stream_data(sid, encode_request([digest(1)])[:10])
        link.protocol.transmit()
        assert await _until(lambda: server.budget.held_bytes == peers.REQUEST_CHARGE_BYTES, 5.0)
        quic.stop_stream(sid, peers.ERR_CANCELLED)
        link.protocol.transmit()
        assert await _until(lambda: server.budget.held_bytes == 0, 5.0)
        quic.send_stream_data(sid, encode_request([digest(1)])[10:20])  # more of the request it stopped
        link.protocol.transmit()
        assert await client.fetch(address, [digest(2)]) == {}  # a round trip: the bytes above arrived
        assert server.budget.held_bytes == 0
    finally:
        await client.aclose()
        await server.aclose()
