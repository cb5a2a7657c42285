"""The Gate (pure): identifying callers from verified claims or API keys, admission, settlement."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.admission.failures import FailedAuthLimit
from extproc.admission.gate import AuthConfig, Gate, JwtConfig, Settle, max_output_tokens
from extproc.admission.keys import ApiKey, KeyStore, hash_key, new_key
from extproc.admission.tenants import Tenant, TenantMatch, Tenants, TokenLimit
from extproc.admission.usage import Usage
from extproc.errors import Forbidden, GatewayError, TooManyRequests, Unauthorized
from extproc.routing.request import Kind, ParsedRequest

KEY, REVOKED, ORPHAN = new_key(), new_key(), new_key()
ACME = Tenant(
    "acme",
    ("small-*",),
    TenantMatch(claims=(("tenant", frozenset({"acme"})),)),
    tokens=TokenLimit(per_minute=600, burst=100),
)
FREE = Tenant("free", ("*",), TenantMatch(groups=frozenset({"free"})))
KEYS = KeyStore(
    [
        ApiKey("k1", "acme", hash_key(KEY), 1),
        ApiKey("k2", "acme", hash_key(REVOKED), 1, revoked=2),
        ApiKey("k3", "gone", hash_key(ORPHAN), 1),
    ]
)
CONFIG = AuthConfig(
    jwt=JwtConfig("https://idp", ("kvgate",), jwks_uri="https://idp/jwks"),
    default_max_tokens=50,
    settle=Settle.USAGE,
)


#: What jwt_authn verified for our provider: every payload it passes on carries these.
VERIFIED = {"iss": "https://idp", "aud": "kvgate"}


def gate(config: AuthConfig = CONFIG) -> Gate:
    return Gate(config, Tenants([ACME, FREE]), KEYS)


@pytest.mark.parametrize(
    ("authorization", "claims", "failure", "expected"),
    [
        (None, {**VERIFIED, "tenant": "acme", "sub": "svc-1"}, None, ("acme", "jwt", "svc-1")),
        (None, {**VERIFIED, "groups": ["free"]}, None, ("free", "jwt", "-")),
        (f"Bearer {KEY}", None, None, ("acme", "api_key", "k1")),
        (f"bearer   {KEY}  ", None, None, ("acme", "api_key", "k1")),
        # verified claims win; the header is not even looked at
        ("Bearer garbage", {**VERIFIED, "tenant": "acme", "sub": "s"}, None, ("acme", "jwt", "s")),
        (None, {**VERIFIED, "tenant": "nobody"}, None, (403, "no_tenant")),
        (None, None, None, (401, "missing_credentials")),
        ("Basic dXNlcjpwYXNz", None, None, (401, "missing_credentials")),
        ("Bearer ", None, None, (401, "missing_credentials")),
        (f"Bearer {REVOKED}", None, None, (401, "invalid_api_key")),
        (f"Bearer {KEY}x", None, None, (401, "invalid_api_key")),
        (f"Bearer {ORPHAN}", None, None, (403, "no_tenant")),
        ("Bearer eyJhbGciOi.x.y", None, "Jwt is expired", (401, "invalid_token")),
        ("Bearer eyJhbGciOi.x.y", None, None, (401, "invalid_token")),
    ],
)
def test_identify(
    authorization: str | None, claims: dict[str, Any] | None, failure: str | None, expected: tuple[Any, ...]
) -> None:
    if isinstance(expected[0], str):
        principal = gate().identify(authorization, claims, failure)
        assert (principal.tenant.id, principal.via, principal.who) == expected
        return
    with pytest.raises((Unauthorized, Forbidden)) as err:
        gate().identify(authorization, claims, failure)
    assert (err.value.status, err.value.code) == expected
    assert KEY not in err.value.message and "garbage" not in err.value.message


def test_failure_reason_is_reported() -> None:
    with pytest.raises(Unauthorized, match="Jwt is expired"):
        gate().identify("Bearer a.b.c", None, "Jwt is expired")


def test_api_keys_without_a_key_file_are_refused() -> None:
    with pytest.raises(Unauthorized):
        Gate(CONFIG, Tenants([ACME]), None).identify(f"Bearer {KEY}", None, None)


def request(model: str = "small-1", **body: Any) -> ParsedRequest:
    return ParsedRequest(Kind.CHAT, model, {"model": model, **body}, False, messages=[{"role": "user"}])


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, None),
        ({"max_tokens": 8}, 8),
        ({"max_completion_tokens": 9, "max_tokens": 8}, 9),
        ({"max_tokens": 8, "n": 3}, 24),
        ({"max_tokens": True}, None),
    ],
)
def test_max_output_tokens(body: dict[str, Any], expected: int | None) -> None:
    assert max_output_tokens(request(**body)) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"max_tokens": 8}, 8),
        ({"max_completion_tokens": 1, "max_tokens": 5000}, 5000),  # the engine generates up to 5000
        ({"max_completion_tokens": 1}, None),  # the engine's own default, not 1: default_max_tokens
    ],
)
def test_a_completion_is_bounded_by_max_tokens_alone(body: dict[str, Any], expected: int | None) -> None:
    """Engines read ``max_completion_tokens`` on chat only: on a completion it bounds nothing, so it must
    not shrink the reservation (with ``settle = "reservation"`` the charge)."""
    completion = ParsedRequest(Kind.COMPLETION, "small-1", {"model": "small-1", **body}, False)
    assert max_output_tokens(completion) == expected


@pytest.mark.parametrize(
    ("admissions", "outcomes"),
    [
        # (model, prompt tokens, body, now) -> reserved tokens, or (status, code, retry-after)
        ([("small-1", 10, {"max_tokens": 20}, 0.0)], [30]),
        ([("small-1", 10, {}, 0.0)], [60]),  # default_max_tokens 50 reserved
        ([("big-1", 1, {}, 0.0)], [(403, "model_not_allowed", None)]),
        ([("small-1", 200, {"max_tokens": 1}, 0.0)], [(429, "request_too_large", None)]),
        (
            [("small-1", 50, {"max_tokens": 40}, 0.0), ("small-1", 10, {"max_tokens": 10}, 0.0)],
            [90, (429, "tokens_exceeded", 1)],
        ),
        (
            [("small-1", 50, {"max_tokens": 50}, 0.0), ("small-1", 50, {"max_tokens": 50}, 3.0)],
            [100, (429, "tokens_exceeded", 7)],  # 30 refilled in 3 s, 70 missing at 10/s
        ),
        ([("small-1", 50, {"max_tokens": 50}, 0.0), ("small-1", 50, {"max_tokens": 50}, 10.0)], [100, 100]),
    ],
)
def test_admission(admissions: list[tuple[str, int, dict[str, Any], float]], outcomes: list[Any]) -> None:
    g = gate()
    principal = g.identify(f"Bearer {KEY}", None, None)
    got: list[Any] = []
    for model, prompt, body, now in admissions:
        try:
            got.append(g.admit(principal, request(model, **body), prompt, now).reserved)
        except GatewayError as exc:
            retry = exc.retry_after_s if isinstance(exc, TooManyRequests) else None
            got.append((exc.status, exc.code, retry))
    assert got == outcomes


@pytest.mark.parametrize(
    ("body", "usage", "charged"),
    [
        ({"max_tokens": 40}, Usage(10, 5, True), 15),  # exact usage: refund the unused output
        ({"max_tokens": 40}, Usage(None, 5, True), 15),  # engine gave no prompt count: ours
        ({"max_tokens": 40}, Usage(12, 5, True), 17),  # the engine's prompt count wins
        ({"max_tokens": 40}, None, 50),  # unknown: the reservation stands
        ({"max_tokens": 4}, Usage(None, 9, False), 14),  # an estimate never exceeds a bounded request
        ({}, Usage(10, 80, True), 90),  # unbounded and over the default: charged in full (debt)
    ],
)
def test_settlement(body: dict[str, Any], usage: Usage | None, charged: int) -> None:
    g = gate()
    principal = g.identify(f"Bearer {KEY}", None, None)
    ticket = g.admit(principal, request(**body), 10, 0.0)
    assert g.wants_usage(ticket)
    assert g.settle(ticket, usage, 0.0) == charged
    assert g.budgets.level(ACME, 0.0) == pytest.approx(100 - charged)
    assert g.settle(ticket, Usage(0, 0, True), 0.0) == charged  # settles once


def test_cancel_refunds_everything_and_reservation_mode() -> None:
    g = gate()
    principal = g.identify(f"Bearer {KEY}", None, None)
    ticket = g.admit(principal, request(max_tokens=40), 10, 0.0)
    g.cancel(ticket, 0.0)
    assert g.budgets.level(ACME, 0.0) == pytest.approx(100)
    reserving = gate(AuthConfig(api_keys_file="k", settle=Settle.RESERVATION))
    ticket = reserving.admit(principal, request(max_tokens=40), 10, 0.0)
    assert not reserving.wants_usage(ticket)
    free = gate().identify(None, {**VERIFIED, "groups": ["free"]}, None)
    assert not gate().wants_usage(gate().admit(free, request("any"), 1, 0.0))  # no budget, nothing to read


@pytest.mark.parametrize(
    "claims",
    [
        {"tenant": "acme"},  # no iss, no aud
        {"iss": "https://other-idp", "aud": "kvgate", "tenant": "acme"},
        {"iss": "https://idp", "aud": "someone-else", "tenant": "acme"},
        {"iss": "https://idp", "aud": [{"x": 1}, 7], "tenant": "acme"},
        {"iss": ["https://idp"], "aud": "kvgate", "tenant": "acme"},
    ],
)
def test_claims_not_verified_for_our_provider_are_refused(claims: dict[str, Any]) -> None:
    with pytest.raises(Unauthorized) as err:
        gate().identify(None, claims, None)
    assert err.value.code == "invalid_identity"
    with pytest.raises(Unauthorized):  # a gate without a JWT provider reads no claims at all
        gate(AuthConfig(api_keys_file="k")).identify(None, {**VERIFIED, "tenant": "acme"}, None)


def test_an_address_that_keeps_failing_is_answered_429_even_with_a_good_key() -> None:
    g = gate(AuthConfig(jwt=CONFIG.jwt, failed_auth=FailedAuthLimit(per_minute=6, burst=3)))
    for _ in range(3):
        with pytest.raises(Unauthorized):
            g.identify("Bearer sk-kvg-wrong", None, None, address="203.0.113.9", now=100.0)
    with pytest.raises(TooManyRequests) as err:
        g.identify(f"Bearer {KEY}", None, None, address="203.0.113.9", now=100.0)
    assert (err.value.code, err.value.retry_after_s) == ("auth_attempts_exceeded", 10)  # 1 attempt / 10 s
    assert KEY not in err.value.message
    # nobody else is affected, and an unknown address is never limited
    assert g.identify(f"Bearer {KEY}", None, None, address="198.51.100.1", now=100.0).tenant.id == "acme"
    for _ in range(5):
        with pytest.raises(Unauthorized):
            g.identify(None, None, None, address=None, now=100.0)
    # refused attempts while blocked cost nothing more; one attempt is back after 10 s
    assert g.identify(f"Bearer {KEY}", None, None, address="203.0.113.9", now=110.0).who == "k1"
    # a 403 is an identified caller, not a guess: it is not counted
    for _ in range(5):
        with pytest.raises(Forbidden):
            g.identify(f"Bearer {ORPHAN}", None, None, address="192.0.2.5", now=100.0)
    assert g.identify(f"Bearer {KEY}", None, None, address="192.0.2.5", now=100.0).who == "k1"


def test_a_negative_output_limit_reserves_the_prompt_alone() -> None:
    """The parser answers a negative max_tokens 400 (extproc/routing/sampling.py); the gate holds without
    it: the reservation never drops below the prompt, so an unanswered request refunds nothing it did
    not take and the counter other replicas are sent never drops."""
    g = gate()
    principal = g.identify(f"Bearer {KEY}", None, None)
    g.admit(principal, request(max_tokens=90), 10, 0.0)  # the bucket drained
    for body in ({"max_tokens": -(10**9)}, {"max_completion_tokens": -5}):
        ticket = g.admit(principal, request(**body), 0, 0.0)
        assert ticket.reserved == 0
        g.settle(ticket, None, 0.5)  # never answered: the reservation is the charge
    ticket = g.admit(principal, request(max_tokens=-5), 3, 0.5)
    assert ticket.reserved == 3
    assert g.budgets.level(ACME, 0.5) == pytest.approx(2.0)  # 5 refilled, 3 taken
    assert g.budgets.charged == {"acme": 103}


def test_admission_uses_the_tenant_in_force() -> None:
    """A caller identified before a tenant change is admitted under the tenant in force at its body: its
    model scope and token limit (the bucket keeps what was spent), or 403 when it was removed."""
    g = gate()
    principal = g.identify(f"Bearer {KEY}", None, None)
    assert g.admit(principal, request(max_tokens=50), 50, 0.0).reserved == 100  # bucket of 100 drained
    raised = Tenant("acme", ("small-*",), ACME.match, tokens=TokenLimit(per_minute=1200, burst=200))
    g.set_tenants(Tenants([raised, FREE]))
    fresh = g.identify(f"Bearer {KEY}", None, None)
    ticket = g.admit(fresh, request(max_tokens=50), 50, 0.0)  # 200 - 100 spent: 100 left
    assert ticket.tenant is raised
    with pytest.raises(TooManyRequests):
        g.admit(principal, request(max_tokens=1), 1, 0.0)  # the old principal: no fresh old bucket
    assert g.budgets.charged == {"acme": 200}
    narrowed = Tenant("acme", ("tiny-*",), ACME.match, tokens=raised.tokens)
    g.set_tenants(Tenants([narrowed, FREE]))
    with pytest.raises(Forbidden) as refused:
        g.admit(principal, request("small-1", max_tokens=1), 1, 100.0)
    assert refused.value.code == "model_not_allowed"
    g.set_tenants(Tenants([FREE]))
    with pytest.raises(Forbidden) as removed:
        g.admit(principal, request("tiny-1", max_tokens=1), 1, 100.0)
    assert removed.value.code == "no_tenant"
