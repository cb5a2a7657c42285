"""The status shell on 127.0.0.1: /status.json, /status, Prometheus on every other path, read-only, and a
snapshot taken on the event loop (the server answers from its own thread)."""

from __future__ import annotations

import asyncio
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from extproc.control.policy import PolicyStore
from extproc.fleet import Fleet
from extproc.flow.control import FlowControl
from extproc.index.hybrid import HybridIndex
from extproc.status.http import StatusServer
from extproc.status.snapshot import Status, decode, snapshot
from tests.extproc.status.test_snapshot import A, B


def get(url: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


class Served:
    def __init__(self, server: StatusServer, base: str) -> None:
        self.server, self.base = server, base
        self.threads: set[int] = set()

    async def get(self, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
        return await asyncio.to_thread(get, self.base + path, method)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    registry = CollectorRegistry()
    Counter("kvgate_test_things", "things", registry=registry).inc()
    fleet = Fleet([A, B])
    seen: set[int] = set()

    def take() -> Status:
        seen.add(threading.get_ident())
        return snapshot(fleet, HybridIndex(), FlowControl[str](), PolicyStore(), [], 5.0, 1_700_000_000.0)

    server = StatusServer(registry, take, asyncio.get_running_loop(), refresh_s=4)
    port = server.start("127.0.0.1:0")
    box = Served(server, f"http://127.0.0.1:{port}")
    box.threads = seen
    yield box
    await asyncio.to_thread(server.close)


async def test_the_json_document_is_taken_on_the_event_loop(served: Served) -> None:
    code, headers, body = await served.get("/status.json")
    assert code == 200 and headers["Content-Type"] == "application/json"
    assert headers["Cache-Control"] == "no-store"
    status = decode(body)
    assert [e.id for e in status.endpoints] == ["sim-0", "sim-1"]
    assert served.threads == {threading.get_ident()}  # the loop's thread, not the server's


async def test_the_page(served: Served) -> None:
    for path in ("/status", "/status/"):  # the second redirected to the first (urllib follows it)
        code, headers, body = await served.get(path)
        assert code == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
        assert "default-src 'none'" in headers["Content-Security-Policy"]
        page = body.decode()
        assert '<meta http-equiv="refresh" content="4">' in page
        assert "sim-0" in page and "sim-1" in page
    code, headers, body = await served.get("/status", "HEAD")
    assert code == 200 and body == b"" and int(headers["Content-Length"]) > 0


async def test_metrics_stay_on_every_other_path(served: Served) -> None:
    for path in ("/metrics", "/"):
        code, _, body = await served.get(path)
        assert code == 200 and b"kvgate_test_things_total 1.0" in body


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
async def test_read_only(served: Served, method: str) -> None:
    code, headers, _ = await served.get("/status.json", method)
    assert code == 405 and headers["Allow"] == "GET, HEAD"


async def test_a_snapshot_that_does_not_come_is_a_503() -> None:
    """With the event loop busy past the bound (here: blocked), the page answers 503 rather than hang."""
    registry = CollectorRegistry()
    loop = asyncio.new_event_loop()  # never run: nothing it is asked ever happens
    server = StatusServer(registry, lambda: pytest.fail("never taken"), loop, timeout_s=0.2)
    port = server.start("127.0.0.1:0")
    try:
        code, _, body = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/status.json")
        assert code == 503 and body == b"status unavailable\n"
    finally:
        await asyncio.to_thread(server.close)
        loop.close()


async def test_a_failing_snapshot_is_a_500_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> Status:
        raise KeyError("a bug")

    server = StatusServer(CollectorRegistry(), broken, asyncio.get_running_loop())
    port = server.start("127.0.0.1:0")
    try:
        code, _, body = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/status")
        assert code == 500 and body == b"status failed\n"
        assert "status snapshot failed" in caplog.text and "KeyError" in caplog.text
    finally:
        await asyncio.to_thread(server.close)
