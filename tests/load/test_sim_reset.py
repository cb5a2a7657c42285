"""The simulator's connection-reset fault (``/_sim/reset_next``): a real TCP RST, before any response
byte or after the K-th SSE event of a stream; the requests after it are served as usual."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from engines.gguf import ensure_model_dir, smollm2_gguf_path
from load.sim.server import SimConfig, SimFleet
from load.sim.timing import TimingModel

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    config = SimConfig(MODEL, ensure_model_dir(smollm2_gguf_path()), timing=TimingModel(time_scale=0.01))
    async with SimFleet(config, 1) as fleet:
        yield fleet


def exchange(address: str, path: str, body: bytes) -> tuple[bytes, OSError | None]:
    """One HTTP/1.1 request on a raw socket: the bytes read, and the error that ended the read (a
    reset is ``ConnectionResetError``; ``None``: the server closed the connection cleanly)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except OSError as exc:
            return got, exc
        return got, None


def chat(stream: bool) -> bytes:
    messages = [{"role": "user", "content": "hi"}]
    return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 12, "stream": stream})


async def arm(fleet: SimFleet, query: str) -> None:
    url = f"http://{fleet.addresses[0]}/_sim/reset_next?{query}"
    async with aiohttp.ClientSession() as http, http.post(url) as response:
        assert response.status == 200


async def test_reset_before_the_answer_then_served_again(fleet: SimFleet) -> None:
    await arm(fleet, "n=1")
    got, error = await asyncio.to_thread(exchange, fleet.addresses[0], "/v1/chat/completions", chat(False))
    assert got == b"" and isinstance(error, ConnectionResetError)
    got, error = await asyncio.to_thread(exchange, fleet.addresses[0], "/v1/chat/completions", chat(False))
    assert error is None and got.startswith(b"HTTP/1.1 200")


async def test_a_stream_is_reset_after_its_kth_event(fleet: SimFleet) -> None:
    await arm(fleet, "n=1&after=3")
    got, error = await asyncio.to_thread(exchange, fleet.addresses[0], "/v1/chat/completions", chat(True))
    assert isinstance(error, ConnectionResetError)
    assert got.startswith(b"HTTP/1.1 200") and b"[DONE]" not in got
    assert got.count(b"data: ") >= 1  # part of the answer came first


async def test_bad_values_are_refused(fleet: SimFleet) -> None:
    url = f"http://{fleet.addresses[0]}/_sim/reset_next?n=-1"
    async with aiohttp.ClientSession() as http, http.post(url) as response:
        assert response.status == 400
