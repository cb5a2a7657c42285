"""EDS: the assignment and one stream's ACK/NACK bookkeeping in memory, then ``StreamEndpoints`` over real
gRPC on the gateway's ext_proc port, driven as Envoy drives it (grpc.aio clients, xds-protos messages)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import Node
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from google.protobuf.any_pb2 import Any as AnyPb
from google.rpc.status_pb2 import Status  # type: ignore[import-untyped]

from contracts.epp import ENGINES_CLUSTER
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.fleet import Fleet
from extproc.server import Gateway
from extproc.xds.eds import (
    DRAINING,
    HEALTHY,
    TYPE_URL,
    UNHEALTHY,
    EndpointDiscovery,
    SotwStream,
    assignment,
    hosts,
    snapshot,
)
from tests.extproc.xds.conftest import gateway_on
from tests.polling import until


def ep(i: int, address: str) -> Endpoint:
    return Endpoint(EndpointId(f"e{i}"), address, frozenset({"m"}))


def lb_hosts(cla: endpoint_pb2.ClusterLoadAssignment) -> list[tuple[str, int, int]]:
    """``(ip, port, health)`` of each host, in the order served."""
    (locality,) = cla.endpoints
    return [
        (
            h.endpoint.address.socket_address.address,
            h.endpoint.address.socket_address.port_value,
            h.health_status,
        )
        for h in locality.lb_endpoints
    ]


def test_assignment_lists_every_endpoint_in_address_order_with_its_health() -> None:
    fleet = Fleet(
        [
            ep(0, "10.0.0.3:8000"),
            ep(1, "10.0.0.1:8001"),
            ep(2, "10.0.0.2:8000"),
            ep(3, "[::1]:9000"),
            ep(4, "10.0.0.4:8000"),
            ep(5, "10.0.0.5:8000"),
            ep(6, "10.0.0.6:8000"),
        ]
    )
    states = {s.id: s for s in fleet}
    states[EndpointId("e2")].healthy = False
    states[EndpointId("e4")].draining = True
    states[EndpointId("e5")].draining = True
    states[EndpointId("e5")].healthy = False  # unhealthy wins over draining
    fleet.eject(EndpointId("e6"), until=10.0)
    cla = assignment(fleet, now=9.0)
    assert cla.cluster_name == ENGINES_CLUSTER == "kvgate_engines"
    assert lb_hosts(cla) == [
        ("10.0.0.1", 8001, HEALTHY),
        ("10.0.0.2", 8000, UNHEALTHY),
        ("10.0.0.3", 8000, HEALTHY),
        ("10.0.0.4", 8000, DRAINING),
        ("10.0.0.5", 8000, UNHEALTHY),
        ("10.0.0.6", 8000, UNHEALTHY),
        ("::1", 9000, HEALTHY),
    ]
    # The ejection ends: healthy again.
    assert lb_hosts(assignment(fleet, now=10.0))[5] == ("10.0.0.6", 8000, HEALTHY)


def test_assignment_leaves_out_hosts_that_are_not_ip_addresses() -> None:
    fleet = Fleet([ep(0, "engine.local:8000"), ep(1, "10.0.0.1:8000")])
    assert lb_hosts(assignment(fleet, 0.0)) == [("10.0.0.1", 8000, HEALTHY)]
    assert snapshot(hosts(fleet, 0.0)).skipped == ("engine.local:8000",)


def test_version_is_a_content_hash() -> None:
    a = Fleet([ep(0, "10.0.0.1:8000"), ep(1, "10.0.0.2:8000")])
    b = Fleet([ep(1, "10.0.0.2:8000"), ep(0, "10.0.0.1:8000")])  # other order, other ids: same content
    assert snapshot(hosts(a, 0.0)).version == snapshot(hosts(b, 0.0)).version
    before = snapshot(hosts(a, 0.0)).version
    a.eject(EndpointId("e0"), until=5.0)
    assert snapshot(hosts(a, 1.0)).version != before
    assert snapshot(hosts(a, 5.0)).version == before


def request(
    nonce: str = "", version: str = "", names: tuple[str, ...] = (ENGINES_CLUSTER,), error: str | None = None
) -> discovery_pb2.DiscoveryRequest:
    req = discovery_pb2.DiscoveryRequest(
        version_info=version, resource_names=list(names), type_url=TYPE_URL, response_nonce=nonce
    )
    if error is not None:
        req.error_detail.CopyFrom(Status(code=3, message=error))
    return req


def test_stream_answers_once_per_request_and_only_with_news() -> None:
    one = snapshot((("10.0.0.1:8000", HEALTHY),))
    two = snapshot((("10.0.0.1:8000", UNHEALTHY),))
    stream = SotwStream()
    assert stream.response(one) is None  # nothing asked yet
    assert stream.request(request()) is None
    first = stream.response(one)
    assert first is not None and (first.version_info, first.nonce, first.type_url) == (
        one.version,
        "1",
        TYPE_URL,
    )
    assert list(first.resources) == [one.resource]
    assert stream.response(two) is None  # no ACK yet: one response at a time
    stream.request(request(nonce="1", version=one.version))  # ACK
    assert stream.acked_version == one.version
    assert stream.response(one) is None  # nothing new
    second = stream.response(two)
    assert second is not None and (second.version_info, second.nonce) == (two.version, "2")
    # A NACK: reported, and the rejected version is not sent again; the next one is.
    assert stream.request(request(nonce="2", version=one.version, error="bad host")) == "bad host"
    assert stream.acked_version == one.version
    assert stream.response(two) is None
    third = stream.response(one)
    assert third is not None and third.version_info == one.version


def test_stream_ignores_stale_nonces_and_follows_names() -> None:
    snap = snapshot((("10.0.0.1:8000", HEALTHY),))
    stream = SotwStream()
    stream.request(request())
    assert stream.response(snap) is not None
    stream.request(request(nonce="0"))  # not the last nonce sent: stale
    assert stream.names == (ENGINES_CLUSTER,)
    stream.request(request(nonce="1", version=snap.version, names=("other",)))
    other = stream.response(snap)  # the names changed: answered, without a resource for "other"
    assert other is not None and list(other.resources) == []
    stream.request(request(nonce="2", version=snap.version, names=()))
    wildcard = stream.response(snap)
    assert wildcard is not None and list(wildcard.resources) == [snap.resource]


# -- over gRPC ------------------------------------------------------------------------------------------

ADDRESSES = ["127.0.0.1:18001", "127.0.0.1:18002"]


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    async with gateway_on(ADDRESSES) as gw:
        yield gw


class Envoy:
    """One Envoy's EDS stream: requests are queued, responses read one at a time."""

    def __init__(self, channel: grpc.aio.Channel, names: tuple[str, ...] = (ENGINES_CLUSTER,)) -> None:
        self.requests: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()
        self.names = names
        self.call = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel).StreamEndpoints(self._requests())
        self.requests.put_nowait(
            discovery_pb2.DiscoveryRequest(
                node=Node(id="envoy-test"), resource_names=list(names), type_url=TYPE_URL
            )
        )

    async def _requests(self) -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        while (req := await self.requests.get()) is not None:
            yield req

    async def receive(self) -> tuple[discovery_pb2.DiscoveryResponse, list[tuple[str, int, int]]]:
        resp = await asyncio.wait_for(self.call.read(), 5)
        assert isinstance(resp, discovery_pb2.DiscoveryResponse), resp
        assert resp.type_url == TYPE_URL
        cla = endpoint_pb2.ClusterLoadAssignment()
        if resp.resources:
            (resource,) = resp.resources
            assert isinstance(resource, AnyPb) and resource.Unpack(cla)
        return resp, lb_hosts(cla) if resp.resources else []

    def ack(self, resp: discovery_pb2.DiscoveryResponse, error: str | None = None) -> None:
        req = discovery_pb2.DiscoveryRequest(
            version_info=resp.version_info,
            resource_names=list(self.names),
            type_url=TYPE_URL,
            response_nonce=resp.nonce,
        )
        if error is not None:
            req.error_detail.CopyFrom(Status(code=3, message=error))
        self.requests.put_nowait(req)


