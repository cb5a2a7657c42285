"""How long the bundled Envoy (``render()``, the wheel's 1.40) lets an ext_proc hold a request before it
answers (flow control's queue), measured with a tiny ext_proc that holds the request headers' reply.

* FULL_DUPLEX_STREAMED request bodies (the bundled default): Envoy runs no per-message timer at all, so
  ``message_timeout`` never fires; a ``ProcessingResponse`` carrying only ``override_message_timeout`` is
  accepted and ignored (Envoy's debug log: "Ignoring server new timeout message ... due to timer not
  enabled"). The hold is bounded by the stream idle timeout instead: 504 when it runs out.
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
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from contracts.epp import REJECTED_KEY, REJECTED_NS
from kvgate.dev.procs import start_envoy
from kvgate.envoy.bootstrap import EnvoyParams, render
from kvgate.envoy.resilience import Resilience

MESSAGE_TIMEOUT_S = 0.5
HOLD_S = MESSAGE_TIMEOUT_S + 1.0
EXTEND = "x-test-extend"


class Holding(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Holds each request's headers reply for ``hold_s``, first asking Envoy for 5 s more when the request
    has the :data:`EXTEND` header, then answers 429 as flow control's rejection would."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s

    async def Process(
        self, requests: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for msg in requests:
            if not msg.HasField("request_headers"):
                continue  # body chunks and trailers of FULL_DUPLEX_STREAMED: the answer ends the stream
            names = {h.key for h in msg.request_headers.headers.headers}
            if EXTEND in names:
                yield pb.ProcessingResponse(override_message_timeout=Duration(seconds=5))
            await asyncio.sleep(self.hold_s)  # the held request (a queue), not a wait for readiness
            metadata = Struct()
            metadata.fields[REJECTED_NS].struct_value.fields[REJECTED_KEY].bool_value = True
            body = {"error": {"message": "held", "type": "rate_limit_error", "param": None, "code": None}}
            yield pb.ProcessingResponse(
                immediate_response=pb.ImmediateResponse(
                    status=HttpStatus(code=429), body=json.dumps(body).encode()
                ),
                dynamic_metadata=metadata,
            )
            return


async def held(tmp_path: Path, resilience: Resilience, *, hold_s: float = HOLD_S) -> list[int]:
    """The statuses of two requests through the bundled Envoy on :class:`Holding` (``message_timeout``
    0.5 s, ``max_message_timeout`` 10 s) held ``hold_s``: one that asks Envoy for more time, one that
    does not. Both are sent at once, so the wall time is one hold."""
    params = EnvoyParams(
        listen_port=0,
        admin_port=0,
        extproc_port=0,
        access_log_path=None,
        message_timeout_s=MESSAGE_TIMEOUT_S,
        max_message_timeout_s=10.0,
        resilience=resilience,
    )
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Holding(hold_s), server)
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
            async with httpx.AsyncClient(timeout=10) as client:
                answers = await asyncio.gather(
                    client.post(url, json=body, headers={EXTEND: "1"}), client.post(url, json=body)
                )
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


async def test_full_duplex_holds_are_bounded_by_the_stream_idle_timeout(tmp_path: Path) -> None:
    idle = replace(FULL_DUPLEX, stream_idle_timeout_s=1.0)
    assert await held(tmp_path, idle, hold_s=2.0) == [504, 504]


async def test_buffered_bodies_need_the_override(tmp_path: Path) -> None:
    """The override holds the request past ``message_timeout``; without it Envoy gives up at 0.5 s."""
    assert await held(tmp_path, BUFFERED) == [429, 503]
