"""The load client's reading of a streamed answer (:func:`load.client._send`)."""

from __future__ import annotations

import time

import aiohttp
import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from load.client import PATH, RequestRecord, _send

_CHUNK = {"choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}]}
#: vLLM's in-stream error event (kvgate's migration proxy sends the same when a continuation fails).
_ERROR = {"error": {"message": "no host left", "type": "service_unavailable", "param": None, "code": 503}}


async def _answer(events: list[dict[str, object]]) -> RequestRecord:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post(PATH, handler)
    record = RequestRecord("s", 0, "k", 0.0)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as http:
        url = str(server.make_url("")).rstrip("/")
        await _send(http, url, b"{}", record, time.perf_counter())
    return record


async def test_a_stream_counts_as_served() -> None:
    record = await _answer([_CHUNK])
    assert record.ok and record.ttft_s is not None


async def test_an_error_event_mid_stream_is_a_failure() -> None:
    """Tokens, then an error event, then [DONE]: the request was lost, not served."""
    record = await _answer([_CHUNK, _ERROR])
    assert not record.ok
    assert record.status == "stream_error" and record.error_code == "503"
