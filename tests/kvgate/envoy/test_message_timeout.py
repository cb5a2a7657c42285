"""How long the bundled Envoy (``render()``, the wheel's 1.40) lets an ext_proc hold a request before it
answers (flow control's queue), measured with a tiny ext_proc that holds the request headers' reply.

* FULL_DUPLEX_STREAMED request bodies (the bundled default): Envoy runs no per-message timer at all, so
  ``message_timeout`` never fires; a ``ProcessingResponse`` carrying only ``override_message_timeout`` is
  accepted and ignored (Envoy's debug log: "Ignoring server new timeout message ... due to timer not
  enabled"). The hold is bounded by the listener's stream idle timeout instead (504 when it runs out):
  ``render()`` makes that at least ``max_message_timeout`` (the longest hold the ext_proc may ask for),
  and gives every route a decision leads to (matched on the model header the ext_proc sets) the
  configured ``stream_idle_timeout_s``. Envoy applies a route's ``idle_timeout`` when it chooses the route
  again after the ext_proc's reply: a hold longer than the stream idle timeout gets the ext_proc's answer,
  and an engine silent past it after the decision still gets 504.
* BUFFERED request bodies (``fail_open``): ``message_timeout`` fires (then Envoy goes on without the
  ext_proc, here to no engine: 503), unless the ext_proc first extends it with
  ``override_message_timeout`` (at most ``max_message_timeout``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from contracts.epp import DESTINATION, LB_NS, MODEL_HEADER, REJECTED_KEY, REJECTED_NS
from extproc.xds.eds import HEALTHY, TYPE_URL, snapshot
from kvgate.dev.procs import start_envoy
from kvgate.envoy.bootstrap import EnvoyParams, render
from kvgate.envoy.resilience import Resilience, listener_idle_timeout_s

MESSAGE_TIMEOUT_S = 0.5
MAX_MESSAGE_TIMEOUT_S = 30.0
HOLD_S = MESSAGE_TIMEOUT_S + 1.0
EXTEND = "x-test-extend"
#: A request with this header is routed (the model header set, the engine the ``envoy.lb`` destination)
#: after its hold instead of answered 429.
ROUTE = "x-test-route"


class Holding(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Holds each request's headers reply for ``hold_s``, first asking Envoy for 5 s more when the request
    has the :data:`EXTEND` header, then answers 429 as flow control's rejection would. A request with the
    :data:`ROUTE` header is held once its body is in (asking for 5 s more with ``buffered`` bodies), then
    routed to ``engine`` as the gateway's decision is: the model header set, the route chosen again, the
    body sent back (streamed, or whole with ``buffered`` bodies)."""

    def __init__(self, hold_s: float, engine: str = "", *, buffered: bool = False) -> None:
        self.hold_s = hold_s
        self.engine = engine
        self.buffered = buffered

    async def Process(
        self, requests: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        body = b""
        async for msg in requests:
            if msg.HasField("request_headers"):
                names = {h.key for h in msg.request_headers.headers.headers}
                if ROUTE in names:
                    if self.buffered:  # the routing headers come with the body's answer
                        yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                    continue
                if EXTEND in names:
                    yield pb.ProcessingResponse(override_message_timeout=Duration(seconds=5))
                await asyncio.sleep(self.hold_s)  # the held request (a queue), not a wait for readiness
                yield rejected()
                return
            if not msg.HasField("request_body"):
                continue  # trailers
            body += msg.request_body.body
            if msg.request_body.end_of_stream:
                if self.buffered:
                    yield pb.ProcessingResponse(override_message_timeout=Duration(seconds=5))
                await asyncio.sleep(self.hold_s)  # as above
                for reply in self.routed(body):
                    yield reply

    def routed(self, body: bytes) -> list[pb.ProcessingResponse]:
        """The decision's replies (as ``extproc/processor.py`` ``_sending``)."""
        first = pb.ProcessingResponse()
        common = first.request_body.response if self.buffered else first.request_headers.response
        common.clear_route_cache = True
        option = common.header_mutation.set_headers.add()
        option.header.key = MODEL_HEADER
        option.header.raw_value = b"m"
        first.dynamic_metadata.fields[LB_NS].struct_value.fields[DESTINATION].string_value = self.engine
        if self.buffered:
            common.body_mutation.body = body
            return [first]
        chunk = pb.ProcessingResponse()
        chunk.request_body.response.body_mutation.streamed_response.body = body
        chunk.request_body.response.body_mutation.streamed_response.end_of_stream = True
        return [first, chunk]


def rejected() -> pb.ProcessingResponse:
    """Flow control's 429, marked as the gateway's answer."""
    metadata = Struct()
    metadata.fields[REJECTED_NS].struct_value.fields[REJECTED_KEY].bool_value = True
    body = {"error": {"message": "held", "type": "rate_limit_error", "param": None, "code": None}}
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(status=HttpStatus(code=429), body=json.dumps(body).encode()),
        dynamic_metadata=metadata,
    )


