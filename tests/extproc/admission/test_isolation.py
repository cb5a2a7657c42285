"""Tenant KV isolation: the per-tenant cache salt, its configuration, and what the processor sends."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest

from contracts.errors import ConfigError
from extproc.admission.config import parse_auth, parse_tenant
from extproc.admission.gate import AuthConfig, Gate, JwtConfig
from extproc.admission.isolation import isolates, tenant_salt
from extproc.admission.tenants import Tenant, Tenants
from extproc.flow.control import FlowControl
from extproc.models.registry import ModelAssets
from extproc.processor import ProcessorConfig, StreamProcessor
from extproc.routing.request import Kind, parse_body
from extproc.routing.router import Router
from tests.extproc.burst.test_processor_burst import burst_reply, burster, policy
from tests.extproc.flow.test_processor_flow import fill
from tests.extproc.test_processor import (
    ACME,
    KEYS,
    LIMIT,
    MODEL,
    WIDE,
    chat,
    clock,
    jwt,
    make_router,
    processor,
    reply,
    route,
)

IDP = JwtConfig("https://idp", ("kvgate",), jwks_uri="https://idp/jwks")


@pytest.fixture(scope="module")
def smol(model_dir: str) -> ModelAssets:
    return ModelAssets.load(MODEL, Path(model_dir), max_model_len=1 << 20)


@pytest.fixture
def router(smol: ModelAssets) -> Router:
    return make_router(smol)


def test_the_salt_separates_tenants_and_client_salts_and_is_a_valid_cache_salt() -> None:
    salts = {tenant_salt(t, c) for t in ("acme", "beta") for c in (None, "s1", "s2")}
    assert len(salts) == 6
    assert tenant_salt("acme", None) == tenant_salt("acme", "")  # no salt and an empty one are alike
    assert tenant_salt("acme", "x") == tenant_salt("acme", "x")  # deterministic: one tenant's cache stays
    for salt in salts:  # what vLLM accepts (the gateway's own parser applies vLLM's rules)
        body = orjson.dumps({"model": "m", "prompt": "p", "cache_salt": salt})
        assert parse_body(Kind.COMPLETION, body).cache_salt == salt


@pytest.mark.parametrize(
    ("default", "own", "expected"),
    [(False, None, False), (True, None, True), (True, False, False), (False, True, True)],
)
def test_a_tenants_own_setting_wins_over_the_default(default: bool, own: bool | None, expected: bool) -> None:
    tenant = Tenant("t", ("*",), kv_isolation=own)
    assert isolates(AuthConfig(jwt=IDP, kv_isolation=default), tenant) is expected


def test_configuration_and_bad_values() -> None:
    idp = {"issuer": "https://idp", "audiences": ["kvgate"], "jwks_uri": "https://idp/jwks"}
    auth = parse_auth({"jwt": idp, "kv_isolation": True})
    assert auth is not None and auth.kv_isolation
    tenant = {"id": "t", "models": ["*"]}
    assert parse_tenant({**tenant, "kv_isolation": False}, "tenants[0]").kv_isolation is False
    assert parse_tenant(tenant, "tenants[0]").kv_isolation is None
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.kv_isolation: expected true or false"):
        parse_tenant({**tenant, "kv_isolation": "yes"}, "tenants[0]")
    with pytest.raises(ConfigError, match=r"auth\.kv_isolation"):
        parse_auth({"jwt": idp, "kv_isolation": 1})


def sent(router: Router, gate: Gate, claims: dict[str, Any], **body: Any) -> tuple[dict[str, Any], Any]:
    """Route one chat as the caller of ``claims``: the body the engine gets and the decision."""
    proc = processor(router, gate)
    r = reply(route(proc, chat(**body), meta=jwt(claims)))
    assert proc.decision is not None
    return orjson.loads(b"".join(c for c, _ in r.chunks)), proc.decision


def test_isolated_tenants_get_their_own_salt_and_their_own_digests(router: Router) -> None:
    gate = Gate(AuthConfig(jwt=IDP, default_max_tokens=100, kv_isolation=True), Tenants([ACME, WIDE]), KEYS)
    acme = {"sub": "u", "tenant": "acme"}
    wide = {"sub": "v", "groups": ["wide"]}
    a1, d1 = sent(router, gate, acme, content="the same long shared prompt " * 20)
    a2, d2 = sent(router, gate, acme, content="the same long shared prompt " * 20, cache_salt="evil")
    w1, d3 = sent(router, gate, wide, content="the same long shared prompt " * 20)
    assert a1["cache_salt"] == tenant_salt("acme", None)
    assert a2["cache_salt"] == tenant_salt("acme", "evil")  # the client's salt stays within its tenant
    assert w1["cache_salt"] == tenant_salt("wide", None)
    assert len({a1["cache_salt"], a2["cache_salt"], w1["cache_salt"]}) == 3
    # the router's chain follows the salt: no digest of one tenant's prompt is the other's
    assert d1.digests[0] != d3.digests[0] and d1.digests[0] != d2.digests[0]
    again, d4 = sent(router, gate, acme, content="the same long shared prompt " * 20)
    assert again["cache_salt"] == a1["cache_salt"] and d4.digests[0] == d1.digests[0]


def test_without_isolation_the_clients_salt_goes_through(router: Router) -> None:
    gate = Gate(AuthConfig(jwt=IDP, default_max_tokens=100), Tenants([ACME, WIDE]), KEYS)
    body, _ = sent(router, gate, {"sub": "u", "tenant": "acme"}, cache_salt="mine")
    assert body["cache_salt"] == "mine"
    body, _ = sent(router, gate, {"sub": "u", "tenant": "acme"})
    assert "cache_salt" not in body
    opted = Tenants([dataclasses.replace(ACME, kv_isolation=True), WIDE])
    gate = Gate(AuthConfig(jwt=IDP, default_max_tokens=100), opted, KEYS)
    body, _ = sent(router, gate, {"sub": "u", "tenant": "acme"})
    assert body["cache_salt"] == tenant_salt("acme", None)


def test_a_tenant_without_isolation_cannot_send_an_isolated_tenants_salt(router: Router) -> None:
    """The salt formula has no secret: a client of a tenant the gateway does not salt may not use the
    gateway's namespace (it could name acme's salt and share acme's blocks); an isolated tenant's client
    may (its salt is mixed with its own tenant anyway)."""
    opted = Tenants([dataclasses.replace(ACME, kv_isolation=True), WIDE])
    gate = Gate(AuthConfig(jwt=IDP, default_max_tokens=100), opted, KEYS)
    forged = tenant_salt("acme", None)
    proc = processor(router, gate)
    out = route(proc, chat(cache_salt=forged), meta=jwt({"sub": "v", "groups": ["wide"]}))
    assert out[0].immediate_response.status.code == 400
    error = orjson.loads(out[0].immediate_response.body)["error"]
    assert error["code"] == "reserved_cache_salt" and error["param"] == "cache_salt"
    assert proc.decision is None
    body, _ = sent(router, gate, {"sub": "u", "tenant": "acme"}, cache_salt=forged)
    assert body["cache_salt"] == tenant_salt("acme", forged) != forged


def test_a_burst_request_leaves_the_tenants_salt_behind(router: Router) -> None:
    """The salt is this fleet's: a request sent to a hosted endpoint (burst) carries none (OpenAI's API
    refuses unknown fields), while the same tenant's local requests keep it."""
    gate = Gate(AuthConfig(jwt=IDP, default_max_tokens=100, kv_isolation=True), Tenants([ACME, WIDE]), KEYS)
    control: FlowControl[StreamProcessor] = FlowControl(policy(10))
    fill(router, control)  # every engine at its limit: the next request would wait, so it bursts
    config = ProcessorConfig(max_body_bytes=LIMIT, hold_timeout_s=600.0, burst=burster())
    proc = StreamProcessor(router, config, clock, gate, control)
    _, _, body = burst_reply(route(proc, chat(cache_salt="mine"), meta=jwt({"sub": "u", "tenant": "acme"})))
    assert body["model"] == "hosted-model" and "cache_salt" not in body
