"""The empty ext_proc of the overhead benchmark's floor: driven over gRPC as Envoy drives it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contracts.epp import DESTINATION, ENGINES_CLUSTER, LB_NS, MAX_CHUNK, PRIMARY
from extproc.xds.eds import TYPE_URL
from load.bench import empty_extproc

UPSTREAM = "127.0.0.1:18000"


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server, port = await empty_extproc.start_server(UPSTREAM)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
            yield chan
    finally:
        await server.stop(None)


def request_headers(
    end_of_stream: bool, mode: int = ProcessingMode.FULL_DUPLEX_STREAMED
) -> pb.ProcessingRequest:
    pairs = {":method": "POST" if not end_of_stream else "GET", ":path": "/v1/chat/completions"}
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
            end_of_stream=end_of_stream,
        ),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode),
    )


def body(data: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


def assert_routed(common: pb.CommonResponse, metadata: object, length: int) -> None:
    """``common`` sets the destination header (and the body's length) and clears the route cache;
    ``metadata`` names the upstream under ``envoy.lb`` as kvgate's processor does."""
    set_headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    assert set_headers == {DESTINATION: UPSTREAM, "content-length": str(length)}
    assert common.clear_route_cache
    lb = metadata.fields[LB_NS].struct_value.fields  # type: ignore[attr-defined]
    assert (lb[DESTINATION].string_value, lb[PRIMARY].string_value) == (UPSTREAM, UPSTREAM)


async def test_streamed_body_is_routed_at_its_end_and_echoed(channel: grpc.aio.Channel) -> None:
    payload = b"x" * (MAX_CHUNK + 10)
    call = pb_grpc.ExternalProcessorStub(channel).Process()
    await call.write(request_headers(False))
    await call.write(body(payload[:100], False))
    await call.write(body(payload[100:], False))
    await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    first = await call.read()  # nothing came before the body's end: the headers reply is first
    assert first.WhichOneof("response") == "request_headers"
    assert_routed(first.request_headers.response, first.dynamic_metadata, len(payload))
    echoed, ends = b"", []
    for _ in range(2):
        reply = await call.read()
        streamed = reply.request_body.response.body_mutation.streamed_response
        echoed += streamed.body
        ends.append(streamed.end_of_stream)
    assert (echoed, ends) == (payload, [False, True])
    assert (await call.read()).WhichOneof("response") == "request_trailers"
    await call.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    assert (await call.read()).WhichOneof("response") == "response_headers"
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=True)))
    assert (await call.read()).WhichOneof("response") == "response_body"
    await call.write(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    assert (await call.read()).WhichOneof("response") == "response_trailers"
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF


async def test_body_end_of_stream_routes_without_trailers(channel: grpc.aio.Channel) -> None:
    call = pb_grpc.ExternalProcessorStub(channel).Process()
    await call.write(request_headers(False))
    await call.write(body(b'{"a": 1}', True))
    first = await call.read()
    assert_routed(first.request_headers.response, first.dynamic_metadata, 8)
    last = (await call.read()).request_body.response.body_mutation.streamed_response
    assert (last.body, last.end_of_stream) == (b'{"a": 1}', True)
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF


async def test_bodyless_request_is_routed_at_its_headers(channel: grpc.aio.Channel) -> None:
    call = pb_grpc.ExternalProcessorStub(channel).Process()
    await call.write(request_headers(True))
    reply = await call.read()
    assert_routed(reply.request_headers.response, reply.dynamic_metadata, 0)
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF


async def test_buffered_mode_routes_with_the_body_reply(channel: grpc.aio.Channel) -> None:
    call = pb_grpc.ExternalProcessorStub(channel).Process()
    await call.write(request_headers(False, ProcessingMode.BUFFERED))
    headers_reply = await call.read()
    assert headers_reply.WhichOneof("response") == "request_headers"
    assert not headers_reply.request_headers.response.header_mutation.set_headers
    await call.write(body(b"{}", True))
    reply = await call.read()
    assert reply.WhichOneof("response") == "request_body"
    assert_routed(reply.request_body.response, reply.dynamic_metadata, 2)
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF


async def test_unknown_message_fails_the_stream(channel: grpc.aio.Channel) -> None:
    call = pb_grpc.ExternalProcessorStub(channel).Process()
    await call.write(pb.ProcessingRequest())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_eds_lists_the_upstream_and_health_is_serving(channel: grpc.aio.Channel) -> None:
    call = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel).StreamEndpoints()
    await call.write(discovery_pb2.DiscoveryRequest(type_url=TYPE_URL, resource_names=[ENGINES_CLUSTER]))
    resp = await call.read()
    cla = endpoint_pb2.ClusterLoadAssignment()
    assert resp.resources[0].Unpack(cla)
    (locality,) = cla.endpoints
    (host,) = locality.lb_endpoints
    address = host.endpoint.address.socket_address
    assert (cla.cluster_name, f"{address.address}:{address.port_value}") == (ENGINES_CLUSTER, UPSTREAM)
    await call.done_writing()
    health = health_pb2_grpc.HealthStub(channel)
    checked = await health.Check(health_pb2.HealthCheckRequest(service="liveness"))
    assert checked.status == health_pb2.HealthCheckResponse.SERVING
