"""Test helpers shared by the power source tests: a TCP server that accepts and never answers (a hung
BMC or exporter), and a free port for servers that cannot report the one they bound."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


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
