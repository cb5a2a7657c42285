"""End to end with authentication: real Envoy (jwt_authn fetching the dev issuer's JWKS remotely,
local_ratelimit), the ext_proc's tenants, API keys and token budgets, simulated engines.

Tokens are signed by the dev OIDC issuer (a child process on 127.0.0.1:0) or, for the forged ones, with
its own key file. The last test greps every log of the run for the prompts, tokens and keys used.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from extproc.admission.keys import hash_key, read_keys
from kvgate import apikey
from kvgate.dev.auth import StackAuth
from kvgate.dev.tokens import SigningKey, bad_signature, mint, tampered, unsigned
from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
#: In every prompt sent here: it must never appear in a log.
MARKER = "zebra-quokka-41729"
#: Every credential used here (tokens, API keys, client secrets): none may appear in a log.
SECRETS: set[str] = set()

TENANTS = (
    {"id": "acme", "models": ["SmolLM2-*"], "match": {"claims": {"tenant": "acme"}}},
    {"id": "narrow", "models": ["other-*"], "match": {"groups": ["narrow"]}},
    {
        "id": "slow",
        "models": ["*"],
        "match": {"claims": {"tenant": "slow"}},
        "rate": {"requests_per_s": 0.2, "burst": 2},
    },
    {
        "id": "thrifty",
        "models": ["*"],
        "match": {"claims": {"tenant": "thrifty"}},
        "tokens": {"per_minute": 600},
    },
    {"id": "keys", "models": ["*"]},  # reachable by API key only
)
CLIENTS = tuple(
    {"client_id": f"{name}-client", "client_secret": f"secret-{name}-{i}-x9", "claims": claims}
    for i, (name, claims) in enumerate(
        [
            ("acme", {"tenant": "acme"}),
            ("narrow", {"groups": ["narrow", "other"]}),
            ("slow", {"tenant": "slow"}),
            ("thrifty", {"tenant": "thrifty"}),
            ("ghost", {"tenant": "nobody"}),
        ]
    )
)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    auth = StackAuth(tenants=TENANTS, clients=CLIENTS, settings={"settle": "usage"}, dev_key=False)
    options = StackOptions(
        replicas=2, port=0, sim_args=FAST_SIM, workdir=tmp_path_factory.mktemp("auth"), auth=auth
    )
    SECRETS.update(c["client_secret"] for c in CLIENTS)
    with Stack(options) as running:
        yield running


def token(stack: Stack, client: str) -> str:
    """A real access token from the issuer's token endpoint (client_secret_basic)."""
    assert stack.auth is not None
    (c,) = [c for c in stack.auth.clients if c["client_id"] == f"{client}-client"]
    resp = httpx.post(
        f"{stack.auth.issuer}/token",
        data={"grant_type": "client_credentials"},
        auth=(c["client_id"], c["client_secret"]),
    )
    assert resp.status_code == 200, resp.text
    access: str = resp.json()["access_token"]
    SECRETS.add(access)
    return access


def post(
    stack: Stack,
    credential: str | None,
    model: str = MODEL,
    headers: dict[str, str] | None = None,
    **body: Any,
) -> httpx.Response:
    hs = {"content-type": "application/json", **(headers or {})}
    if credential is not None:
        hs["authorization"] = f"Bearer {credential}"
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": f"{MARKER} hello"}],
        "max_tokens": 4,
        **body,
    }
    return httpx.post(f"{stack.url}/v1/chat/completions", json=payload, headers=hs, timeout=30)


def error(resp: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    err: dict[str, Any] = resp.json()["error"]
    assert err["type"] == kind and err["message"] and "x-kvgate-replica" not in resp.headers
    return err


def test_no_credentials_is_401(gw: Stack) -> None:
    err = error(post(gw, None), 401, "invalid_request_error")
    assert err["code"] == "missing_credentials"
    error(post(gw, None, headers={"x-kvgate-tenant": "acme"}), 401, "invalid_request_error")
    resp = httpx.get(f"{gw.url}/v1/models")
    error(resp, 401, "invalid_request_error")


def test_valid_token_via_the_openai_sdk(gw: Stack) -> None:
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=token(gw, "acme"), max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"{MARKER} hi"}], max_tokens=3
    )
    assert reply.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"{MARKER} stream"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert [m.id for m in client.models.list()] == [MODEL]


