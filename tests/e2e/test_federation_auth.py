"""End to end: federation with ``[auth]`` on both clusters (``extproc/federation/README.md``: tenants across
clusters). Two clusters on loopback, each with its own etcd, Envoy, gateway, dev OIDC issuer, node agent
and simulated replica (it honours ``cache_salt``), ``kv_isolation`` on in both, linked by mTLS; B's link
to A trusts the tenants A asserts.

A client of tenant ``acme`` at A (A's own token, through the OpenAI SDK) sends a long prompt that only
B's ``acme`` requests warmed: A forwards it without the client's credentials, asserting ``acme`` and its
tenant salt; B admits it as its own ``acme`` (charged to acme's budget in B, published in B's etcd
``usage/acme/``), keeps the salt, and serves it from the cache acme warmed there. A client sending the
assertion headers itself gets nothing from them; an unlinked mTLS identity is refused; with the link's
trust withdrawn B answers a forward 401 and A serves the request itself.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import ssl
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from certs.store import LeafFiles, dev_bundle
from contracts.etcd import EtcdSettings
from contracts.federation import REFUSED_HEADER
from kvgate.dev.auth import StackAuth
from kvgate.dev.up import Stack
from runtime.etcd import connect
from tests.e2e.test_auth import token
from tests.e2e.test_federation import MODEL, SHARED, _link, _put, _stack, ingress, metric, warm_in_b
from tests.polling import poll

pytestmark = pytest.mark.e2e
TENANTS = (
    {
        "id": "acme",
        "models": ["*"],
        "match": {"claims": {"tenant": "acme"}},
        "tokens": {"per_minute": 1_000_000},
    },
    {
        "id": "beta",
        "models": ["*"],
        "match": {"claims": {"tenant": "beta"}},
        "tokens": {"per_minute": 1_000_000},
    },
)
TRUST = {"trust_tenants": True, "tenants": ["acme", "beta"]}


def _auth(cluster: str) -> StackAuth:
    clients = tuple(
        {"client_id": f"{t}-client", "client_secret": f"secret-{t}-{cluster}-fed9", "claims": {"tenant": t}}
        for t in ("acme", "beta")
    )
    return StackAuth(tenants=TENANTS, clients=clients, settings={"kv_isolation": True}, dev_key=False)


def _trusting(peer: Stack, name: str, **extra: Any) -> bytes:
    return json.dumps({**json.loads(_link(peer, name)), **extra}).encode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LeafFiles]:
    names = ["federation-a", "federation-b", "federation-c"]  # c: the same CA, linked nowhere
    return dev_bundle(tmp_path_factory.mktemp("pki"), names, dt.datetime.now(dt.UTC))


@pytest.fixture(scope="module")
def clusters(
    tmp_path_factory: pytest.TempPathFactory, pki: dict[str, LeafFiles]
) -> Iterator[tuple[Stack, Stack]]:
    a = _stack(tmp_path_factory.mktemp("a"), "a", pki["federation-a"], _auth("a"))
    try:
        b = _stack(tmp_path_factory.mktemp("b"), "b", pki["federation-b"], _auth("b"))
    except BaseException:
        a.stop()
        raise
    try:
        _put(a, "federation/b", _link(b, "b"))
        _put(b, "federation/a", _trusting(a, "a", **TRUST))
        poll(lambda: True if metric(a, "kvgate_federation_peer_up", peer="b") == 1 else None, 20, "b at a")
        yield a, b
    finally:
        b.stop()
        a.stop()


def sdk(stack: Stack, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=token(stack, tenant), max_retries=0, timeout=30)


def ask(client: openai.OpenAI, prompt: str, **kw: Any) -> tuple[str, int, int]:
    """(the endpoint Envoy sent it to, prompt tokens, cached tokens) of one chat completion."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2, **kw
    )
    done = raw.parse()
    assert done.usage is not None
    details = done.usage.prompt_tokens_details
    return (
        raw.headers["x-kvgate-endpoint"],
        done.usage.prompt_tokens,
        (details.cached_tokens or 0) if details else 0,
    )


def usage(stack: Stack, tenant: str) -> int:
    """What ``stack``'s gateways charged ``tenant`` (its etcd ``usage/<tenant>/<replica>`` counters)."""
    assert stack.etcd is not None

    async def read() -> int:
        client = await connect(EtcdSettings(endpoints=(stack.etcd.address,)))  # type: ignore[union-attr]
        try:
            assert client.kv is not None
            got = await client.kv.get(f"/kvgate/usage/{tenant}/", f"/kvgate/usage/{tenant}0", timeout=5.0)
            return sum(int(bytes(kv.value)) for kv in got.kvs)
        finally:
            await client.close()

    return asyncio.run(read())


def direct(b: Stack, leaf: LeafFiles, headers: dict[str, str], *, present: bool = True) -> httpx.Response:
    """A request straight to B's federation listener, presenting ``leaf``'s certificate (or none)."""
    context = ssl.create_default_context(cafile=str(leaf.ca))
    context.check_hostname = False
    if present:
        context.load_cert_chain(str(leaf.cert), str(leaf.key))
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
    return httpx.post(
        f"https://{ingress(b)}/v1/chat/completions", json=payload, headers=headers, verify=context, timeout=10
    )


