"""Tenants: matching verified claims to a tenant, model scopes, and validation of the tenant schema."""

from __future__ import annotations

from typing import Any

import pytest

from contracts.errors import ConfigError
from extproc.admission.config import parse_tenant
from extproc.admission.failures import FailedAuthLimit
from extproc.admission.gate import Settle
from extproc.admission.tenants import RequestRate, Tenant, TenantMatch, Tenants, TokenLimit
from extproc.config import parse_config

ACME = Tenant(
    "acme",
    ("SmolLM2-*", "llama-3.1-8b"),
    TenantMatch(claims=(("tenant", frozenset({"acme"})),), groups=frozenset({"acme-eng"})),
)
BETA = Tenant("beta", ("*",), TenantMatch(claims=(("org", frozenset({"7", "beta"})),)))
KEYS_ONLY = Tenant("keys-only", ("*",))
TENANTS = Tenants([ACME, BETA, KEYS_ONLY])


@pytest.mark.parametrize(
    ("claims", "expected"),
    [
        ({"tenant": "acme"}, "acme"),
        ({"tenant": ["x", "acme"]}, "acme"),  # a list claim matches when it contains a value
        ({"groups": ["other", "acme-eng"]}, "acme"),
        ({"groups": "acme-eng"}, "acme"),
        ({"org": 7}, "beta"),  # numbers compare as their decimal text
        ({"org": 7.0}, "beta"),  # Envoy's metadata carries JSON numbers as doubles
        ({"org": "beta", "tenant": "acme"}, "acme"),  # configuration order: first match wins
        ({"tenant": "ACME"}, None),  # case-sensitive
        ({"tenant": True}, None),
        ({"tenant": {"nested": "acme"}}, None),
        ({"groups": []}, None),
        ({"sub": "keys-only"}, None),  # a tenant without match rules is reachable by API key only
        ({}, None),
    ],
)
def test_tenant_for_claims(claims: dict[str, Any], expected: str | None) -> None:
    tenant = TENANTS.for_claims(claims, groups_claim="groups")
    assert (tenant.id if tenant else None) == expected


def test_groups_claim_name_is_configurable() -> None:
    assert TENANTS.for_claims({"roles": ["acme-eng"]}, groups_claim="roles") is ACME
    assert TENANTS.for_claims({"groups": ["acme-eng"]}, groups_claim="roles") is None


@pytest.mark.parametrize(
    ("model", "allowed"),
    [
        ("SmolLM2-135M-Instruct", True),
        ("llama-3.1-8b", True),
        ("llama-3.1-70b", False),
        ("smollm2-135m", False),  # globs are case-sensitive
        ("", False),
    ],
)
def test_model_scope(model: str, allowed: bool) -> None:
    assert ACME.allows(model) is allowed


def test_lookup_by_id_and_duplicates() -> None:
    assert TENANTS.get("beta") is BETA and TENANTS.get("nope") is None
    assert [t.id for t in TENANTS] == ["acme", "beta", "keys-only"] and len(TENANTS) == 3
    with pytest.raises(ValueError, match="duplicate"):
        Tenants([ACME, ACME])


def test_parse_full_tenant() -> None:
    tenant = parse_tenant(
        {
            "id": "acme",
            "models": ["SmolLM2-*"],
            "priority": 2,
            "match": {"claims": {"tenant": "acme", "org": ["1", "2"]}, "groups": ["g"]},
            "rate": {"requests_per_s": 2.5},
            "tokens": {"per_minute": 6000, "burst": 1000},
        },
        "tenants[0]",
    )
    assert tenant.match.claims == (("org", frozenset({"1", "2"})), ("tenant", frozenset({"acme"})))
    assert tenant.match.groups == frozenset({"g"}) and tenant.priority == 2
    assert tenant.rate == RequestRate(2.5, 3)  # burst defaults to the rate, rounded up
    assert tenant.tokens == TokenLimit(6000, 1000) and tenant.tokens.per_s == 100.0