async def test_every_stream_gets_the_fleet_then_each_change(gateway: Gateway) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['extproc']}") as channel:
        envoys = [Envoy(channel), Envoy(channel)]
        for envoy in envoys:
            resp, got = await envoy.receive()
            assert got == [("127.0.0.1", 18001, HEALTHY), ("127.0.0.1", 18002, HEALTHY)]
            assert resp.version_info == gateway.eds.snapshot.version
            envoy.ack(resp)
        # An endpoint joins: pushed to both, without polling.
        gateway.fleet.upsert(ep(7, "127.0.0.1:18007"))
        for envoy in envoys:
            resp, got = await envoy.receive()
            assert [h[1] for h in got] == [18001, 18002, 18007]
            envoy.ack(resp)
        # One is ejected: unhealthy for Envoy, then healthy again when the ejection ends (timed, not polled).
        gateway.fleet.eject(EndpointId("e0"), until=time.monotonic() + 0.3)  # the gateway's clock
        for envoy in envoys:
            resp, got = await envoy.receive()
            assert got[0] == ("127.0.0.1", 18001, UNHEALTHY)
            envoy.ack(resp)
        for envoy in envoys:
            resp, got = await envoy.receive()
            assert got[0] == ("127.0.0.1", 18001, HEALTHY)
            envoy.ack(resp)
        for envoy in envoys:
            envoy.requests.put_nowait(None)
            envoy.call.cancel()