def forged(gw: Stack, kind: str) -> str:
    """A bad token, signed (where it is signed) with the issuer's real key."""
    assert gw.auth is not None
    key = SigningKey.load_or_create(gw.auth.key_file)
    now = int(time.time())
    claims = {
        "iss": gw.auth.issuer,
        "aud": "kvgate",
        "sub": "mallory",
        "tenant": "acme",
        "iat": now,
        "exp": now + 300,
    }
    tokens = {
        "expired": lambda: mint({**claims, "iat": now - 7200, "exp": now - 3600}, key),
        "wrong-issuer": lambda: mint({**claims, "iss": "http://127.0.0.1:1"}, key),
        "wrong-audience": lambda: mint({**claims, "aud": "someone-else"}, key),
        "alg-none": lambda: unsigned(claims),
        "bad-signature": lambda: bad_signature(mint(claims, key)),
        "other-key": lambda: mint(claims, SigningKey.generate()),
        "tampered-claims": lambda: tampered(token(gw, "narrow"), tenant="acme", groups=[]),
        "no-expiry": lambda: mint({k: v for k, v in claims.items() if k != "exp"}, key),
    }
    forged_token = tokens[kind]()
    SECRETS.add(forged_token)
    return forged_token


@pytest.mark.parametrize(
    "kind",
    [
        "expired",
        "wrong-issuer",
        "wrong-audience",
        "alg-none",
        "bad-signature",
        "other-key",
        "tampered-claims",
        "no-expiry",
    ],
)
def test_bad_tokens_are_401(gw: Stack, kind: str) -> None:
    err = error(post(gw, forged(gw, kind)), 401, "invalid_request_error")
    assert err["code"] == "invalid_token"


def test_identity_without_a_tenant_is_403(gw: Stack) -> None:
    error(post(gw, token(gw, "ghost")), 403, "permission_error")


def test_model_outside_scope_is_403(gw: Stack) -> None:
    narrow = token(gw, "narrow")
    err = error(post(gw, narrow), 403, "permission_error")
    assert err["code"] == "model_not_allowed" and err["param"] == "model"
    # A client-sent tenant header changes nothing: the tenant comes from the verified token.
    error(post(gw, narrow, headers={"x-kvgate-tenant": "acme"}), 403, "permission_error")
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=narrow, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": MARKER}])


def test_request_rate_429_with_ratelimit_headers(gw: Stack) -> None:
    slow = token(gw, "slow")
    # The client claims another tenant's bucket: ignored (stripped by Envoy, overwritten by the ext_proc).
    spoof = {"x-kvgate-tenant": "acme"}
    assert [post(gw, slow, headers=spoof).status_code for _ in range(2)] == [200, 200]  # burst 2
    resp = post(gw, slow, headers=spoof)
    error(resp, 429, "rate_limit_error")
    assert resp.headers["x-ratelimit-limit"] == "2" and resp.headers["x-ratelimit-remaining"] == "0"
    assert 1 <= int(resp.headers["x-ratelimit-reset"]) <= 5 and resp.headers["retry-after"] == "5"
    assert post(gw, token(gw, "acme")).status_code == 200  # other tenants are not affected


def test_token_budget_429_with_retry_after(gw: Stack) -> None:
    thrifty = token(gw, "thrifty")
    # 600-token bucket; each request reserves ~20 prompt + 250 output tokens, settled to what it used.
    statuses = [post(gw, thrifty, max_tokens=250).status_code for _ in range(2)]
    assert statuses == [200, 200]
    resp = post(gw, thrifty, max_tokens=250)
    err = error(resp, 429, "rate_limit_error")
    assert err["code"] == "tokens_exceeded" and 1 <= int(resp.headers["retry-after"]) <= 60
    err = error(post(gw, thrifty, max_tokens=5000), 429, "rate_limit_error")
    assert err["code"] == "request_too_large"


def test_api_keys_valid_then_revoked_at_once(gw: Stack) -> None:
    assert gw.auth is not None
    keys_file = gw.auth.api_keys_file
    key, record = apikey.create(keys_file, "keys", "e2e", int(time.time()))
    SECRETS.add(key)
    SECRETS.add(record.hash.split("$")[1])
    assert key not in keys_file.read_text() and read_keys(keys_file).lookup(key) is not None
    assert hash_key(key) in keys_file.read_text()
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": MARKER}], max_tokens=2
    )
    assert reply.choices[0].message.content
    apikey.revoke(keys_file, record.id, int(time.time()))
    err = error(post(gw, key), 401, "invalid_request_error")  # the very next request
    assert err["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": MARKER}])
    error(post(gw, "sk-kvg-not-a-real-key"), 401, "invalid_request_error")


def test_no_prompt_token_or_key_in_any_log(gw: Stack) -> None:
    """Runs last: every log of the run (Envoy, ext_proc, simulators, issuer) is free of secrets."""
    assert len(SECRETS) > 15
    logs = sorted(gw.workdir.glob("*.log"))
    assert {p.stem for p in logs} >= {"envoy", "extproc", "sim-0", "sim-1", "oidc"}
    assert any(p.stat().st_size > 0 for p in logs)
    for path in logs:
        text = path.read_text(errors="replace")
        assert MARKER not in text, f"a prompt leaked into {path.name}"
        leaked = [s[:12] + "..." for s in SECRETS if s in text]
        assert not leaked, f"credentials leaked into {path.name}: {leaked}"
        assert "sk-kvg-" not in text and "eyJ" not in text, path.name
