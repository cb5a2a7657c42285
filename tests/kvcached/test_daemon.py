"""Two real kvcached daemons (``python -m kvcached.main``) on loopback with mTLS and a real etcd.

The daemons are started once for the module; the tests run in file order and the last one kills
daemon A (peer down -> timely miss, then its registration expires with its lease).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import etcd3aio
import grpc
import orjson
import pytest

from certs.store import LeafFiles, dev_bundle
from contracts.errors import ConfigError
from contracts.etcd import Change, EtcdSettings, PeerInfo, decode_peer, encode_peer, peer_key
from contracts.events import (
    SUBSCRIBE_METHOD,
    Batch,
    EndpointId,
    Removed,
    Stored,
    Subscribe,
    decode_batch,
    encode,
)
from extproc.config import parse_config
from extproc.index.hybrid import HybridIndex
from extproc.routing.request import Kind, parse_body
from extproc.server import Gateway
from kvcached.block import checksum
from kvcached.config import KvcachedConfig, QuicSettings, StaticPeer, TlsFiles
from kvcached.discovery import PeerTable
from kvcached.errors import BadRequest, KvcachedError
from kvcached.main import Daemon
from kvcached.peers import buffer_bytes_default
from kvgate.dev.etcd import EtcdServer
from kvgate.dev.procs import Child, http_get
from runtime.etcd import connect
from runtime.kvcached import KvcachedClient

pytest_plugins = ("tests.etcd_fixtures",)

RAM_BYTES = 4096  # four 1 KiB blocks: the fifth put demotes the oldest to the SSD


def digest(i: int) -> bytes:
    return blake3.blake3(b"daemon" + i.to_bytes(8, "little")).digest(16)


@dataclass
class Node:
    name: str
    child: Child
    status: dict[str, Any]
    sock: Path
    leaf: LeafFiles


@dataclass
class Pair:
    a: Node
    b: Node
    client_leaf: LeafFiles
    settings: EtcdSettings
    gateway_leaf: LeafFiles  # an ext_proc's identity: the only role that may subscribe to feeds


def _config(tmp: Path, name: str, leaf: LeafFiles, etcd: EtcdServer, prefix: str) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(
        f"""