class OneEngine(eds_pb2_grpc.EndpointDiscoveryServiceServicer):  # type: ignore[misc]
    """EDS of ``kvgate_engines`` with the one ``engine`` (``ip:port``); Envoy's initialization waits for
    it (``eds_initial_fetch_s``)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine

    async def StreamEndpoints(
        self, requests: AsyncIterator[discovery_pb2.DiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        snap = snapshot(((self.engine, HEALTHY),))
        async for req in requests:
            if not req.response_nonce:  # the subscription (later requests are its ACKs)
                yield discovery_pb2.DiscoveryResponse(
                    version_info=snap.version, resources=[snap.resource], type_url=TYPE_URL, nonce="1"
                )


async def held(
    tmp_path: Path,
    resilience: Resilience,
    *,
    hold_s: float = HOLD_S,
    engine: str = "",
    headers: tuple[dict[str, str], ...] = ({EXTEND: "1"}, {}),
) -> list[int]:
    """The statuses of requests through the bundled Envoy on :class:`Holding` (``message_timeout`` 0.5 s,
    ``max_message_timeout`` 30 s) held ``hold_s``, one per ``headers``: by default one that asks Envoy for
    more time, one that does not. All are sent at once, so the wall time is one hold. With ``engine``
    (``ip:port``), the engine cluster's EDS serves it and :data:`ROUTE` requests are routed there."""
    params = EnvoyParams(
        listen_port=0,
        admin_port=0,
        extproc_port=0,
        access_log_path=None,
        message_timeout_s=MESSAGE_TIMEOUT_S,
        max_message_timeout_s=MAX_MESSAGE_TIMEOUT_S,
        resilience=resilience,
    )
    server = grpc.aio.server()
    holding = Holding(hold_s, engine, buffered=resilience.fail_open)
    pb_grpc.add_ExternalProcessorServicer_to_server(holding, server)
    if engine:
        eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(OneEngine(engine), server)
    checks = health.aio.HealthServicer()
    await checks.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    params = replace(params, extproc_port=server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    try:
        envoy, _admin, listen = await asyncio.to_thread(
            start_envoy, "envoy", json.dumps(render(params)), tmp_path
        )
        try:
            body = {"model": "m", "prompt": "hello", "max_tokens": 1}
            url = f"http://127.0.0.1:{listen}/v1/completions"
            # Less than MAX_MESSAGE_TIMEOUT_S: a request bounded only by the listener's idle timeout
            # raises here instead of answering.
            async with httpx.AsyncClient(timeout=MAX_MESSAGE_TIMEOUT_S / 3) as client:
                answers = await asyncio.gather(*(client.post(url, json=body, headers=h) for h in headers))
            return [a.status_code for a in answers]
        finally:
            await asyncio.to_thread(envoy.stop)
    finally:
        await server.stop(0)


# No EDS here (no engine is needed): Envoy starts serving after eds_initial_fetch_s.
FULL_DUPLEX = Resilience(eds_initial_fetch_s=0.1)
BUFFERED = Resilience(eds_initial_fetch_s=0.1, fail_open=True)


async def test_full_duplex_has_no_message_timer(tmp_path: Path) -> None:
    """Held past ``message_timeout``, with or without an override: the ext_proc's own answer arrives."""
    assert await held(tmp_path, FULL_DUPLEX) == [429, 429]


async def test_full_duplex_holds_are_bounded_by_the_listeners_idle_timeout(tmp_path: Path) -> None:
    """Held 2 s, past the stream idle timeout (1 s) but within the listener's (``max_message_timeout``):
    the ext_proc's answer arrives; the listener's own bound, shorter than the hold, gives 504."""
    idle = replace(FULL_DUPLEX, stream_idle_timeout_s=1.0)
    assert await held(tmp_path, idle, hold_s=2.0) == [429, 429]
    assert listener_idle_timeout_s(idle, MAX_MESSAGE_TIMEOUT_S) == MAX_MESSAGE_TIMEOUT_S
    longer = replace(FULL_DUPLEX, stream_idle_timeout_s=MAX_MESSAGE_TIMEOUT_S * 2)
    assert listener_idle_timeout_s(longer, MAX_MESSAGE_TIMEOUT_S) == MAX_MESSAGE_TIMEOUT_S * 2


async def test_a_silent_engine_still_gets_the_stream_idle_timeout(tmp_path: Path) -> None:
    """Routed after a 2 s hold (past the 1 s stream idle timeout) to an engine that never answers: the
    decided route's idle timeout (1 s, not the listener's 30 s: the client would give up first) ends it
    with 504, while the request held as long beside it gets the ext_proc's 429; a model with its own idle
    timeout gets that one the same way, and so do fail-open's buffered bodies. Envoy re-arms its idle
    timer with the route's timeout at the next byte that moves: the body the ext_proc sends back."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads until Envoy closes the connection; never answers
        writer.close()

    engine = await asyncio.start_server(silent, "127.0.0.1", 0)
    address = f"127.0.0.1:{engine.sockets[0].getsockname()[1]}"
    idle = Resilience(stream_idle_timeout_s=1.0, eds_initial_fetch_s=10.0)
    own = replace(idle, stream_idle_timeout_s=300.0, model_idle_timeouts=(("m", 1.0),))
    try:
        for res in (idle, own, replace(idle, fail_open=True)):
            statuses = await held(
                tmp_path, res, hold_s=2.0, engine=address, headers=({ROUTE: "1"}, {EXTEND: "1"})
            )
            assert statuses == [504, 429], res
    finally:
        engine.close()


async def test_buffered_bodies_need_the_override(tmp_path: Path) -> None:
    """The override holds the request past ``message_timeout``; without it Envoy gives up at 0.5 s."""
    assert await held(tmp_path, BUFFERED) == [429, 503]
