"""The upstream client against a real aiohttp server on 127.0.0.1 (ephemeral port)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from extproc.upstream.client import UpstreamClient
from extproc.upstream.errors import Unreachable, UpstreamError, UpstreamStatus, UpstreamTimeout


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    release = asyncio.Event()

    async def ok(request: web.Request) -> web.Response:
        seen = {"body": (await request.read()).decode(), "id": request.headers.get("x-request-id")}
        return web.json_response(seen)

    async def fail(request: web.Request) -> web.Response:
        return web.json_response({"error": {}}, status=503)

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({})

    app = web.Application()
    app.add_routes([web.post("/ok", ok), web.post("/fail", fail), web.post("/slow", slow)])
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        release.set()
        await runner.cleanup()


async def test_answers_statuses_and_timeouts(engine: str) -> None:
    client = UpstreamClient()
    try:
        answer = await client.post_json(
            engine, "/ok", b'{"a": 1}', timeout_s=5, headers={"x-request-id": "r9"}
        )
        assert answer.status == 200
        assert json.loads(answer.body) == {"body": '{"a": 1}', "id": "r9"}
        with pytest.raises(UpstreamStatus) as status:
            await client.post_json(engine, "/fail", b"{}", timeout_s=5)
        assert status.value.status == 503 and status.value.reason == "status"
        with pytest.raises(UpstreamTimeout):
            await client.post_json(engine, "/slow", b"{}", timeout_s=0.2)
    finally:
        await client.aclose()


async def test_unreachable() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = UpstreamClient()
    try:
        with pytest.raises(Unreachable) as caught:
            await client.post_json(f"127.0.0.1:{port}", "/x", b"{}", timeout_s=5)
        assert caught.value.reason == "unreachable"
    finally:
        await client.aclose()


async def test_post_stream_hands_over_lines_and_stops_when_told() -> None:
    """A streamed answer line by line; stopping early closes the connection, which the engine sees as the
    client going away (its next write fails)."""
    gone = asyncio.Event()

    async def sse(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(200):
                await response.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(0.005)
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, ConnectionError):
            gone.set()
        return response

    async def fail(request: web.Request) -> web.Response:
        return web.json_response({"error": {}}, status=429)

    app = web.Application()
    app.add_routes([web.post("/sse", sse), web.post("/fail", fail)])
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    address = f"127.0.0.1:{runner.addresses[0][1]}"
    client = UpstreamClient()
    try:
        whole: list[bytes] = []
        assert (
            await client.post_stream(
                address, "/sse", b"{}", lambda ln: whole.append(ln) or True, timeout_s=10
            )
            == 200
        )
        data = [ln.strip() for ln in whole if ln.strip()]
        assert data[0] == b"data: 0" and data[-1] == b"data: [DONE]" and len(data) == 201
        seen: list[bytes] = []
        await client.post_stream(
            address,
            "/sse",
            b"{}",
            lambda ln: (seen.append(ln) or True) and ln.strip() != b"data: 3",
            timeout_s=10,
        )
        assert [ln.strip() for ln in seen if ln.strip()] == [b"data: 0", b"data: 1", b"data: 2", b"data: 3"]
        await asyncio.wait_for(gone.wait(), 5)  # the server's writes failed: the client left
        with pytest.raises(UpstreamStatus):
            await client.post_stream(address, "/fail", b"{}", lambda ln: True, timeout_s=5)
        with pytest.raises(UpstreamTimeout):
            await client.post_stream(address, "/sse", b"{}", lambda ln: True, timeout_s=0.1)
    finally:
        await client.aclose()
        await runner.cleanup()


async def test_post_stream_reads_a_line_past_aiohttps_line_limit_and_bounds_the_answer() -> None:
    """One SSE line of 1.5 MB (aiohttp's own line reader raises LineTooLong past 512 KiB, which escaped as
    no UpstreamError) is handed over whole; an answer past MAX_ANSWER_BYTES, in one line, is an
    UpstreamError."""

    async def sse(request: web.Request) -> web.StreamResponse:
        size = int(request.query["size"])
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        payload = b"data: " + b"x" * size
        for i in range(0, len(payload), 65536):  # in many writes: the line comes in many reads
            await response.write(payload[i : i + 65536])
        await response.write(b"\n\ndata: [DONE]\n\n")
        return response

    app = web.Application()
    app.add_routes([web.post("/sse", sse)])
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    address = f"127.0.0.1:{runner.addresses[0][1]}"
    client = UpstreamClient()
    try:
        lines: list[bytes] = []
        await client.post_stream(
            address, "/sse?size=1500000", b"{}", lambda ln: lines.append(ln) or True, timeout_s=10
        )
        assert lines == [b"data: " + b"x" * 1_500_000 + b"\n", b"\n", b"data: [DONE]\n", b"\n"]
        with pytest.raises(UpstreamError) as big:
            await client.post_stream(address, "/sse?size=5000000", b"{}", lambda ln: True, timeout_s=10)
        assert "answer over" in str(big.value)
    finally:
        await client.aclose()
        await runner.cleanup()


async def test_post_stream_hands_over_a_last_line_without_a_newline_and_a_cut_payload_is_unreachable() -> (
    None
):
    async def tail(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: 1\n\ndata: 2")
        return response

    async def short(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream", "content-length": "100"})
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        assert request.transport is not None
        request.transport.close()  # 9 of the 100 bytes promised: ClientPayloadError
        return response

    app = web.Application()
    app.add_routes([web.post("/tail", tail), web.post("/short", short)])
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    address = f"127.0.0.1:{runner.addresses[0][1]}"
    client = UpstreamClient()
    try:
        lines: list[bytes] = []
        await client.post_stream(address, "/tail", b"{}", lambda ln: lines.append(ln) or True, timeout_s=10)
        assert lines == [b"data: 1\n", b"\n", b"data: 2"]
        with pytest.raises(Unreachable):
            await client.post_stream(address, "/short", b"{}", lambda ln: True, timeout_s=10)
    finally:
        await client.aclose()
        await runner.cleanup()


async def _serve(routes: list[web.RouteDef]) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


async def test_post_json_reads_an_answer_sent_in_several_writes_whole() -> None:
    """An answer whose bytes arrive in more than one piece is read to its end, not cut after the first
    piece (``StreamReader.read(n)`` returns what is buffered); one over 4 MiB is an ``UpstreamError``."""
    from extproc.upstream.client import MAX_ANSWER_BYTES

    async def pieces(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"text": "')
        for _ in range(8):  # 2 MiB in pieces: more than one read's worth of buffered bytes
            await response.write(b"y" * 256 * 1024)
        await response.write(b'"}')
        await response.write_eof()
        return response

    async def huge(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (MAX_ANSWER_BYTES + 1))

    runner, address = await _serve([web.post("/pieces", pieces), web.post("/huge", huge)])
    client = UpstreamClient()
    try:
        answer = await client.post_json(address, "/pieces", b"{}", timeout_s=5)
        assert json.loads(answer.body) == {"text": "y" * 2 * 1024 * 1024}
        with pytest.raises(UpstreamError) as caught:
            await client.post_json(address, "/huge", b"{}", timeout_s=5)
        assert caught.value.reason == "error"
    finally:
        await client.aclose()
        await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_redirect_is_not_followed_to_another_host(stream: bool) -> None:
    """An engine's answer never names another upstream: a 307 (which would resend the body, a prompt, to
    the ``Location`` host) is an ``UpstreamStatus``, and the other host is never called."""
    called = asyncio.Event()

    async def elsewhere(request: web.Request) -> web.Response:
        called.set()
        return web.json_response({})

    other, other_address = await _serve([web.post("/steal", elsewhere)])

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"http://{other_address}/steal")

    runner, address = await _serve([web.post("/v1/completions", moved)])
    client = UpstreamClient()
    try:
        with pytest.raises(UpstreamStatus) as caught:
            if stream:
                await client.post_stream(address, "/v1/completions", b"{}", lambda _: True, timeout_s=5)
            else:
                await client.post_json(address, "/v1/completions", b"{}", timeout_s=5)
        assert caught.value.status == 307
        assert not called.is_set()
    finally:
        await client.aclose()
        await runner.cleanup()
        await other.cleanup()
