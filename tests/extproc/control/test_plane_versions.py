"""The gateway's control plane in a rolling upgrade: endpoint records of the previous version (flat key,
no version fields), of the current one (``endpoints/<node>/<id>``) and of a newer one, in memory and from
a real etcd; a feed of a newer version over a real gRPC stream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import etcd3aio
import grpc
import msgspec

from contracts.etcd import Change, EtcdSettings, endpoint_key
from contracts.events import (
    EPOCH_HEADER,
    SUBSCRIBE_METHOD,
    Batch,
    Cleared,
    EndpointId,
    Load,
    Stored,
    Subscribe,
    decode_subscribe,
)
from contracts.versions import DIGEST_VERSION, FEED_VERSION, RECORD_VERSION
from engines.endpoint import Endpoint, encode_endpoint
from extproc.control.plane import ControlCore, ControlPlane
from extproc.control.policy import PolicyStore
from extproc.fleet import Fleet
from runtime.feed.client import FeedClient, FeedStats
from tests.polling import until

pytest_plugins = ("tests.etcd_fixtures",)

P = "/kvgate/"


def _ep(name: str, port: int, node: str = "node-a") -> Endpoint:
    return Endpoint(
        EndpointId(name), f"127.0.0.1:{port}", frozenset({"m"}), node=node, kv_events=True, feed="127.0.0.1:1"
    )


def _legacy(endpoint: Endpoint) -> bytes:
    """The record as an agent of the previous version wrote it (no schema, no digest)."""
    doc = json.loads(encode_endpoint(endpoint))
    del doc["schema"], doc["digest"]
    return json.dumps(doc).encode()


def _newer(endpoint: Endpoint) -> bytes:
    doc = json.loads(encode_endpoint(endpoint))
    doc.update(schema=RECORD_VERSION + 1, kv_layout="paged-v2")
    return json.dumps(doc).encode()


def test_a_rolling_upgrade_keeps_every_endpoint_routable() -> None:
    fleet, store = Fleet([]), PolicyStore()
    core = ControlCore(P, fleet, store)
    old, new = _ep("old-0", 8001), _ep("new-0", 8002, node="node-b")
    core.apply(
        [
            Change(endpoint_key(P, "old-0"), _legacy(old)),  # an agent not yet upgraded
            Change(endpoint_key(P, "new-0", "node-b"), encode_endpoint(new)),
        ],
        1,
    )
    assert fleet.get(old.id).endpoint == old  # type: ignore[union-attr]
    assert fleet.get(new.id).endpoint == new  # type: ignore[union-attr]
    assert core.counters["version_skew"] == 0

    # old-0's agent is upgraded: it registers under endpoints/node-a/, then its old key's lease ends.
    core.apply([Change(endpoint_key(P, "old-0", "node-a"), encode_endpoint(old))], 2)
    assert core.apply([Change(endpoint_key(P, "old-0"), None)], 3).fleet_changed is False
    assert fleet.get(old.id) is not None
    assert core.apply([Change(endpoint_key(P, "old-0", "node-a"), None)], 4).fleet_changed
    assert fleet.get(old.id) is None


def test_a_newer_record_is_routed_by_load_only_and_counted() -> None:
    fleet, store = Fleet([]), PolicyStore()
    core = ControlCore(P, fleet, store)
    ahead = _ep("ahead-0", 8003)
    assert core.apply([Change(endpoint_key(P, "ahead-0", "node-a"), _newer(ahead))], 1).fleet_changed
    state = fleet.get(ahead.id)
    assert state is not None and state.endpoint.address == ahead.address
    assert not state.endpoint.kv_events  # its KV data is absent: no precise index entries for it
    assert core.counters["version_skew"] == 1 and core.counters["rejected"] == 0
    assert core.skewed == {("endpoint", "ahead-0")}  # the gauge: as long as the record stays skewed
    core.apply([Change(endpoint_key(P, "ahead-0", "node-a"), _newer(ahead))], 2)  # the same value again
    assert core.skewed == {("endpoint", "ahead-0")}
    core.apply([Change(endpoint_key(P, "ahead-0", "node-a"), encode_endpoint(ahead))], 3)  # downgraded
    assert core.skewed == set() and core.counters["version_skew"] == 1
    core.apply([Change(endpoint_key(P, "ahead-0", "node-a"), _newer(ahead))], 4)
    core.apply([Change(endpoint_key(P, "ahead-0", "node-a"), None)], 5)  # its lease ended
    assert core.skewed == set()


def test_a_record_in_another_agents_prefix_is_refused() -> None:
    fleet, store = Fleet([]), PolicyStore()
    core = ControlCore(P, fleet, store)
    spoof = _ep("spoof-0", 8004, node="node-a")
    core.apply([Change(endpoint_key(P, "spoof-0", "node-b"), encode_endpoint(spoof))], 1)
    assert fleet.get(spoof.id) is None and core.counters["rejected"] == 1


async def test_records_of_three_versions_from_a_real_etcd(
    etcd_settings: EtcdSettings, etcd_client: etcd3aio.Etcd3Client
) -> None:
    kv, p = etcd_client.kv, etcd_settings.prefix
    assert kv is not None
    old, cur, ahead = _ep("old-1", 8101), _ep("cur-1", 8102, "node-b"), _ep("ahead-1", 8103, "node-c")
    await kv.put(endpoint_key(p, "old-1"), _legacy(old))
    await kv.put(endpoint_key(p, "cur-1", "node-b"), encode_endpoint(cur))
    fleet, store = Fleet([]), PolicyStore()
    plane = ControlPlane(etcd_settings, fleet, store, probe_interval_s=0.2)
    await plane.start()
    try:
        assert await plane.wait_synced(5.0)
        assert fleet.get(old.id).endpoint == old  # type: ignore[union-attr]
        assert fleet.get(cur.id).endpoint == cur  # type: ignore[union-attr]
        await kv.put(endpoint_key(p, "ahead-1", "node-c"), _newer(ahead))
        await until(lambda: fleet.get(ahead.id) is not None, 2.0)
        assert not fleet.get(ahead.id).endpoint.kv_events  # type: ignore[union-attr]
        assert plane.core.counters["version_skew"] == 1
    finally:
        await plane.aclose()


# -- a feed of a newer version, over gRPC ---------------------------------------------------------------


class _NewerBatch(msgspec.Struct, array_like=True, frozen=True):
    source: str
    epoch: int
    seq: int
    events: list[Stored | Load | Cleared]
    snapshot: bool = False
    ts: float = 0.0
    version: int = FEED_VERSION + 1
    digest: int = DIGEST_VERSION


class _Server:
    """Serves pre-encoded batches (bytes) on the feed method, then stays open."""

    def __init__(self, batches: list[bytes]) -> None:
        self.batches = batches
        self._server: Any = None
        self.port = 0

    async def start(self) -> None:
        service, method = SUBSCRIBE_METHOD.split("/")[1:]
        handler = grpc.method_handlers_generic_handler(
            service,
            {
                method: grpc.unary_stream_rpc_method_handler(
                    self._subscribe, request_deserializer=decode_subscribe, response_serializer=lambda b: b
                )
            },
        )
        self._server = grpc.aio.server(handlers=[handler])
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    async def _subscribe(self, request: Subscribe, context: Any) -> AsyncIterator[bytes]:
        await context.send_initial_metadata(((EPOCH_HEADER, "9"),))
        for raw in self.batches:
            yield raw
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        await self._server.stop(0)


class _Recorder:
    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.resets: list[frozenset[EndpointId]] = []

    def on_batch(self, batch: Batch) -> None:
        self.batches.append(batch)

    def on_reset(self, source: str, endpoints: frozenset[EndpointId]) -> None:
        self.resets.append(endpoints)

    def on_lost(self, address: str) -> None:
        pass

    def on_restored(self, address: str) -> None:
        pass


async def test_a_newer_feed_delivers_loads_and_no_kv_data() -> None:
    d = b"\x07" * 16
    snapshot = _NewerBatch(
        "node-z", 9, 1, [Cleared("z0"), Stored("z0", [d]), Load("z0", 1, 2)], snapshot=True
    )
    live = _NewerBatch("node-z", 9, 2, [Stored("z0", [d]), Load("z0", 0, 3)], ts=time.time())
    server = _Server([msgspec.msgpack.encode(snapshot), msgspec.msgpack.encode(live)])
    await server.start()
    rec, stats = _Recorder(), FeedStats()
    client = FeedClient(f"127.0.0.1:{server.port}", rec, subscriber="t", stats=stats)
    client.start()
    try:
        await until(lambda: len(rec.batches) == 2, 5.0)
        assert rec.resets == [frozenset({EndpointId("z0")})]  # what was held from it is dropped
        assert rec.batches[0].events == [Cleared("z0"), Load("z0", 1, 2)]
        assert rec.batches[1].events == [Load("z0", 0, 3)]
        assert stats.version_skew == 2 and stats.gaps == 0
    finally:
        await client.aclose()
        await server.aclose()