def test_parse_minimal_tenant_defaults() -> None:
    tenant = parse_tenant({"id": "t", "models": ["*"]}, "t")
    assert tenant.match.empty and tenant.rate is None and tenant.tokens is None and tenant.priority == 0
    assert tenant.objectives == ("*",) and tenant.allows_objective("anything")
    assert parse_tenant({"id": "t", "models": ["*"], "tokens": {"per_minute": 60}}, "t").tokens == TokenLimit(
        60, 60
    )


GOOD = {"id": "acme", "models": ["*"]}


def test_negative_priority_is_sheddable_and_objectives_are_globs() -> None:
    tenant = parse_tenant({**GOOD, "priority": -1, "objectives": ["chat", "batch-*"]}, "tenants[0]")
    assert tenant.priority == -1 and tenant.objectives == ("chat", "batch-*")
    assert tenant.allows_objective("chat") and tenant.allows_objective("batch-nightly")
    assert not tenant.allows_objective("Chat") and not tenant.allows_objective("interactive")
    none = parse_tenant({**GOOD, "objectives": []}, "tenants[0]")
    assert not none.allows_objective("chat")  # may name no objective


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"models": ["*"]}, "tenants[0].id: required"),
        ({**GOOD, "id": ""}, "tenants[0].id: expected 1-64"),
        ({**GOOD, "id": "has space"}, "tenants[0].id"),
        ({**GOOD, "id": "x" * 65}, "tenants[0].id"),
        ({**GOOD, "id": "-leading"}, "tenants[0].id"),
        ({"id": "a"}, "tenants[0].models: required"),
        ({**GOOD, "models": []}, "tenants[0].models: expected a non-empty list"),
        ({**GOOD, "models": "*"}, "tenants[0].models: expected list"),
        ({**GOOD, "models": ["ok", 3]}, "tenants[0].models"),
        ({**GOOD, "priority": 1.5}, "tenants[0].priority: expected int"),
        ({**GOOD, "priority": True}, "tenants[0].priority: expected int, got bool"),
        ({**GOOD, "objectives": "*"}, "tenants[0].objectives: expected list"),
        ({**GOOD, "objectives": ["ok", ""]}, "tenants[0].objectives: expected a list of objective names"),
        ({**GOOD, "objectives": [1]}, "tenants[0].objectives: expected a list of objective names"),
        ({**GOOD, "match": {"claims": {"tenant": 5}}}, "tenants[0].match.claims.tenant"),
        ({**GOOD, "match": {"claims": {"tenant": []}}}, "tenants[0].match.claims.tenant"),
        ({**GOOD, "match": {"groups": ["ok", ""]}}, "tenants[0].match.groups"),
        ({**GOOD, "match": {"group": ["g"]}}, "tenants[0].match: unknown key(s) group"),
        ({**GOOD, "rate": {"burst": 5}}, "tenants[0].rate.requests_per_s: required"),
        ({**GOOD, "rate": {"requests_per_s": 0}}, "tenants[0].rate.requests_per_s: must be"),
        ({**GOOD, "rate": {"requests_per_s": -3}}, "tenants[0].rate.requests_per_s"),
        (
            {**GOOD, "rate": {"requests_per_s": "fast"}},
            "tenants[0].rate.requests_per_s: expected int or float",
        ),
        ({**GOOD, "rate": {"requests_per_s": 5, "burst": 0}}, "tenants[0].rate.burst: must be >= 1"),
        ({**GOOD, "rate": {"requests_per_s": 5, "per_s": 1}}, "tenants[0].rate: unknown key(s) per_s"),
        ({**GOOD, "tokens": {"per_minute": 0}}, "tenants[0].tokens.per_minute: must be >= 1"),
        ({**GOOD, "tokens": {"per_minute": 1.5}}, "tenants[0].tokens.per_minute: expected int"),
        ({**GOOD, "tokens": {"per_minute": True}}, "tenants[0].tokens.per_minute: expected int, got bool"),
        ({**GOOD, "tokens": {"per_minute": 10, "burst": -1}}, "tenants[0].tokens.burst"),
        ({**GOOD, "tokens": 100}, "tenants[0].tokens: expected a table"),
        ({**GOOD, "quota": 1}, "tenants[0]: unknown key(s) quota"),
    ],
)
def test_bad_tenant_values_are_refused_naming_the_key(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"auth": {"api_keys_file": "k.json"}, "tenants": [raw]})
    assert message in str(err.value)


