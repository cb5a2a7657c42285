"""The proxy's failed tries reach the ext_procs as Envoy's upstream log entries (report.py): a real gRPC
access-log server records what arrives, read back with the ext_proc's own reader (``failed_try``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from contracts.epp import FAILURE_LOG_NAME
from extproc.migration.proxy import MigrationProxy
from extproc.migration.report import CONNECT_FAILURE, REMOTE_RESET, FailureReports, entry
from extproc.xds.als import FailedTry, failed_try
from load.sim.server import SimFleet
from tests.extproc.migration.test_proxy import CHAT, CLOSED, fleet, post  # noqa: F401 (fixture)
from tests.polling import until


class Recorder(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.got: list[tuple[str, FailedTry | None]] = []

    async def StreamAccessLogs(self, requests: Any, context: Any) -> als_pb2.StreamAccessLogsResponse:
        name = ""
        async for msg in requests:
            if msg.HasField("identifier"):
                name = msg.identifier.log_name
            self.got += [(name, failed_try(e)) for e in msg.http_logs.log_entry]
        return als_pb2.StreamAccessLogsResponse()


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[Recorder, str]]:
    server = grpc.aio.server()
    recorder = Recorder()
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield recorder, f"127.0.0.1:{port}"
    await server.stop(None)


def test_entries_read_as_envoys() -> None:
    assert failed_try(entry("10.0.0.1:8000", REMOTE_RESET)) == FailedTry("10.0.0.1:8000", REMOTE_RESET)
    assert failed_try(entry("10.0.0.1:8000", status=503)) == FailedTry("10.0.0.1:8000", "http_503")
    assert failed_try(entry("10.0.0.1:8000", status=500)) is None  # as from Envoy: only a 503 ejects
    assert failed_try(entry("[::1]:8000", CONNECT_FAILURE)) == FailedTry("[::1]:8000", CONNECT_FAILURE)


async def test_a_refused_try_and_a_reset_stream_are_reported(
    fleet: SimFleet,  # noqa: F811
    recorder: tuple[Recorder, str],
) -> None:
    rec, target = recorder
    p = MigrationProxy(reports=FailureReports([target]))
    await p.start(("127.0.0.1", 0), ("127.0.0.1", 0))
    try:
        async with aiohttp.ClientSession() as http:
            first, second = fleet.addresses
            status, _ = await post((p, http), [CLOSED, first], {**CHAT, "stream": True})
            assert status == 200
            await until(lambda: len(rec.got) >= 1, 10)
            assert rec.got == [(FAILURE_LOG_NAME, FailedTry(CLOSED, CONNECT_FAILURE))]
            async with http.post(f"http://{first}/_sim/reset_next?n=1&after=2"):
                pass
            status, body = await post((p, http), [first, second], {**CHAT, "stream": True})
            assert status == 200 and body.rstrip().endswith(b"data: [DONE]")  # continued on the second
            await until(lambda: len(rec.got) >= 2, 10)
            assert rec.got[1] == (FAILURE_LOG_NAME, FailedTry(first, REMOTE_RESET))
    finally:
        await p.aclose()
