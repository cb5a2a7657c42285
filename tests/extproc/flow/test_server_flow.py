"""Held streams through the real gateway (ExternalProcessor, Dispatcher, Router) on one event loop: a
client that leaves as its held request is dispatched leaves no slot taken."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import cast

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.config import parse_config
from extproc.flow.control import Room
from extproc.processor import ProcessorConfig
from extproc.server import ExternalProcessor, Gateway
from extproc.xds.als import Completion
from tests.extproc.test_server import MODEL, body_msgs, chat_body, headers_msg
from tests.polling import until

ADDRESS = "127.0.0.1:8000"


@pytest.fixture
async def gateway(model_dir: str) -> AsyncIterator[Gateway]:
    config = parse_config(
        {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            "models": [{"name": MODEL, "model_dir": model_dir}],
            "endpoints": [{"id": "e0", "address": ADDRESS, "models": [MODEL]}],
            "flow": {"saturation": {"max_in_flight": 1}},
        }
    )
    gw = Gateway(config)
    await gw.start()
    yield gw
    await gw.aclose(grace_s=0)


def stream(servicer: ExternalProcessor, rid: str, got: list[str]) -> asyncio.Task[None]:
    """A stream as Envoy drives it: the request's headers and body, then it stays open (what it is
    answered goes to ``got``); cancelling the task is the client going away."""

    async def messages() -> AsyncIterator[pb.ProcessingRequest]:
        yield headers_msg("/v1/chat/completions", extra={"x-request-id": rid})
        for m in body_msgs(chat_body(rid)):
            yield m
        await asyncio.Event().wait()

    async def drain() -> None:
        replies = servicer.Process(messages(), cast(grpc.aio.ServicerContext, None))
        try:
            async for r in replies:
                got.append(str(r.WhichOneof("response")))
        finally:
            await replies.aclose()  # the stream's end, now (not at the loop's asyncgen finalizer)

    return asyncio.create_task(drain())


@pytest.mark.parametrize("when", ["before the pass", "after the pass"])
async def test_a_held_request_whose_client_leaves_as_it_is_dispatched_frees_its_slot(
    gateway: Gateway, when: str
) -> None:
    gw = gateway
    servicer = ExternalProcessor(
        gw.router, ProcessorConfig(max_body_bytes=1 << 20), gw.metrics, dispatcher=gw.dispatcher
    )
    [state] = list(gw.fleet)
    a_got: list[str] = []
    b_got: list[str] = []
    a = stream(servicer, "ra", a_got)
    await until(lambda: len(a_got) == 2, 30)  # a is routed: the one slot is taken
    b = stream(servicer, "rb", b_got)
    await until(lambda: len(gw.flow.queues) == 1, 30)  # b is held
    assert state.outstanding == 1
    # a's engine completes (the completion log kicks a pass: a's slot is still taken) and its stream ends
    # (its close kicks the pass that finds room); b's client goes away in the same loop turn, its task
    # cancelled before its handler runs: before that pass runs, or after it routed b.
    gw._on_completion(Completion(ADDRESS, "ra", 200, 0.1, 0.2))
    a.cancel()
    loop = asyncio.get_running_loop()
    if when == "before the pass":
        loop.call_soon(b.cancel)  # after a's close queues the pass, before it
    else:
        loop.call_soon(loop.call_soon, b.cancel)  # after the pass, before b's task takes the replies
    await asyncio.gather(a, b, return_exceptions=True)
    assert "request_body" not in b_got and len(gw.flow.queues) == 0
    assert (state.outstanding, state.in_flight, state.load) == (0, 0, 0.0)
    assert gw._flow_space(MODEL, 0, time.monotonic()) is Room.OPEN  # not FULL for good
