"""The secure migration proxy knows whom it reached and follows certificate rotation.

An engine's certificate must name the engine role (``certs.roles.SERVERS``), checked at the handshake as
Envoy's ``combined_validation_context`` checks it: a gateway's certificate from the same CA is refused
before the request is sent, the client gets the proxy's JSON 503 (or the next host's answer), and the
ext_procs get a connection-failure report. A rotated proxy certificate is used by the next connection and
the next report, without a restart.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
import uvloop

from certs.authority import identity_uri
from certs.roles import SERVERS, serves
from certs.store import LOCAL_SANS, LeafFiles, issue
from contracts.epp import FAILURE_LOG_NAME
from contracts.errors import ConfigError
from engines.gguf import ensure_model_dir, smollm2_gguf_path
from extproc.migration.proxy import MigrationProxy, engine_tls
from extproc.migration.report import CONNECT_FAILURE, REMOTE_RESET, FailureReports
from extproc.xds.als import FailedTry
from load.sim.server import SimConfig, SimFleet, server_tls
from load.sim.timing import TimingModel
from runtime.tls import ClientTlsFiles, ReloadingClientCerts
from tests.extproc.migration.test_proxy import CHAT, MODEL, post
from tests.extproc.migration.test_report import (  # noqa: F401 (fixtures)
    Recorder,
    certs,
    client_files,
    mtls_recorder,
)
from tests.polling import until


def sim_config(**kw: str) -> SimConfig:
    return SimConfig(MODEL, ensure_model_dir(smollm2_gguf_path()), timing=TimingModel(time_scale=0.01), **kw)


def copy_of(leaf: LeafFiles, where: Path) -> ClientTlsFiles:
    """``leaf``'s certificate and key copied to ``where`` (to rotate without touching the fixture's)."""
    files = ClientTlsFiles(leaf.ca, where / "mine.pem", where / "mine.key")
    shutil.copy(leaf.cert, where / "mine.pem")
    shutil.copy(leaf.key, where / "mine.key")
    return files


def rotate(files: ClientTlsFiles, to: str) -> None:
    """Replace ``files``' certificate and key by fresh ones of service ``to`` from the same CA, renamed
    into place key first (as ``kvgate certs issue`` writes them)."""
    assert files.ca is not None and files.cert is not None and files.key is not None
    fresh = issue(files.ca.parent, to, LOCAL_SANS, dt.datetime.now(dt.UTC))
    os.replace(fresh.key, files.key)
    os.replace(fresh.cert, files.cert)


def test_only_the_engine_role_serves_engines() -> None:
    assert SERVERS["engine"] == frozenset({"engine"})
    assert serves("engine", [identity_uri("engine")])
    assert serves("engine", [identity_uri("engine-gpu3")])
    for other in ("envoy-edge", "extproc", "agent", "client-alice", "operator"):
        assert not serves("engine", [identity_uri(other)])
    assert not serves("engine", ["spiffe://elsewhere.example/engine", "https://kvgate.local/engine"])


@pytest.fixture
async def impostor(certs: dict[str, LeafFiles]) -> AsyncIterator[SimFleet]:  # noqa: F811
    """A simulator presenting Envoy's certificate (role envoy-edge, same CA, server usage, right address);
    with an API key, so that its ``auth_seen`` counts every ``/v1`` request that reaches it."""
    edge = certs["envoy-edge"]
    tls = server_tls(edge.cert, edge.key, edge.ca)
    async with SimFleet(sim_config(api_key="k"), 1, ssl_context=tls) as fleet:
        yield fleet


async def test_an_engine_address_serving_another_role_is_refused_before_the_request(
    certs: dict[str, LeafFiles],  # noqa: F811
    mtls_recorder: tuple[Recorder, str],  # noqa: F811
    impostor: SimFleet,
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec, target = mtls_recorder
    (fake,) = impostor.addresses
    # The proxy's own identity here is extproc's, so that the impostor's (envoy-edge) differs from it.
    tls = engine_tls(client_files(certs["extproc"]))
    p = MigrationProxy(reports=FailureReports([target], tls), tls=tls)
    engine = certs["engine"]
    caplog.set_level(logging.INFO, logger="extproc.migration.proxy")
    async with SimFleet(sim_config(), 1, ssl_context=server_tls(engine.cert, engine.key, engine.ca)) as real:
        await p.start(("127.0.0.1", 0), ("127.0.0.1", 0))
        try:
            async with aiohttp.ClientSession() as http:
                for stream in (False, True):
                    status, body = await post((p, http), [fake], {**CHAT, "stream": stream})
                    assert status == 503, body
                    error = orjson.loads(body)["error"]
                    assert error["code"] == "engine_unreachable" and "Traceback" not in body.decode()
                await until(lambda: len(rec.got) >= 2, 10)
                assert rec.got == [(FAILURE_LOG_NAME, FailedTry(fake, CONNECT_FAILURE))] * 2
                # The impostor is passed over: the next host of the decision answers.
                status, body = await post((p, http), [fake, real.addresses[0]], {**CHAT, "stream": True})
                assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
                # The impostor never saw a request: the refusal came at the handshake.
                assert impostor.replicas[0].auth_seen == {"accepted": 0, "rejected": 0}
        finally:
            await p.aclose()
    refusals = [r.getMessage() for r in caplog.records if "certificate refused" in r.getMessage()]
    assert refusals and all("names role envoy-edge, not one that serves engine" in m for m in refusals)


def test_the_role_check_holds_under_uvloop(certs: dict[str, LeafFiles]) -> None:  # noqa: F811
    """``kvgate up`` runs the proxy under uvloop, whose TLS is its own: the check must hold there too."""

    async def main() -> tuple[str, int]:
        edge, engine = certs["envoy-edge"], certs["engine"]
        tls = engine_tls(client_files(certs["extproc"]))
        results = []
        for leaf in (edge, engine):
            served = server_tls(leaf.cert, leaf.key, leaf.ca)
            async with (
                SimFleet(sim_config(), 1, ssl_context=served) as fleet,
                aiohttp.ClientSession() as http,
            ):
                try:
                    url = f"https://{fleet.addresses[0]}/v1/models"
                    async with http.get(url, ssl=tls.context()) as answer:
                        results.append(str(answer.status))
                except aiohttp.ClientConnectorCertificateError as exc:
                    results.append(str(exc.certificate_error))
        return results[0], int(results[1])

    refused, served = uvloop.run(main())
    assert "names role envoy-edge" in refused and served == 200


async def test_a_rotated_proxy_certificate_reaches_new_engine_connections_and_reports(
    certs: dict[str, LeafFiles],  # noqa: F811
    mtls_recorder: tuple[Recorder, str],  # noqa: F811
    tmp_path: Path,
) -> None:
    rec, target = mtls_recorder
    mine = copy_of(certs["envoy-edge"], tmp_path)
    tls = engine_tls(mine)
    reports = FailureReports([target], tls)
    p = MigrationProxy(reports=reports, tls=tls)
    engine = certs["engine"]
    async with SimFleet(sim_config(), 1, ssl_context=server_tls(engine.cert, engine.key, engine.ca)) as fleet:
        await p.start(("127.0.0.1", 0), ("127.0.0.1", 0))
        try:
            async with aiohttp.ClientSession() as http:
                (host,) = fleet.addresses
                status, _ = await post((p, http), [host], CHAT)
                assert status == 200
                reports.failed("10.0.0.1:8000", REMOTE_RESET)
                await until(lambda: len(rec.got) >= 1, 10)
                # Rotated to an identity engines refuse (operator): the simulator's 403 shows which
                # certificate the next connection presented.
                rotate(mine, "operator")
                status, body = await post((p, http), [host], CHAT)
                assert status == 403, body
                assert tls.reloads == 1
                # And back to an identity engines take.
                rotate(mine, "envoy-edge-2")
                status, _ = await post((p, http), [host], CHAT)
                assert status == 200 and tls.reloads == 2
                reports.failed("10.0.0.2:8000", REMOTE_RESET)  # on a new channel, with the new identity
                await until(lambda: len(rec.got) >= 2, 10)
                assert rec.got[1] == (FAILURE_LOG_NAME, FailedTry("10.0.0.2:8000", REMOTE_RESET))
        finally:
            await p.aclose()


def test_a_half_done_rotation_keeps_the_pair_in_force(certs: dict[str, LeafFiles], tmp_path: Path) -> None:  # noqa: F811
    mine = copy_of(certs["envoy-edge"], tmp_path)
    tls = ReloadingClientCerts(mine, where="test")
    before = tls.context(), tls.credentials()
    fresh = issue(certs["envoy-edge"].ca.parent, "envoy-edge-3", LOCAL_SANS, dt.datetime.now(dt.UTC))
    assert mine.cert is not None and mine.key is not None
    os.replace(fresh.key, mine.key)  # the key landed, the certificate not yet
    assert (tls.context(), tls.credentials()) == before and tls.reloads == 0
    os.replace(fresh.cert, mine.cert)
    assert tls.context() is not before[0] and tls.reloads == 1
    assert tls.context() is tls.context()  # unchanged files: no re-read


def test_unusable_files_are_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="migration TLS"):
        engine_tls(ClientTlsFiles(tmp_path / "ca.pem", tmp_path / "c.pem", tmp_path / "c.key"))