JWT = {"issuer": "https://idp.example", "audiences": ["kvgate"], "jwks_uri": "https://idp.example/jwks"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"tenants": [GOOD]}, "tenants: need an [auth] section"),
        ({"auth": {"api_keys_file": "k"}, "tenants": [GOOD, GOOD]}, "tenants: duplicate id"),
        ({"auth": {}}, "auth: configure [auth.jwt] or auth.api_keys_file"),
        ({"auth": {"api_keys_file": "k", "settle": "later"}}, "auth.settle: expected usage or reservation"),
        ({"auth": {"api_keys_file": "k", "default_max_tokens": 0}}, "auth.default_max_tokens: must be >= 1"),
        ({"auth": {"api_keys_file": 3}}, "auth.api_keys_file: expected str"),
        ({"auth": {"api_keys_file": "k", "failed_auth_burst": 0}}, "auth.failed_auth_burst: must be >= 1"),
        ({"auth": {"api_keys_file": "k", "failed_auth_per_minute": 0.5}}, "auth.failed_auth_per_minute"),
        ({"auth": {"api_keys_file": "k", "pepper": "x"}}, "auth: unknown key(s) pepper"),
        ({"auth": {"jwt": {**JWT, "issuer": ""}}}, "auth.jwt.issuer: must not be empty"),
        ({"auth": {"jwt": {k: v for k, v in JWT.items() if k != "issuer"}}}, "auth.jwt.issuer: required"),
        ({"auth": {"jwt": {**JWT, "audiences": []}}}, "auth.jwt.audiences"),
        ({"auth": {"jwt": {**JWT, "audiences": "kvgate"}}}, "auth.jwt.audiences: expected list"),
        ({"auth": {"jwt": {**JWT, "jwks_file": "/j.json"}}}, "exactly one of jwks_uri or jwks_file"),
        ({"auth": {"jwt": {k: v for k, v in JWT.items() if k != "jwks_uri"}}}, "exactly one of jwks_uri"),
        (
            {"auth": {"jwt": {**JWT, "jwks_uri": "idp.example/jwks"}}},
            "auth.jwt.jwks_uri: expected an http(s) URL",
        ),
        ({"auth": {"jwt": {**JWT, "jwks_cache_s": 0}}}, "auth.jwt.jwks_cache_s"),
        ({"auth": {"jwt": {**JWT, "clock_skew_s": -1}}}, "auth.jwt.clock_skew_s"),
        ({"auth": {"jwt": {**JWT, "audience": "x"}}}, "auth.jwt: unknown key(s) audience"),
    ],
)
def test_bad_auth_values_are_refused_naming_the_key(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert message in str(err.value)


def test_auth_section_parsed_and_absent_means_open() -> None:
    assert parse_config({}).auth is None and parse_config({}).tenants == ()
    config = parse_config(
        {
            "auth": {"jwt": {**JWT, "groups_claim": "roles"}, "settle": "usage", "default_max_tokens": 64},
            "tenants": [GOOD],
        }
    )
    assert config.auth is not None and config.auth.jwt is not None
    assert config.auth.jwt.audiences == ("kvgate",) and config.auth.jwt.groups_claim == "roles"
    assert config.auth.jwt.jwks_cache_s == 300.0 and config.auth.api_keys_file is None
    assert config.auth.settle is Settle.USAGE and config.auth.default_max_tokens == 64
    assert (config.auth.failed_auth.per_minute, config.auth.failed_auth.burst) == (60, 20)
    assert config.tenants[0].id == "acme"
    limited = parse_config(
        {"auth": {"api_keys_file": "k", "failed_auth_per_minute": 6, "failed_auth_burst": 3}}
    )
    assert limited.auth is not None and limited.auth.failed_auth == FailedAuthLimit(per_minute=6, burst=3)
