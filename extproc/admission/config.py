"""Parsing of the ``[auth]`` and ``[[tenants]]`` sections (see :mod:`extproc.config` for the example).

:func:`parse_tenant` is also what validates an etcd ``tenants/<id>`` value: the same schema, checked
on every read. Errors are :class:`~contracts.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import math

from contracts.config import MAX_DURATION_S, REQUIRED, Section
from contracts.errors import ConfigError
from extproc.admission.failures import FailedAuthLimit
from extproc.admission.gate import AuthConfig, JwtConfig, Settle
from extproc.admission.tenants import TENANT_ID, RequestRate, Tenant, TenantMatch, TokenLimit

_AUTH, _JWT = AuthConfig(), JwtConfig(issuer="", audiences=())


def parse_auth(raw: object) -> AuthConfig | None:
    """The ``[auth]`` section, or ``None`` when absent (the gateway stays open)."""
    if raw is None:
        return None
    return _auth(raw)


def parse_tenants(raw: list[object], auth: AuthConfig | None) -> tuple[Tenant, ...]:
    """The ``[[tenants]]`` tables, in order (the first matching tenant wins)."""
    tenants = tuple(parse_tenant(t, f"tenants[{i}]") for i, t in enumerate(raw))
    if len({t.id for t in tenants}) != len(tenants):
        raise ConfigError("tenants: duplicate id")
    if tenants and auth is None:
        raise ConfigError("tenants: need an [auth] section (without it the gateway is open)")
    return tenants


def _auth(raw: object) -> AuthConfig:
    s = Section(raw, "auth")
    settle = s.string("settle", Settle.USAGE.value)
    if settle not in {m.value for m in Settle}:
        raise ConfigError(f"auth.settle: expected usage or reservation, got {settle!r}")
    jwt_raw = s.raw("jwt")
    auth = AuthConfig(
        jwt=None if jwt_raw is None else _jwt(jwt_raw),
        api_keys_file=s.string("api_keys_file"),
        default_max_tokens=s.integer("default_max_tokens", _AUTH.default_max_tokens, minimum=1),
        settle=Settle(settle),
        failed_auth=FailedAuthLimit(
            per_minute=s.integer("failed_auth_per_minute", _AUTH.failed_auth.per_minute, minimum=1),
            burst=s.integer("failed_auth_burst", _AUTH.failed_auth.burst, minimum=1),
        ),
        usage_sync_s=s.number("usage_sync_s", _AUTH.usage_sync_s, minimum=0.01),
        kv_isolation=_flag(s.raw("kv_isolation"), "auth.kv_isolation", _AUTH.kv_isolation),
    )
    s.done()
    if auth.jwt is None and auth.api_keys_file is None:
        raise ConfigError("auth: configure [auth.jwt] or auth.api_keys_file (or drop [auth] to stay open)")
    return auth


def _jwt(raw: object) -> JwtConfig:
    s = Section(raw, "auth.jwt")
    issuer = s.string("issuer", REQUIRED)
    audiences = s.array("audiences", REQUIRED)
    if not audiences or not all(isinstance(a, str) and a for a in audiences):
        raise ConfigError("auth.jwt.audiences: expected a non-empty list of strings")
    jwt = JwtConfig(
        issuer=issuer,
        audiences=tuple(audiences),
        jwks_uri=s.string("jwks_uri"),
        jwks_file=s.string("jwks_file"),
        jwks_cache_s=s.number("jwks_cache_s", _JWT.jwks_cache_s, minimum=1.0),
        groups_claim=s.string("groups_claim", _JWT.groups_claim),
        clock_skew_s=s.integer("clock_skew_s", _JWT.clock_skew_s, minimum=0),
    )
    s.done()
    if jwt.jwks_cache_s > MAX_DURATION_S:
        raise ConfigError(
            f"auth.jwt.jwks_cache_s: must be <= {MAX_DURATION_S:.0f} (Envoy's longest duration), "
            f"got {jwt.jwks_cache_s}"
        )
    if not issuer:
        raise ConfigError("auth.jwt.issuer: must not be empty")
    if (jwt.jwks_uri is None) == (jwt.jwks_file is None):
        raise ConfigError("auth.jwt: set exactly one of jwks_uri or jwks_file")
    if jwt.jwks_uri is not None and not jwt.jwks_uri.startswith(("http://", "https://")):
        raise ConfigError(f"auth.jwt.jwks_uri: expected an http(s) URL, got {jwt.jwks_uri!r}")
    return jwt


def parse_tenant(raw: object, where: str) -> Tenant:
    """Validate one tenant (a ``[[tenants]]`` table, or an etcd ``tenants/<id>`` value through
    :func:`extproc.admission.shared.decode_tenant`)."""
    s = Section(raw, where)
    tenant_id = s.string("id", REQUIRED)
    if not TENANT_ID.fullmatch(tenant_id):
        raise ConfigError(
            f"{where}.id: expected 1-64 of [A-Za-z0-9._-] starting alphanumeric, got {tenant_id!r}"
        )
    models = s.array("models", REQUIRED)
    if not models or not all(isinstance(m, str) and m for m in models):
        raise ConfigError(f"{where}.models: expected a non-empty list of model names or globs")
    m = s.table("match")
    claims = m.table("claims")
    claim_rules = []
    for name in claims.names():
        value = claims.raw(name)
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
            raise ConfigError(f"{where}.match.claims.{name}: expected a string or a list of strings")
        claim_rules.append((name, frozenset(values)))
    claims.done()
    groups = m.array("groups", [])
    if not all(isinstance(g, str) and g for g in groups):
        raise ConfigError(f"{where}.match.groups: expected a list of group names")
    m.done()
    tenant = Tenant(
        id=tenant_id,
        models=tuple(models),
        match=TenantMatch(tuple(sorted(claim_rules)), frozenset(groups)),
        priority=s.integer("priority", 0),
        rate=_rate(s.raw("rate"), f"{where}.rate"),
        tokens=_tokens(s.raw("tokens"), f"{where}.tokens"),
        objectives=_objectives(s.array("objectives", ["*"]), f"{where}.objectives"),
        kv_isolation=_optional_flag(s.raw("kv_isolation"), f"{where}.kv_isolation"),
    )
    s.done()
    return tenant


def _optional_flag(raw: object, where: str) -> bool | None:
    """A boolean or absent (``None``); anything else is a :class:`ConfigError` naming ``where``."""
    if raw is None or isinstance(raw, bool):
        return raw
    raise ConfigError(f"{where}: expected true or false, got {raw!r}")


def _flag(raw: object, where: str, default: bool) -> bool:
    value = _optional_flag(raw, where)
    return default if value is None else value


def _objectives(raw: list[object], where: str) -> tuple[str, ...]:
    """The objective globs a tenant may use: strings, none empty (an empty list: no objective)."""
    if not all(isinstance(p, str) and p for p in raw):
        raise ConfigError(f"{where}: expected a list of objective names or globs, got {raw!r}")
    return tuple(str(p) for p in raw)


def _rate(raw: object, where: str) -> RequestRate | None:
    if raw is None:
        return None
    s = Section(raw, where)
    per_s = s.number("requests_per_s", REQUIRED, minimum=0.001)
    rate = RequestRate(per_s, s.integer("burst", max(1, math.ceil(per_s)), minimum=1))
    s.done()
    return rate


def _tokens(raw: object, where: str) -> TokenLimit | None:
    if raw is None:
        return None
    s = Section(raw, where)
    per_minute = s.integer("per_minute", REQUIRED, minimum=1)
    limit = TokenLimit(per_minute, s.integer("burst", per_minute, minimum=1))
    s.done()
    return limit