async def test_nack_is_logged_once_and_the_stream_keeps_serving(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['extproc']}") as channel:
        envoy = Envoy(channel)
        resp, _ = await envoy.receive()
        with caplog.at_level(logging.ERROR, logger="extproc.xds.eds"):
            envoy.ack(resp, error="malformed IP address: nope")
            await until(lambda: any("malformed IP address" in r.getMessage() for r in caplog.records), 5)
        assert sum("malformed IP address" in r.getMessage() for r in caplog.records) == 1
        assert resp.version_info in caplog.records[-1].getMessage()
        gateway.fleet.remove(EndpointId("e1"))
        resp, got = await envoy.receive()
        assert got == [("127.0.0.1", 18001, HEALTHY)]
        envoy.call.cancel()


async def test_drain_and_health_from_the_feeds_and_etcd_reach_envoy(gateway: Gateway) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['extproc']}") as channel:
        envoy = Envoy(channel)
        resp, _ = await envoy.receive()
        envoy.ack(resp)
        gateway.fleet.set_state(EndpointId("e1"), draining=True)  # as etcd's drain/ and the feeds write it
        resp, got = await envoy.receive()
        assert got[1] == ("127.0.0.1", 18002, DRAINING)
        envoy.call.cancel()


async def test_other_names_get_no_resource_and_drain_ends_streams(gateway: Gateway) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['extproc']}") as channel:
        envoy = Envoy(channel, names=("some_other_cluster",))
        resp, got = await envoy.receive()
        assert got == [] and resp.version_info
        envoy.ack(resp)
        await gateway.eds.aclose()
        assert await asyncio.wait_for(envoy.call.read(), 5) == grpc.aio.EOF
        assert await envoy.call.code() == grpc.StatusCode.OK
        # A late stream that writes nothing: the refusal comes before any request is read, and a client
        # whose first write races the server's trailers sees grpc's own INTERNAL "Failed execute_batch"
        # instead (seen once in CI), which says nothing about what the server answered.
        hold = asyncio.Event()

        async def silent() -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
            await hold.wait()
            return
            yield  # an async generator that never yields

        late = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel).StreamEndpoints(silent())
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await asyncio.wait_for(late.read(), 5)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        hold.set()


async def test_linked_clusters_are_served_even_with_no_engine_of_its_own() -> None:
    """An empty fleet's hosts are ``()``: peers set then still make a new assignment (they did not: the
    forced refresh compared ``()`` with ``()``)."""
    discovery = EndpointDiscovery(Fleet([]), time.monotonic)
    discovery.start()
    try:
        before = discovery.snapshot.version
        discovery.set_peers({"10.9.0.1:8443": "spiffe://kvgate.local/federation-b"})
        await until(lambda: discovery.snapshot.version != before, 5)
    finally:
        await discovery.aclose()