[kvcached]
node = "{name}"
listen_unix = "{tmp / f"{name}.sock"}"
listen_tcp = "127.0.0.1:0"
feed_listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"
ram_bytes = {RAM_BYTES}
ssd_path = "{tmp / f"{name}-ssd"}"
ssd_bytes = 1048576
lease_ttl_s = 2
[kvcached.tls]
cert = "{leaf.cert}"
key = "{leaf.key}"
ca = "{leaf.ca}"
[quic]
listen = "127.0.0.1:0"
timeout_s = 1.0
[etcd]
endpoints = ["{etcd.address}"]
prefix = "{prefix}"
"""
    )
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, etcd_server: EtcdServer) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("kvd")
    names = ["kvcached-a", "kvcached-b", "agent-test", "extproc"]
    leaves = dev_bundle(tmp / "certs", names, dt.datetime.now(dt.UTC))
    prefix = f"/kvgate-test/{uuid.uuid4().hex[:12]}/"
    children: list[Child] = []
    try:
        started = []
        for name in ("a", "b"):
            config = _config(tmp, name, leaves[f"kvcached-{name}"], etcd_server, prefix)
            ready = tmp / f"{name}.ready.json"
            argv = [
                sys.executable,
                "-m",
                "kvcached.main",
                "--config",
                str(config),
                "--ready-file",
                str(ready),
            ]
            child = Child(f"kvcached-{name}", argv, tmp / f"{name}.log")
            children.append(child)
            started.append((name, child, ready))
        nodes = [
            Node(
                name,
                child,
                child.wait_for_json_file(ready, 60),
                tmp / f"{name}.sock",
                leaves[f"kvcached-{name}"],
            )
            for name, child, ready in started
        ]
        settings = EtcdSettings(endpoints=(etcd_server.address,), prefix=prefix)
        yield Pair(nodes[0], nodes[1], leaves["agent-test"], settings, leaves["extproc"])
    finally:
        for child in children:
            child.stop()


@pytest.fixture
async def etcd(pair: Pair) -> AsyncIterator[etcd3aio.Etcd3Client]:
    client = await connect(pair.settings)
    yield client
    await client.close()


@pytest.fixture
async def clients(pair: Pair) -> AsyncIterator[tuple[KvcachedClient, KvcachedClient]]:
    a = KvcachedClient(f"unix:{pair.a.sock}", timeout_s=10.0)
    b = KvcachedClient(f"unix:{pair.b.sock}", timeout_s=10.0)
    yield a, b
    await a.aclose()
    await b.aclose()


async def _wait(probe: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s} s")
        await asyncio.sleep(0.05)  # poll interval of the condition, not a stand-in for it


def test_peer_table_merges_static_and_etcd_and_keeps_last_good() -> None:
    table = PeerTable("/p/", "a", [StaticPeer("s", "10.0.0.9:4433"), StaticPeer("a", "127.0.0.1:1")])
    good = encode_peer(PeerInfo("b", None, "127.0.0.1:5000", "127.0.0.1:5001"))
    table.snapshot(
        [("/p/kvcached/b", good), ("/p/kvcached/a", encode_peer(PeerInfo("a", None, "x:1", None)))], 3
    )
    assert table.quic_addresses() == ["127.0.0.1:5000", "10.0.0.9:4433"]  # self excluded, sorted by node
    table.apply(
        [Change("/p/kvcached/b", b'{"node": "b", "quic": "nope"}'), Change("/p/endpoints/e", b"{}")], 4
    )
    assert table.rejected == 1 and table.peers["b"].quic == "127.0.0.1:5000"  # last good value kept
    table.apply([Change("/p/kvcached/b", None)], 5)
    assert table.quic_addresses() == ["10.0.0.9:4433"] and table.revision == 5
    with pytest.raises(ConfigError, match="does not match the key"):
        decode_peer("c", good)


async def test_peer_discovery_notices_an_etcd_outage(
    tmp_path: Path, etcd_outage_server: EtcdServer, etcd_prefix: str
) -> None:
    """The peer watch (runtime.watch.PrefixWatcher) probes etcd beside its watch: an etcd that stops is
    noticed (the watch stream alone retries silently) and the known peers stay; an etcd that comes back
    rebuilt (wiped) is resynced from, and followed again."""
    server = etcd_outage_server
    settings = EtcdSettings(endpoints=(server.address,), prefix=etcd_prefix, timeout_s=1.0)
    client = await connect(settings)
    assert client.kv is not None
    await client.kv.put(peer_key(etcd_prefix, "b"), encode_peer(PeerInfo("b", None, "127.0.0.1:5000", None)))
    await client.close()
    etcd_raw = {"endpoints": [server.address], "prefix": etcd_prefix, "timeout_s": 0.5}
    daemon = Daemon(KvcachedConfig("a", RAM_BYTES, listen_unix=str(tmp_path / "a.sock"), etcd_raw=etcd_raw))
    await daemon.start()
    try:
        watcher = daemon.watcher
        assert watcher is not None and await watcher.wait_synced(10.0)
        assert daemon.table.quic_addresses() == ["127.0.0.1:5000"]

        async def disconnected() -> bool:
            return watcher is not None and not watcher.connected

        server.stop()
        await _wait(disconnected, 10, "disconnected")
        assert watcher.counters["outages"] == 1
        assert daemon.table.quic_addresses() == ["127.0.0.1:5000"]  # the known peers stay

        server.wipe()  # etcd comes back as a new cluster: kvcached/b is gone
        server.start()

        async def resynced() -> bool:
            return watcher is not None and watcher.connected and not daemon.table.peers

        await _wait(resynced, 10, "resynced with the rebuilt etcd")
        assert watcher.counters["syncs"] >= 2
        client = await connect(settings)
        try:
            assert client.kv is not None
            c = PeerInfo("c", None, "127.0.0.1:5002", None)
            await client.kv.put(peer_key(etcd_prefix, "c"), encode_peer(c))
        finally:
            await client.close()

        async def followed() -> bool:
            return daemon.table.quic_addresses() == ["127.0.0.1:5002"]

        await _wait(followed, 10, "following the rebuilt etcd")
        assert watcher.counters["outages"] == 1
    finally:
        await daemon.aclose()


async def test_registration_appears_in_etcd(pair: Pair, etcd: etcd3aio.Etcd3Client) -> None:
    assert etcd.kv is not None
    for node in (pair.a, pair.b):
        resp = await etcd.kv.get(peer_key(pair.settings.prefix, node.name))
        assert resp.kvs, f"kvcached/{node.name} not registered"
        info = decode_peer(node.name, bytes(resp.kvs[0].value))
        assert (info.grpc, info.quic, info.feed) == (
            node.status["grpc"],
            node.status["quic"],
            node.status["feed"],
        )
        assert node.status["registered"] is True and info.quic is not None


async def test_the_digest_version_travels_in_the_record_and_the_stats(
    pair: Pair,
    etcd: etcd3aio.Etcd3Client,
    clients: tuple[KvcachedClient, KvcachedClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real daemon says which digest version keys its blocks: in its etcd record (a gateway of that
    version follows its feed, one a version apart does not and counts the skew; a peer a version apart
    is not asked for blocks) and in its Stats (an agent's store of another version refuses it). Its
    record's schema version is read by the same rule: a record from before the fields is followed, one
    of the next schema is read leniently and neither followed nor asked (a skew, not a rejection)."""
    from contracts.kvcached import KvcachedError as ClientError
    from contracts.versions import DIGEST_VERSION, KVCACHED_RECORD_VERSION
    from extproc.control.plane import ControlCore
    from extproc.control.policy import PolicyStore
    from extproc.fleet import Fleet
    from runtime.kvcached import DigestCheckedStore

    assert etcd.kv is not None
    p = pair.settings.prefix
    resp = await etcd.kv.get(peer_key(p, pair.a.name))
    raw = bytes(resp.kvs[0].value)
    assert json.loads(raw)["digest"] == DIGEST_VERSION == decode_peer(pair.a.name, raw).digest
    assert json.loads(raw)["schema"] == KVCACHED_RECORD_VERSION == decode_peer(pair.a.name, raw).schema
    ahead = json.dumps(json.loads(raw) | {"node": "c", "digest": DIGEST_VERSION + 1}).encode()
    legacy = {k: v for k, v in json.loads(raw).items() if k not in ("digest", "schema")} | {"node": "d"}
    assert decode_peer("d", json.dumps(legacy).encode()).digest == 1  # a record from before the fields
    # A daemon of the next record schema, with a field this version does not know: read, not used.
    newer = json.loads(raw) | {"node": "e", "schema": KVCACHED_RECORD_VERSION + 1, "tiers": ["ram"]}
    schema_ahead = json.dumps(newer).encode()

    core = ControlCore(p, Fleet([]), PolicyStore())
    changes = [(pair.a.name, raw), ("c", ahead), ("d", json.dumps(legacy).encode()), ("e", schema_ahead)]
    core.apply([Change(peer_key(p, node), value) for node, value in changes], 1)
    assert set(core.kvcached_feeds) == {pair.a.name, "d"} and core.counters["version_skew"] == 2
    assert core.skewed == {("kvcached", "c"), ("kvcached", "e")} and core.counters["rejected"] == 0
    core.apply([Change(peer_key(p, "c"), None), Change(peer_key(p, "e"), None)], 2)  # leases ended
    assert core.skewed == set()  # the alarm's gauge drops
    table = PeerTable(p, pair.b.name)
    table.snapshot([(peer_key(p, node), value) for node, value in changes], 1)
    assert set(table.peers) == {pair.a.name, "d"} and table.skewed == {"c", "e"} and table.rejected == 0

    a, _ = clients
    assert (await a.stats_reply()).digest == DIGEST_VERSION
    store = DigestCheckedStore(a)
    await store.put(digest(9001), b"slot")
    assert await store.get(digest(9001)) == b"slot" and not store.skewed
    # An agent of the next digest version: every block operation refused, nothing read.
    monkeypatch.setattr("runtime.kvcached.digest_matches", lambda v: v == DIGEST_VERSION + 1)
    newer = DigestCheckedStore(a)
    with pytest.raises(ClientError, match="digest version"):
        await newer.get(digest(9001))
    with pytest.raises(ClientError, match="digest version"):
        await newer.contains([digest(9001)])
    assert newer.skewed and newer.daemon_digest == DIGEST_VERSION