def test_a_forwarded_request_is_admitted_as_its_tenant_at_the_peer_and_charged_there(
    clusters: tuple[Stack, Stack],
) -> None:
    a, b = clusters
    prompt = f"acme 1 {SHARED}"
    charged_b, beta_b = usage(b, "acme"), usage(b, "beta")
    warm_in_b(a, b, lambda: ask(sdk(b, "acme"), prompt))
    endpoint, prompt_tokens, cached = ask(sdk(a, "acme"), prompt)
    assert endpoint == ingress(b)  # forwarded to B's federation listener, admitted there (no 401)
    # B kept A's tenant salt (it is B's own for acme's requests): served from the cache acme warmed in B
    assert cached >= 0.8 * prompt_tokens
    assert metric(b, "kvgate_federation_decisions_total", reason="hop") >= 1
    assert metric(b, "kvgate_federation_inbound_admissions_total", peer="a", result="admitted") >= 1
    # charged to acme in B (B's gateway publishes its charges to B's etcd): the warm request and this one
    both = charged_b + 2 * prompt_tokens
    poll(lambda: True if usage(b, "acme") >= both else None, 10, "acme's charges in b", interval_s=0.1)
    assert usage(b, "beta") == beta_b


def test_another_tenants_warm_prefix_is_not_anothers_across_clusters(clusters: tuple[Stack, Stack]) -> None:
    """beta warmed a prompt in B; acme's copy of it at A carries acme's salt: nothing of beta's is shared,
    so A has no reason to forward it (and B would not hit beta's cache if it did)."""
    a, b = clusters
    prompt = f"beta 2 {SHARED}"
    warm_in_b(a, b, lambda: ask(sdk(b, "beta"), prompt))
    endpoint, _, cached = ask(sdk(a, "acme"), prompt)
    assert endpoint != ingress(b) and cached == 0


def test_the_assertion_headers_from_anyone_but_a_linked_identity_count_for_nothing(
    clusters: tuple[Stack, Stack], pki: dict[str, LeafFiles]
) -> None:
    _, b = clusters
    forged = {"x-kvgate-tenant": "acme", "x-kvgate-kv-salted": "1", "x-kvgate-hop": "a"}
    # a client at B's public listener: no credentials, no admission; its own credentials: its own tenant
    public = httpx.post(
        f"{b.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2},
        headers=forged,
        timeout=10,
    )
    assert public.status_code == 401 and public.json()["error"]["code"] == "missing_credentials"
    acme_b = usage(b, "acme")
    beta_b = usage(b, "beta")
    _, prompt_tokens, _ = ask(sdk(b, "beta"), f"beta 3 {SHARED}", extra_headers=forged)
    poll(
        lambda: True if usage(b, "beta") >= beta_b + prompt_tokens else None,
        10,
        "beta's charge",
        interval_s=0.1,
    )
    assert usage(b, "acme") < acme_b + prompt_tokens  # (a late settle of an earlier request moves it a token)
    # a certificate of B's CA whose identity no link names (a link removed): refused for its fallback
    unlinked = direct(b, pki["federation-c"], forged)
    assert unlinked.status_code == 401 and unlinked.json()["error"]["code"] == "federation_untrusted"
    assert unlinked.headers["x-kvgate-federation-refused"] == "federation_untrusted"
    # no certificate at all: B's federation listener refuses the handshake
    with pytest.raises(httpx.HTTPError):
        direct(b, pki["federation-a"], forged, present=False)
    # A's identity, which B's link trusts: the salted flag on a body with no tenant salt is refused ...
    flagged = direct(b, pki["federation-a"], forged)
    assert flagged.status_code == 403 and flagged.json()["error"]["code"] == "bad_tenant_salt"
    assert flagged.headers["x-kvgate-federation-refused"] == "bad_tenant_salt"
    # ... and without the flag it is admitted as acme
    plain = {k: v for k, v in forged.items() if k != "x-kvgate-kv-salted"}
    linked = direct(b, pki["federation-a"], plain)
    assert linked.status_code == 200, linked.text


def test_a_peer_whose_link_does_not_trust_tenants_answers_401_and_a_serves_it(
    clusters: tuple[Stack, Stack], pki: dict[str, LeafFiles]
) -> None:
    a, b = clusters
    prompt = f"acme 4 {SHARED}"
    warm_in_b(a, b, lambda: ask(sdk(b, "acme"), prompt))
    _put(b, "federation/a", _link(a, "a"))  # the link without trust_tenants
    asserted = {"x-kvgate-tenant": "acme", "x-kvgate-hop": "a"}
    try:
        refused = poll(
            lambda: r if (r := direct(b, pki["federation-a"], asserted)).status_code == 401 else None,
            10,
            "b applying the link without trust",
            interval_s=0.1,
        )
        assert refused.json()["error"]["code"] == "federation_untrusted"
        assert refused.headers[REFUSED_HEADER] == "federation_untrusted"
        forwards = metric(a, "kvgate_federation_forwards_total", peer="b")
        endpoint, _, _ = ask(sdk(a, "acme"), prompt)  # never fails because of federation
        # it was forwarded
        assert metric(a, "kvgate_federation_forwards_total", peer="b") == forwards + 1
        assert endpoint != ingress(b)  # B refused it; A's Envoy retried it on A's own pick
        refusals = metric(
            b, "kvgate_federation_inbound_admissions_total", peer="a", result="federation_untrusted"
        )
        assert refusals >= 2  # the direct try above and A's forward
        # the refused try reached A's failed-try log: B is skipped a while (a link-wide refusal)
        refused = {"peer": "b", "outcome": "refused"}
        poll(
            lambda: True if metric(a, "kvgate_federation_forward_outcomes_total", **refused) >= 1 else None,
            5,
            "refused",
        )
    finally:
        _put(b, "federation/a", _trusting(a, "a", **TRUST))
