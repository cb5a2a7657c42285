"""Tenant KV isolation end to end: real Envoy, the dev OIDC issuer, the ext_proc's tenants with
``[auth] kv_isolation``, and one simulated vLLM replica that honours ``cache_salt`` (its prefix cache and
its ``usage.prompt_tokens_details.cached_tokens`` follow the salt, as vLLM's do).

Two tenants send the same prompt to the same engine: neither ever gets cached tokens from the other's
requests, and each still hits its own cache; a client's own ``cache_salt`` cannot reach across."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvgate.dev.auth import StackAuth
from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM
from tests.e2e.test_auth import post, token

pytestmark = pytest.mark.e2e
TENANTS = (
    {"id": "acme", "models": ["*"], "match": {"claims": {"tenant": "acme"}}},
    {"id": "beta", "models": ["*"], "match": {"claims": {"tenant": "beta"}}},
)
CLIENTS = (
    {"client_id": "acme-client", "client_secret": "secret-acme-iso-x9", "claims": {"tenant": "acme"}},
    {"client_id": "beta-client", "client_secret": "secret-beta-iso-x9", "claims": {"tenant": "beta"}},
)
PROMPT = "A long instruction both tenants happen to send, word for word, to the same engine. " * 8


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    auth = StackAuth(tenants=TENANTS, clients=CLIENTS, settings={"kv_isolation": True}, dev_key=False)
    options = StackOptions(
        replicas=1, port=0, sim_args=FAST_SIM, workdir=tmp_path_factory.mktemp("iso"), auth=auth
    )
    with Stack(options) as running:
        yield running


def cached(gw: Stack, credential: str, content: str, **body: Any) -> int:
    resp = post(gw, credential, messages=[{"role": "user", "content": content}], max_tokens=2, **body)
    assert resp.status_code == 200, resp.text
    details = resp.json()["usage"].get("prompt_tokens_details") or {}
    got: int = details.get("cached_tokens") or 0
    return got


def test_tenants_never_share_cached_tokens_and_each_hits_its_own(gw: Stack) -> None:
    acme, beta = token(gw, "acme"), token(gw, "beta")
    assert cached(gw, acme, PROMPT) == 0
    assert cached(gw, acme, PROMPT) > 0  # its own cache
    assert cached(gw, beta, PROMPT) == 0  # the same prompt on the same engine: nothing of acme's
    assert cached(gw, beta, PROMPT) > 0
    # a client's own salt keeps its requests apart within its tenant, and never reaches another's
    assert cached(gw, beta, PROMPT, cache_salt="mine") == 0
    assert cached(gw, beta, PROMPT, cache_salt="mine") > 0
    other = "Another instruction only acme sends at first. " * 8
    first = cached(gw, acme, other)  # at most acme's own copy of the chat template's preamble
    assert cached(gw, acme, other) > first
    assert cached(gw, beta, other, cache_salt="mine") <= first  # its own preamble at most, never acme's