async def test_feed_reports_stored_ram_and_demotion(pair: Pair, clients: tuple[KvcachedClient, ...]) -> None:
    a, _ = clients
    leaf = pair.gateway_leaf
    creds = grpc.ssl_channel_credentials(leaf.ca.read_bytes(), leaf.key.read_bytes(), leaf.cert.read_bytes())
    seen: list[Batch] = []
    async with grpc.aio.secure_channel(pair.a.status["feed"], creds) as channel:
        call = channel.unary_stream(
            SUBSCRIBE_METHOD, request_serializer=encode, response_deserializer=decode_batch
        )
        stream = call(Subscribe("test"))
        first = await asyncio.wait_for(stream.read(), 10)
        assert isinstance(first, Batch) and first.snapshot and first.source == "kvcached-a"
        for i in range(5):
            await a.put(digest(i), bytes([i]) * 1024)

        def events() -> list[Any]:
            return [e for b in seen for e in b.events]

        async with asyncio.timeout(10):
            while not (
                any(isinstance(e, Removed) and digest(0) in e.digests for e in events())
                and any(
                    isinstance(e, Stored) and e.tier == "ram" and digest(4) in e.digests for e in events()
                )
            ):
                batch = await stream.read()
                assert isinstance(batch, Batch)
                seen.append(batch)
        stream.cancel()
    stored_ram = [e for e in events() if isinstance(e, Stored) and e.tier == "ram"]
    assert {d for e in stored_ram for d in e.digests} == {digest(i) for i in range(5)}
    assert all(e.endpoint == "kvcached:a" for e in events())
    removed = next(e for e in events() if isinstance(e, Removed) and digest(0) in e.digests)
    assert removed.tier == "ram"
    assert any(isinstance(e, Stored) and e.tier == "ssd" and digest(0) in e.digests for e in events())


