"""Reading an HTTP answer's body with a bound (aiohttp): what a peer sends never grows a daemon's memory
past ``max_bytes`` (the gateway's engine scrapes, the agent's telemetry)."""

from __future__ import annotations

import aiohttp


async def read_body(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """``resp``'s body, at most ``max_bytes``: a longer one raises ``aiohttp.ClientPayloadError`` (an
    ``aiohttp.ClientError``), refused before reading when its ``Content-Length`` says so, else as soon as
    the bytes read pass the bound."""
    if resp.content_length is not None and resp.content_length > max_bytes:
        raise aiohttp.ClientPayloadError(f"answer of {resp.content_length} bytes, over {max_bytes}")
    data = bytearray()
    async for piece in resp.content.iter_any():
        data += piece
        if len(data) > max_bytes:
            raise aiohttp.ClientPayloadError(f"answer over {max_bytes} bytes")
    return bytes(data)
