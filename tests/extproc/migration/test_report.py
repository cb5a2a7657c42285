"""The proxy's failed tries reach the ext_procs as Envoy's upstream log entries (report.py): a real gRPC
access-log server records what arrives, read back with the ext_proc's own reader (``failed_try``). In the
secure profile (``kvgate up --secure``) the engines and the access-log server take mTLS only: the proxy
reaches both with its client identity (Envoy's)."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from certs.store import LeafFiles, dev_bundle
from contracts.epp import FAILURE_LOG_NAME
from engines.gguf import ensure_model_dir, smollm2_gguf_path
from extproc.migration.proxy import MigrationProxy, engine_tls
from extproc.migration.report import CONNECT_FAILURE, REMOTE_RESET, FailureReports, entry
from extproc.xds.als import FailedTry, failed_try
from load.sim.server import SimConfig, SimFleet, server_tls
from load.sim.timing import TimingModel
from runtime.tls import ClientTlsFiles, channel_credentials, client_context
from tests.extproc.migration.test_proxy import CHAT, CLOSED, MODEL, fleet, post  # noqa: F401 (fixture)
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


# --- the secure profile: mTLS on both of the proxy's hops ----------------------------------------------


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, LeafFiles]:
    """One dev CA and the leaves of the secure profile's hops (``kvgate up --secure`` mints the same)."""
    return dev_bundle(tmp_path / "certs", ["envoy-edge", "extproc", "engine"], dt.datetime.now(dt.UTC))


def client_files(leaf: LeafFiles) -> ClientTlsFiles:
    return ClientTlsFiles(leaf.ca, leaf.cert, leaf.key)


@pytest.fixture
async def mtls_recorder(certs: dict[str, LeafFiles]) -> AsyncIterator[tuple[Recorder, str]]:
    """An access-log server that, as an ext_proc with ``[extproc] tls_*``, takes mTLS only."""
    leaf = certs["extproc"]
    server = grpc.aio.server()
    recorder = Recorder()
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(recorder, server)
    credentials = grpc.ssl_server_credentials(
        [(leaf.key.read_bytes(), leaf.cert.read_bytes())],
        root_certificates=leaf.ca.read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    yield recorder, f"127.0.0.1:{port}"
    await server.stop(None)


async def test_reports_reach_an_mtls_ext_proc_only_with_a_client_identity(
    certs: dict[str, LeafFiles], mtls_recorder: tuple[Recorder, str]
) -> None:
    rec, target = mtls_recorder
    plain = FailureReports([target])
    plain.failed("10.0.0.1:8000", REMOTE_RESET)
    await plain.aclose()  # waits for the try: refused at the handshake, logged, not raised
    assert rec.got == []
    secure = FailureReports([target], channel_credentials(client_files(certs["envoy-edge"])))
    secure.failed("10.0.0.1:8000", REMOTE_RESET)
    await until(lambda: len(rec.got) >= 1, 10)
    await secure.aclose()
    assert rec.got == [(FAILURE_LOG_NAME, FailedTry("10.0.0.1:8000", REMOTE_RESET))]


async def test_the_secure_proxy_continues_on_mtls_engines_and_reports_over_mtls(
    certs: dict[str, LeafFiles], mtls_recorder: tuple[Recorder, str]
) -> None:
    engine = certs["engine"]
    config = SimConfig(MODEL, ensure_model_dir(smollm2_gguf_path()), timing=TimingModel(time_scale=0.01))
    rec, target = mtls_recorder
    envoy = client_files(certs["envoy-edge"])
    tls = engine_tls(envoy)
    p = MigrationProxy(reports=FailureReports([target], tls), tls=tls)
    async with SimFleet(config, 2, ssl_context=server_tls(engine.cert, engine.key, engine.ca)) as tls_fleet:
        await p.start(("127.0.0.1", 0), ("127.0.0.1", 0))
        try:
            async with aiohttp.ClientSession() as http:
                first, second = tls_fleet.addresses
                reset = f"https://{first}/_sim/reset_next?n=1&after=2"
                async with http.post(reset, ssl=client_context(client_files(certs["extproc"]))) as answer:
                    assert answer.status == 200
                status, body = await post((p, http), [first, second], {**CHAT, "stream": True})
                assert status == 200 and body.rstrip().endswith(b"data: [DONE]")  # continued on the second
                await until(lambda: len(rec.got) >= 1, 10)
                assert rec.got == [(FAILURE_LOG_NAME, FailedTry(first, REMOTE_RESET))]
        finally:
            await p.aclose()
