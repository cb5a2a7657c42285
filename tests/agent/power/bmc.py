"""Test helpers shared by the power source tests: a TCP server that accepts and never answers (a hung
BMC or exporter), an HTTP endpoint serving dcgm-exporter's text, and a free port for servers that cannot
report the one they bound."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port free on 127.0.0.1 now (TCP, or UDP with ``socket.SOCK_DGRAM``), for a server that takes a
    port on its command line and cannot say which one it bound."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def silent_server() -> AsyncIterator[int]:
    """A TCP server on 127.0.0.1 that accepts connections and never sends a byte; yields its port."""
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


class Exporter:
    """An HTTP endpoint on 127.0.0.1 serving dcgm-exporter's format at ``/metrics``: ``body`` and
    ``status`` are what it answers now; ``port`` where it listens."""

    def __init__(self, body: str) -> None:
        self.body = body
        self.status = 200
        self.port = 0

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.body, status=self.status, content_type="text/plain")


@asynccontextmanager
async def exporter_server(body: str) -> AsyncIterator[Exporter]:
    exp = Exporter(body)
    app = web.Application()
    app.router.add_get("/metrics", exp.metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    exp.port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
    try:
        yield exp
    finally:
        await runner.cleanup()