async def test_bad_input_over_tcp_mtls_and_no_client_cert_refused(
    pair: Pair, clients: tuple[KvcachedClient, ...]
) -> None:
    leaf = pair.client_leaf
    target = pair.a.status["grpc"]
    tcp = KvcachedClient(target, ca=leaf.ca, cert=leaf.cert, key=leaf.key, timeout_s=5.0)
    anonymous = KvcachedClient(target, ca=leaf.ca, timeout_s=3.0)
    try:
        with pytest.raises(BadRequest, match="checksum"):
            await tcp.put(digest(50), b"payload", checksum(b"other"))
        with pytest.raises(BadRequest, match="16"):
            await tcp.put(b"\x01" * 8, b"payload")
        assert await tcp.contains([digest(50)]) == [False]
        assert await clients[0].contains([digest(50)]) == [False]
        with pytest.raises(KvcachedError, match="UNAVAILABLE"):
            await anonymous.stats()
    finally:
        await tcp.aclose()
        await anonymous.aclose()


async def test_gateway_prefers_the_node_whose_kvcached_holds_the_prefix(
    pair: Pair, clients: tuple[KvcachedClient, KvcachedClient]
) -> None:
    """A gateway following etcd subscribes to both daemons' feeds (mTLS); blocks of a prompt put into
    b's kvcached make the endpoint on node b the pick (a local fetch beats a peer fetch), with no GPU
    prefix anywhere."""
    leaf = pair.gateway_leaf
    config = parse_config(
        {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            "models": [{"name": "smol", "gguf": "smollm2"}],
            "endpoints": [
                {"id": f"e-{n}", "address": f"127.0.0.{i + 1}:9", "models": ["smol"], "node": n}
                for i, n in enumerate(("a", "b"))
            ],
            "etcd": {"endpoints": list(pair.settings.endpoints), "prefix": pair.settings.prefix},
            "feeds": {"tls_ca": str(leaf.ca), "tls_cert": str(leaf.cert), "tls_key": str(leaf.key)},
        }
    )
    gateway = Gateway(config)
    await gateway.start()
    try:
        body = {"model": "smol", "messages": [{"role": "user", "content": "warm tiers " * 60}]}
        request = parse_body(Kind.CHAT, orjson.dumps(body))
        chain = gateway.router.digests(request, gateway.router.tokens(request, exact_count=True))
        assert len(chain) >= 4
        for d in chain:
            await clients[1].put(d, b"kv" * 64)

        async def picked() -> str | None:
            decision = gateway.router.decide(request, request_id="t", now=time.monotonic())
            gateway.router.finish(decision)
            return decision.endpoints[0].id if decision.endpoints[0].id == "e-b" else None

        index = gateway.index
        assert isinstance(index, HybridIndex)
        stores = [EndpointId("kvcached:b"), EndpointId("kvcached:a")]

        async def indexed() -> bool:
            return index.node_leads(stores, chain) == {"kvcached:b": len(chain)}

        await _wait(indexed, 5.0, "the whole chain indexed as held by b's kvcached")
        await _wait(picked, 5.0, "e-b picked for the prefix b's kvcached holds")
        assert gateway.router.node_stores == frozenset({"a", "b"})
        picks = [gateway.router.decide(request, request_id="u", now=time.monotonic()) for _ in range(5)]
        assert {d.endpoints[0].id for d in picks} == {"e-b"}
    finally:
        await gateway.aclose(grace_s=0.1)


