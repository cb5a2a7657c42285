"""The fault suite's yardstick (:mod:`load.steady`): what counts as a served request."""

from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import TestServer

from load.steady import FaultRecord, SteadyLoad, failure_kind

_CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
_ERROR = b'data: {"error":{"message":"lost","type":"service_unavailable","param":null,"code":503}}\n\n'


async def _outcomes(events: list[bytes]) -> SteadyLoad:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in [*events, b"data: [DONE]\n\n"]:
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    async with TestServer(app, host="127.0.0.1") as server:
        load = SteadyLoad(str(server.make_url("")), "m", clients=1)
        async with load:
            load.outcomes.append(await load._one(stream=True, n=1))
    return load


async def test_a_whole_stream_succeeds() -> None:
    load = await _outcomes([_CHUNK])
    assert all(o.ok for o in load.outcomes if o.stream) and any(o.stream for o in load.outcomes)


async def test_an_error_event_before_done_is_a_failure() -> None:
    """A 200 stream with tokens, an error event, then [DONE] (a request kvgate's migration lost)."""
    load = await _outcomes([_CHUNK, _ERROR])
    streams = [o for o in load.outcomes if o.stream]
    assert streams and not any(o.ok for o in streams)
    assert {failure_kind(o) for o in streams} == {"200 error event"}
    record = FaultRecord.of("f", streams, hang_s=30.0, recovery_s=0.0)
    assert record.failed == {"200 error event": len(streams)}
