"""Tenants across clusters (``extproc/federation/tenancy.py``), in memory: the link options, whom a
forwarded request is admitted as at the peer, what the forwarding cluster sends (the tenant, its salt
flag, never the client's credentials), and that nobody but a linked identity can assert a tenant or a
salt."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from contracts.digest import Digest
from contracts.epp import EXTPROC_ATTRIBUTES, TENANT_HEADER
from contracts.errors import ConfigError
from contracts.federation import CLIENT_SALT_HEADER, HOP_HEADER, REFUSED_HEADER, SALTED_HEADER
from extproc.admission.gate import AuthConfig, Gate, JwtConfig
from extproc.admission.isolation import tenant_salt
from extproc.admission.tenants import Tenant, TenantMatch, Tenants, TokenLimit
from extproc.errors import Forbidden, Unauthorized
from extproc.federation.forwarding import PEER_ATTRIBUTE, Forwarder
from extproc.federation.links import Link, parse_link
from extproc.federation.tenancy import asserted_principal
from extproc.federation.trust import Inbound
from extproc.processor import ProcessorConfig, StreamProcessor
from tests.extproc.federation.test_processor_forward import (
    B_ID,
    INGRESS_B,
    LOCAL,
    LONG,
    MODEL,
    chain_of,
    forwarder,
    router,
    warm_in_b,
)
from tests.extproc.test_processor import body, error, headers, jwt, reply

IDP = JwtConfig("https://idp", ("kvgate",), jwks_uri="https://idp/jwks")
ACME = Tenant(
    "acme", ("*",), TenantMatch(claims=(("tenant", frozenset({"acme"})),)), tokens=TokenLimit(600, 10_000)
)
GUEST = Tenant("guest", ("*",), tokens=TokenLimit(600, 10_000))
LINK = {
    "cluster": "b",
    "ingress": INGRESS_B,
    "service": "10.9.0.1:9500",
    "identity": B_ID,
    "rtt_ms": 20,
    "egress_requests_per_s": 100,
    "egress_bytes_per_s": 1e9,
}
FROM_B = Inbound(forwarded_by="b", tenant="acme")


def link(**kw: Any) -> Link:
    return parse_link({**LINK, **kw}, "federation.links[0]")


def gate(isolation: bool = False) -> Gate:
    return Gate(
        AuthConfig(jwt=IDP, default_max_tokens=100, kv_isolation=isolation), Tenants([ACME, GUEST]), None
    )


def test_link_options_and_bad_values() -> None:
    assert link().trust_tenants is False and link().tenants == () and link().default_tenant is None
    full = link(trust_tenants=True, tenants=["acme", "beta"], default_tenant="guest")
    assert (full.trust_tenants, full.tenants, full.default_tenant) == (True, ("acme", "beta"), "guest")
    with pytest.raises(ConfigError, match="need trust_tenants = true"):
        link(tenants=["acme"])
    with pytest.raises(ConfigError, match="need trust_tenants = true"):
        link(default_tenant="guest")
    with pytest.raises(ConfigError, match=r"links\[0\]\.tenants: tenant ids"):
        link(trust_tenants=True, tenants=["no spaces"])
    with pytest.raises(ConfigError, match=r"default_tenant: tenant ids"):
        link(trust_tenants=True, default_tenant="-x")
    with pytest.raises(ConfigError, match="trust_tenants"):
        link(trust_tenants="yes")


def test_whom_a_forwarded_request_is_admitted_as() -> None:
    tenants = Tenants([ACME, GUEST])
    principal = asserted_principal(FROM_B, link(trust_tenants=True), tenants)
    assert (principal.tenant, principal.via, principal.who) == (ACME, "federation", "b")
    # unknown here: the link's default tenant, else 403
    unknown = Inbound(forwarded_by="b", tenant="zeta")
    assert (
        asserted_principal(unknown, link(trust_tenants=True, default_tenant="guest"), tenants).tenant == GUEST
    )
    none = Inbound(forwarded_by="b")
    assert asserted_principal(none, link(trust_tenants=True, default_tenant="guest"), tenants).tenant == GUEST
    for came in (unknown, none):
        with pytest.raises(Forbidden) as refused:
            asserted_principal(came, link(trust_tenants=True), tenants)
        assert refused.value.code == "no_tenant"
    # a default naming no tenant here admits nobody
    with pytest.raises(Forbidden):
        asserted_principal(unknown, link(trust_tenants=True, default_tenant="gone"), tenants)
    # the allow-list: only the tenants listed (the default does not launder the others)
    listed = link(trust_tenants=True, tenants=["beta"], default_tenant="guest")
    with pytest.raises(Forbidden) as refused:
        asserted_principal(FROM_B, listed, tenants)
    assert refused.value.code == "tenant_not_trusted"
    # a link that does not trust tenants, or one removed meanwhile: 401
    for untrusting in (link(), None):
        with pytest.raises(Unauthorized) as denied:
            asserted_principal(FROM_B, untrusting, tenants)
        assert denied.value.code == "federation_untrusted"


# --- the processor, at the peer (this cluster "a", the request forwarded by linked "b") ------------------


def peer(fwd: Forwarder, g: Gate, *, peer_uri: str | None, extra: dict[str, str], payload: bytes) -> Any:
    proc = StreamProcessor(
        router(), ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0, g, federation=fwd
    )
    msg = headers("/v1/completions", extra=extra)
    if peer_uri is not None:
        msg.attributes[EXTPROC_ATTRIBUTES].fields[PEER_ATTRIBUTE].string_value = peer_uri
    out = proc.handle(msg)
    if out:  # refused at the headers
        return proc, out
    return proc, proc.handle(body(payload))


def completion(prompt: str = "hello there", **extra: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 5, **extra})


def test_a_trusted_peers_tenant_is_admitted_and_charged_here() -> None:
    g = gate()
    fwd = forwarder(links=[{**LINK, "trust_tenants": True}])
    before = g.budgets.level(ACME, 1000.0)
    proc, out = peer(
        fwd, g, peer_uri=B_ID, extra={HOP_HEADER: "b", TENANT_HEADER: "acme"}, payload=completion()
    )
    sent = reply(out)
    assert sent.destination == [LOCAL]  # served here, never forwarded again
    assert sent.set_headers[TENANT_HEADER] == "acme"  # this cluster's tenant (its rate limit keys on it)
    assert proc.principal is not None and proc.principal.via == "federation" and proc.principal.who == "b"
    assert proc.ticket is not None and proc.ticket.tenant == ACME
    after = g.budgets.level(ACME, 1000.0)
    assert before is not None and after is not None and after < before  # reserved against acme's budget here
    assert g.budgets.level(GUEST, 1000.0) == before
    assert fwd.admissions == {("b", "admitted"): 1}  # kvgate_federation_inbound_admissions_total


@pytest.mark.parametrize(
    ("links", "asserted", "status", "code"),
    [
        ([LINK], "acme", 401, "federation_untrusted"),  # the link lacks trust
        ([{**LINK, "trust_tenants": True, "tenants": ["guest"]}], "acme", 403, "tenant_not_trusted"),
        ([{**LINK, "trust_tenants": True}], "zeta", 403, "no_tenant"),
    ],
)
def test_a_refused_forward_says_so_for_the_forwarding_clusters_fallback(
    links: list[dict[str, Any]], asserted: str, status: int, code: str
) -> None:
    g, fwd = gate(), forwarder(links=links)
    extra = {HOP_HEADER: "b", TENANT_HEADER: asserted}
    proc, out = peer(fwd, g, peer_uri=B_ID, extra=extra, payload=completion())
    got, err, hs = error(out)
    assert (got, err["code"]) == (status, code)
    assert hs[REFUSED_HEADER] == code  # the forwarding cluster's Envoy retries it on its local pick
    assert g.failures.retry_after_s(None, 1000.0) is None and proc.ticket is None
    assert fwd.admissions == {("b", code): 1}


@pytest.mark.parametrize(
    ("peer_uri", "extra"),
    [
        (None, {TENANT_HEADER: "acme", SALTED_HEADER: "1", HOP_HEADER: "b"}),  # a client on the public side
        ("spiffe://kvgate.local/client-mallory", {TENANT_HEADER: "acme"}),  # a client certificate
    ],
)
def test_nobody_but_a_linked_identity_asserts_a_tenant(peer_uri: str | None, extra: dict[str, str]) -> None:
    fwd = forwarder(links=[{**LINK, "trust_tenants": True}])
    _, out = peer(fwd, gate(), peer_uri=peer_uri, extra=extra, payload=completion())
    status, err, hs = error(out)
    assert (status, err["code"]) == (401, "missing_credentials")  # the header counts for nothing
    assert REFUSED_HEADER not in hs


@pytest.mark.parametrize("trust", [True, False])
def test_a_federation_identity_no_link_names_is_refused_for_its_fallback(trust: bool) -> None:
    """A verified federation certificate whose link was removed (or never made): 401
    ``federation_untrusted`` with the refusal header, so the forwarding cluster serves it at home."""
    fwd = forwarder(links=[{**LINK, "trust_tenants": trust}])
    extra = {TENANT_HEADER: "acme", HOP_HEADER: "c"}
    proc, out = peer(fwd, gate(), peer_uri="spiffe://kvgate.local/federation-c", extra=extra, payload=b"")
    status, err, hs = error(out)
    assert (status, err["code"]) == (401, "federation_untrusted")
    assert hs[REFUSED_HEADER] == "federation_untrusted"
    assert proc.principal is None and proc.ticket is None


def test_a_client_asserting_another_tenant_stays_its_own() -> None:
    fwd = forwarder(links=[{**LINK, "trust_tenants": True}])
    meta = jwt({"sub": "u1", "groups": []})  # a verified token of no tenant's: the assertion does not help
    proc = StreamProcessor(
        router(), ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0, gate(), federation=fwd
    )
    status, err, _ = error(proc.handle(headers("/v1/completions", extra={TENANT_HEADER: "acme"}, meta=meta)))
    assert (status, err["code"]) == (403, "no_tenant")


@pytest.mark.parametrize(
    ("salted", "isolation"), [(True, True), (False, True), (True, False), (False, False)]
)
def test_the_peer_keeps_the_forwarding_clusters_salt_and_salts_only_what_was_not(
    salted: bool, isolation: bool
) -> None:
    fwd = forwarder(links=[{**LINK, "trust_tenants": True}])
    home_salt = tenant_salt("acme", "mine")
    told = {SALTED_HEADER: "1", CLIENT_SALT_HEADER: b"mine".hex()} if salted else {}
    extra = {HOP_HEADER: "b", TENANT_HEADER: "acme", **told}
    payload = completion(cache_salt=home_salt if salted else "mine")
    _, out = peer(fwd, gate(isolation), peer_uri=B_ID, extra=extra, payload=payload)
    sent = orjson.loads(reply(out).body)
    if salted:  # the home's tenant salt, as is: the same one this cluster gives acme's own "mine" requests
        assert sent["cache_salt"] == home_salt
        assert CLIENT_SALT_HEADER in reply(out).remove_headers  # checked: no engine here sees it
    else:
        assert sent["cache_salt"] == (tenant_salt("acme", "mine") if isolation else "mine")


@pytest.mark.parametrize(
    ("asserted", "salt"),
    [
        ("acme", None),  # the flag with no salt at all
        ("acme", "mine"),  # a client's salt, not a gateway tenant salt
        ("acme", "kvgate-nothex"),  # the prefix, not the form
        (None, tenant_salt("acme", "mine")),  # a tenant salt but no tenant asserted
    ],
)
def test_a_salted_flag_without_a_tenant_salt_is_refused_for_the_fallback(
    asserted: str | None, salt: str | None
) -> None:
    """The salted flag keeps the body's salt as is, so it must be a gateway tenant salt of an asserted
    tenant the link allows; else 403 with the refusal header (the home serves the request itself)."""
    fwd = forwarder(links=[{**LINK, "trust_tenants": True, "default_tenant": "guest"}])
    extra = {HOP_HEADER: "b", SALTED_HEADER: "1", **({TENANT_HEADER: asserted} if asserted else {})}
    payload = completion(**({"cache_salt": salt} if salt is not None else {}))
    _, out = peer(fwd, gate(True), peer_uri=B_ID, extra=extra, payload=payload)
    status, err, hs = error(out)
    assert (status, err["code"]) == (403, "bad_tenant_salt")
    assert hs[REFUSED_HEADER] == "bad_tenant_salt"


@pytest.mark.parametrize(
    ("asserted", "client", "salt"),
    [
        ("guest", None, tenant_salt("acme", None)),  # acme's salt under a tenant the link allows
        ("guest", b"".hex(), tenant_salt("acme", None)),
        ("guest", b"mine".hex(), tenant_salt("acme", "mine")),  # acme's, whatever client salt it names
        ("guest", b"mine".hex(), tenant_salt("guest", "other")),  # guest's, not with this client salt
        ("guest", "zz-not-hex", tenant_salt("acme", None)),
    ],
)
def test_a_peer_cannot_name_another_tenants_salt(asserted: str, client: str | None, salt: str) -> None:
    """A link trusted for ``guest`` only must not reach ``acme``'s KV with acme's (formula, no secret) salt:
    the salted body's salt must be the asserted tenant's with the client salt the home names."""
    fwd = forwarder(links=[{**LINK, "trust_tenants": True, "tenants": ["guest"]}])
    extra = {HOP_HEADER: "b", TENANT_HEADER: asserted, SALTED_HEADER: "1"}
    if client is not None:
        extra[CLIENT_SALT_HEADER] = client
    _, out = peer(fwd, gate(True), peer_uri=B_ID, extra=extra, payload=completion(cache_salt=salt))
    status, err, hs = error(out)
    assert (status, err["code"], hs[REFUSED_HEADER]) == (403, "bad_tenant_salt", "bad_tenant_salt")


@pytest.mark.parametrize("client", [None, "mine", "naïve"])
def test_the_asserted_tenants_own_salt_is_kept(client: str | None) -> None:
    fwd = forwarder(links=[{**LINK, "trust_tenants": True, "tenants": ["guest"]}])
    extra = {HOP_HEADER: "b", TENANT_HEADER: "guest", SALTED_HEADER: "1"}
    if client is not None:
        extra[CLIENT_SALT_HEADER] = client.encode().hex()
    salt = tenant_salt("guest", client)
    proc, out = peer(fwd, gate(True), peer_uri=B_ID, extra=extra, payload=completion(cache_salt=salt))
    assert orjson.loads(reply(out).body)["cache_salt"] == salt
    assert proc.principal is not None and proc.principal.tenant.id == "guest"


# --- the processor, at the home cluster (this cluster "a" forwards to "b") -----------------------------


@pytest.fixture(scope="module")
def long_chain() -> list[Digest]:
    return chain_of(LONG)


@pytest.mark.parametrize("isolation", [True, False])
def test_the_home_forwards_the_tenant_and_its_salt_never_the_credentials(
    long_chain: list[Digest], isolation: bool
) -> None:
    fwd = forwarder()
    warm_in_b(fwd, long_chain)
    g = gate(isolation)
    meta = jwt({"sub": "u1", "tenant": "acme"})
    proc = StreamProcessor(
        router(), ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0, g, federation=fwd
    )
    extra = {"authorization": "Bearer eyJ.secret.token", SALTED_HEADER: "1"}
    assert proc.handle(headers("/v1/completions", extra=extra, meta=meta)) == []
    sent = reply(proc.handle(body(completion(LONG))))
    if not isolation:  # unsalted digests: warm_in_b's chain is the unsalted one
        assert sent.destination == [INGRESS_B, LOCAL]
    assert sent.set_headers[TENANT_HEADER] == "acme"
    assert "authorization" in sent.remove_headers  # and Envoy's router removes every credential header
    assert "eyJ.secret.token" not in str(sent.set_headers)
    if isolation:
        assert orjson.loads(sent.body)["cache_salt"] == tenant_salt("acme", None)
    if proc.forward is not None:
        assert sent.set_headers.get(SALTED_HEADER) == ("1" if isolation else None)
    else:  # a client's own salted flag is never sent on
        assert SALTED_HEADER not in sent.set_headers


def test_the_home_salts_before_it_decides_and_tells_the_peer() -> None:
    """With isolation on, the forward decision uses the salted chain (the one the peer's summary holds for
    acme), and the forward carries the salted flag."""
    fwd = forwarder()
    g = gate(isolation=True)
    salted = chain_of_salted(LONG, tenant_salt("acme", None))
    warm_in_b(fwd, salted)
    meta = jwt({"sub": "u1", "tenant": "acme"})
    proc = StreamProcessor(
        router(), ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0, g, federation=fwd
    )
    assert proc.handle(headers("/v1/completions", meta=meta)) == []
    sent = reply(proc.handle(body(completion(LONG))))
    assert sent.destination == [INGRESS_B, LOCAL]
    assert sent.set_headers[SALTED_HEADER] == "1" and sent.set_headers[HOP_HEADER] == "a"


def chain_of_salted(prompt: str, salt: str) -> list[Digest]:
    proc = StreamProcessor(router(), ProcessorConfig(max_body_bytes=1 << 20), lambda: 1.0)
    proc.handle(headers("/v1/completions"))
    proc.handle(body(completion(prompt, cache_salt=salt)))
    proc.after_send()
    assert proc.decision is not None
    return list(proc.decision.digests)


def test_the_home_names_the_client_salt_it_mixed_with_the_tenant() -> None:
    """The forward's client-salt header lets the peer check the salt is the asserted tenant's."""
    fwd = forwarder()
    warm_in_b(fwd, chain_of_salted(LONG, tenant_salt("acme", "mine")))
    meta = jwt({"sub": "u1", "tenant": "acme"})
    proc = StreamProcessor(
        router(), ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0, gate(True), federation=fwd
    )
    assert proc.handle(headers("/v1/completions", meta=meta)) == []
    sent = reply(proc.handle(body(completion(LONG, cache_salt="mine"))))
    assert sent.destination == [INGRESS_B, LOCAL]
    assert sent.set_headers[SALTED_HEADER] == "1"
    assert bytes.fromhex(sent.set_headers[CLIENT_SALT_HEADER]) == b"mine"
    assert orjson.loads(sent.body)["cache_salt"] == tenant_salt("acme", "mine")
