"""agent.admin: the admin API of a real :class:`agent.main.Agent` (no engines, no etcd, ``[agent]
kvcached`` set so the slot routes exist) on 127.0.0.1:0. With ``[agent.tls]`` (dev-CA certificates):
HTTPS, reads open without a client certificate, every POST 401 without one, 403 with one whose role may
not change agent state, a certificate from another CA refused, a gateway's (``extproc``) or an
operator's let through to the route; the advertised ``slot_restore`` URL is ``https``. Without it:
plaintext and open, as before."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvloop

from agent.admin import server_context
from agent.config import AgentSection, NodeConfig, TLSFiles, parse_node_config
from agent.errors import AgentConfigError
from agent.main import Agent
from agent.slot_api import RESTORE_CHAIN_PATH
from certs.authority import identity_uri
from certs.store import LOCAL_SANS, LeafFiles, dev_bundle, issue
from engines.config import EngineConfig
from runtime.identity import peercert_uris
from tests.extproc.migration.test_identity import copy_of

#: Every state-changing route of an agent with ``[agent] kvcached``.
POSTS = ("/drain", "/slots/save", "/slots/restore", RESTORE_CHAIN_PATH)
DIGEST = "ab" * 16
#: Roles of the agent's own CA that may not change agent state (issue 26.1).
WRONG = ("agent-node-b", "kvcached", "envoy-edge", "client-x")


@dataclass(frozen=True)
class Pki:
    agent: LeafFiles
    gateway: LeafFiles  # the ext_proc's [feeds] client certificate
    rogue: LeafFiles  # same name, another CA
    operator: LeafFiles  # an operator's tools (kvgate certs issue --name operator-ops)
    wrong: dict[str, LeafFiles]  # same CA, roles that may not change agent state
    api_client: LeafFiles  # an API client's certificate, from its own CA (kvgate up --secure's clients/)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    now = dt.datetime.now(dt.UTC)
    good = dev_bundle(
        tmp_path_factory.mktemp("pki"), ["agent-node-a", "extproc", "operator-ops", *WRONG], now
    )
    rogue = dev_bundle(tmp_path_factory.mktemp("rogue"), ["extproc"], now)
    api = dev_bundle(tmp_path_factory.mktemp("clients"), ["client-alice"], now)
    wrong = {name: good[name] for name in WRONG}
    return Pki(
        good["agent-node-a"],
        good["extproc"],
        rogue["extproc"],
        good["operator-ops"],
        wrong,
        api["client-alice"],
    )


def llama_engine() -> EngineConfig:
    raw = {
        "agent": {"id": "node-a"},
        "engines": [{"kind": "llama_cpp", "model": "m", "model_path": "smollm2"}],
    }
    return parse_node_config(raw).engines[0]


async def running(tmp_path: Path, tls: TLSFiles | None) -> Agent:
    section = AgentSection(
        id="node-a", state_dir=str(tmp_path / "state"), kvcached=f"unix:{tmp_path / 'kvcached.sock'}", tls=tls
    )
    agent = Agent(NodeConfig(section, ()), index_block_size=16)
    try:
        await agent.start()
    except BaseException:
        await agent.aclose()
        raise
    return agent


@pytest.fixture
async def tls_agent(tmp_path: Path, pki: Pki) -> AsyncIterator[Agent]:
    files = TLSFiles(str(pki.agent.cert), str(pki.agent.key), str(pki.agent.ca))
    agent = await running(tmp_path, files)
    try:
        yield agent
    finally:
        await agent.aclose()


def client(pki: Pki, cert: LeafFiles | None) -> ssl.SSLContext:
    """A client that verifies the agent, presenting ``cert`` (``None``: no client certificate)."""
    ctx = ssl.create_default_context(cafile=str(pki.agent.ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert), str(cert.key))
    return ctx


async def call(
    method: str, url: str, tls: ssl.SSLContext | None = None, body: object = None
) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        kwargs: dict[str, Any] = {} if tls is None else {"ssl": tls}
        async with session.request(method, url, json=body, **kwargs) as resp:
            return resp.status, await resp.json()


async def test_reads_are_open_and_every_post_needs_a_client_certificate(tls_agent: Agent, pki: Pki) -> None:
    base = f"https://127.0.0.1:{tls_agent.admin_port}"
    anonymous = client(pki, None)
    assert await call("GET", f"{base}/healthz", anonymous) == (200, {"status": "ok"})
    assert await call("GET", f"{base}/readyz", anonymous) == (200, {"ready": True})  # no engines
    status, page = await call("GET", f"{base}/status", anonymous)
    assert status == 200 and page["node"] == "node-a"
    for path in POSTS:
        status, answer = await call(
            "POST", base + path, anonymous, {"engine": "llama-0", "digests": [DIGEST]}
        )
        assert status == 401, path
        assert answer["error"]["code"] == 401 and "client certificate" in answer["error"]["message"]
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] is None
    assert not tls_agent.stop_requested.is_set()


async def test_client_certificate_from_another_ca_is_refused(tls_agent: Agent, pki: Pki) -> None:
    base = f"https://127.0.0.1:{tls_agent.admin_port}"
    for path in ("/drain", RESTORE_CHAIN_PATH):
        try:
            status, _ = await call(
                "POST", base + path, client(pki, pki.rogue), {"engine": "x", "digests": []}
            )
        except aiohttp.ClientError:
            continue  # refused in the TLS handshake (the certificate does not chain to client_ca)
        assert status == 401, path
    assert not tls_agent.stop_requested.is_set()


async def test_a_valid_client_certificate_reaches_the_routes(tls_agent: Agent, pki: Pki) -> None:
    base = f"https://127.0.0.1:{tls_agent.admin_port}"
    gateway = client(pki, pki.gateway)
    status, answer = await call(
        "POST", base + RESTORE_CHAIN_PATH, gateway, {"engine": "llama-0", "digests": []}
    )
    assert status == 400 and "digests" in answer["error"]["message"]
    status, answer = await call(
        "POST", base + RESTORE_CHAIN_PATH, gateway, {"engine": "x", "digests": [DIGEST]}
    )
    assert status == 404 and answer["error"]["message"] == "no engine 'x'"
    status, answer = await call("POST", base + "/slots/save", gateway, {"engine": "x"})
    assert status == 400 and answer["error"]["code"] == 400
    assert await call("GET", f"{base}/healthz", gateway) == (200, {"status": "ok"})
    assert await call("POST", f"{base}/drain", gateway) == (202, {"draining": True})
    assert tls_agent.stop_requested.is_set()


@pytest.mark.parametrize("name", WRONG)
async def test_a_certificate_of_a_role_that_may_not_change_state_gets_403(
    tls_agent: Agent, pki: Pki, name: str
) -> None:
    base = f"https://127.0.0.1:{tls_agent.admin_port}"
    other = client(pki, pki.wrong[name])
    assert await call("GET", f"{base}/healthz", other) == (200, {"status": "ok"})  # reads stay open
    for path in POSTS:
        status, answer = await call("POST", base + path, other, {"engine": "llama-0", "digests": [DIGEST]})
        assert status == 403, path
        assert answer["error"]["code"] == 403 and "identity" in answer["error"]["message"]
        assert answer["error"]["type"] == "permission_error"
    assert not tls_agent.stop_requested.is_set()


async def test_an_api_client_certificate_from_its_own_ca_fails_the_handshake(
    tls_agent: Agent, pki: Pki
) -> None:
    with pytest.raises(aiohttp.ClientError):
        await call("POST", f"https://127.0.0.1:{tls_agent.admin_port}/drain", client(pki, pki.api_client))
    assert not tls_agent.stop_requested.is_set()


async def test_an_operator_certificate_may_drain(tls_agent: Agent, pki: Pki) -> None:
    base = f"https://127.0.0.1:{tls_agent.admin_port}"
    assert await call("POST", f"{base}/drain", client(pki, pki.operator)) == (202, {"draining": True})
    assert tls_agent.stop_requested.is_set()


async def test_plaintext_client_is_not_served(tls_agent: Agent) -> None:
    with pytest.raises(aiohttp.ClientError):
        await call("GET", f"http://127.0.0.1:{tls_agent.admin_port}/healthz")


async def test_advertised_restore_url_follows_tls(tls_agent: Agent, tmp_path: Path) -> None:
    engine = llama_engine()
    assert (
        tls_agent.slot_restore_url(engine) == f"https://127.0.0.1:{tls_agent.admin_port}{RESTORE_CHAIN_PATH}"
    )
    plain = await running(tmp_path / "plain", None)
    try:
        assert plain.slot_restore_url(engine) == f"http://127.0.0.1:{plain.admin_port}{RESTORE_CHAIN_PATH}"
    finally:
        await plain.aclose()


async def test_without_tls_the_admin_api_is_plaintext_and_open(tmp_path: Path) -> None:
    agent = await running(tmp_path, None)
    base = f"http://127.0.0.1:{agent.admin_port}"
    try:
        assert await call("GET", f"{base}/healthz") == (200, {"status": "ok"})
        status, answer = await call(
            "POST", base + RESTORE_CHAIN_PATH, None, {"engine": "x", "digests": [DIGEST]}
        )
        assert status == 404 and answer["error"]["code"] == 404
        assert await call("POST", f"{base}/drain") == (202, {"draining": True})
        assert agent.stop_requested.is_set()
    finally:
        await agent.aclose()


def test_unusable_certificate_files_are_a_config_error(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(AgentConfigError, match=r"agent\.tls: cannot load"):
        server_context(TLSFiles(str(pki.agent.cert), str(tmp_path / "missing.key"), str(pki.agent.ca)))


async def served_identity(port: int, pki: Pki) -> list[str]:
    """The identity URIs of the certificate the admin listener serves to a new connection."""
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client(pki, pki.gateway))
    try:
        return peercert_uris(writer.get_extra_info("peercert"))
    finally:
        writer.close()
        await writer.wait_closed()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_rotated_admin_certificate_is_served_to_the_next_connection(
    tmp_path: Path, pki: Pki, loop: str
) -> None:
    """The admin listener follows rotation (``runtime.tls.ReloadingServerContext``), under asyncio and
    uvloop (``kvgate agent`` runs under uvloop): a half-done rotation (new key, old certificate) keeps the
    pair in force, the completed one is served to the next connection, and the POST check still holds."""
    mine = copy_of(pki.agent, tmp_path)
    assert mine.cert is not None and mine.key is not None and mine.ca is not None
    files = TLSFiles(str(mine.cert), str(mine.key), str(mine.ca))

    async def main() -> None:
        agent = await running(tmp_path, files)
        try:
            port = agent.admin_port
            assert await served_identity(port, pki) == [identity_uri("agent-node-a")]
            fresh = issue(mine.ca.parent, f"agent-node-a-{loop}", LOCAL_SANS, dt.datetime.now(dt.UTC))
            os.replace(fresh.key, mine.key)  # the key landed, the certificate not yet
            assert await served_identity(port, pki) == [identity_uri("agent-node-a")]
            os.replace(fresh.cert, mine.cert)
            assert await served_identity(port, pki) == [identity_uri(f"agent-node-a-{loop}")]
            base = f"https://127.0.0.1:{port}"
            status, _ = await call("POST", f"{base}/drain", client(pki, pki.wrong["kvcached"]))
            assert status == 403
            status, _ = await call("GET", f"{base}/healthz", client(pki, None))
            assert status == 200
        finally:
            await agent.aclose()

    if loop == "uvloop":
        uvloop.run(main())
    else:
        asyncio.run(main())
