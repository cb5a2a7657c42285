"""The upstream client against a real aiohttp server on 127.0.0.1 (ephemeral port)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from extproc.upstream.client import UpstreamClient
from extproc.upstream.errors import Unreachable, UpstreamStatus, UpstreamTimeout


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