async def test_block_put_on_a_is_fetched_by_b_over_quic(
    pair: Pair, clients: tuple[KvcachedClient, ...]
) -> None:
    a, b = clients
    data = os.urandom(2048)  # fits the RAM tier
    await a.put(digest(100), data)
    assert await b.get(digest(100), peers=False) is None

    async def fetched() -> Any:
        reply = await b.lookup(digest(100))
        return reply if reply.data is not None else None

    reply = await _wait(fetched, 15, "fetched from the peer")  # B finds A through etcd
    assert reply.data == data and reply.source == "peer"
    assert (await b.lookup(digest(100))).source == "ram"  # kept locally
    stats = await b.stats()
    assert stats["peer_hits"] >= 1 and stats["peer_bytes"] >= len(data)
    got = http_get(f"http://127.0.0.1:{pair.b.status['metrics_port']}/metrics")
    assert got is not None and got[0] == 200
    assert b"kvcached_peer_fetch_bytes_total" in got[1] and b'kvcached_tier_blocks{tier="ram"}' in got[1]


async def test_peer_down_is_a_timely_miss(
    pair: Pair, clients: tuple[KvcachedClient, ...], etcd: etcd3aio.Etcd3Client
) -> None:
    a, b = clients
    await a.put(digest(200), b"only on a")
    os.kill(pair.a.child.pid, signal.SIGKILL)  # no clean deregistration: the key lives until its lease ends
    pair.a.child.proc.wait(10)
    started = time.monotonic()
    assert await b.get(digest(200)) is None
    assert time.monotonic() - started < 3.0  # QUIC timeout 1 s, never a hang
    assert etcd.kv is not None

    async def gone() -> bool:
        assert etcd.kv is not None
        return not (await etcd.kv.get(peer_key(pair.settings.prefix, "a"))).kvs

    await _wait(gone, 10, "deregistered by lease expiry")
    started = time.monotonic()
    assert await b.get(digest(201)) is None
    assert time.monotonic() - started < 1.0  # no peer left to ask
    assert json.loads(json.dumps(await b.stats()))["peer_unavailable"] >= 1


async def test_shutdown_goes_on_when_the_store_fails_to_close(tmp_path: Path) -> None:
    """A store whose close raises (a disk gone read-only) is logged: the tracer is still shut down and the
    daemon lets go of the store."""
    calls: list[str] = []

    class BrokenStore:
        def close(self) -> None:
            calls.append("store")
            raise KvcachedError("ssd tier: cannot close the database: IO error")

    class Tracer:
        def shutdown(self) -> None:
            calls.append("tracer")

    daemon = Daemon(KvcachedConfig("a", RAM_BYTES, listen_unix=str(tmp_path / "a.sock")))
    daemon.store = BrokenStore()  # type: ignore[assignment]
    daemon.tracer = Tracer()  # type: ignore[assignment]
    await daemon.aclose()
    assert calls == ["store", "tracer"]
    assert daemon.store is None


async def test_the_apis_concurrency_cap_is_configured_and_exported(tmp_path: Path) -> None:
    """``[kvcached] max_concurrent_rpcs`` reaches the API server and is exported with its in-flight count."""
    daemon = Daemon(
        KvcachedConfig("a", RAM_BYTES, listen_unix=str(tmp_path / "a.sock"), max_concurrent_rpcs=5)
    )
    try:
        await daemon.start()
        assert daemon.api is not None and daemon.api.max_concurrent_rpcs == 5
        sample = daemon.metrics.registry.get_sample_value
        assert sample("kvcached_api_max_concurrent_rpcs") == 5
        assert sample("kvcached_api_rpcs_in_flight") == 0
    finally:
        await daemon.aclose()


async def test_the_peer_servers_buffer_budget_is_configured_and_exported(tmp_path: Path) -> None:
    """``quic.buffer_bytes`` reaches the PeerServer (absent: the default for ``max_block_bytes``), and the
    budget is exported with the daemon's metrics."""
    leaf = dev_bundle(tmp_path / "pki", ["kvcached-a"], dt.datetime.now(dt.UTC))["kvcached-a"]
    tls = TlsFiles(leaf.cert, leaf.key, leaf.ca)
    for quic, expected in [
        (QuicSettings(), buffer_bytes_default(64 << 20)),
        (QuicSettings(buffer_bytes=96 << 20), 96 << 20),
    ]:
        daemon = Daemon(
            KvcachedConfig("a", RAM_BYTES, listen_unix=str(tmp_path / "a.sock"), tls=tls, quic=quic)
        )
        try:
            await daemon.start()
            assert daemon.peer_server is not None
            assert daemon.peer_server.budget.capacity_bytes == expected
            sample = daemon.metrics.registry.get_sample_value
            assert sample("kvcached_peer_buffer_capacity_bytes") == expected
            assert sample("kvcached_peer_buffer_bytes") == 0 and sample("kvcached_peer_busy_total") == 0
        finally:
            await daemon.aclose()
