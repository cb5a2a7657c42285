"""The Envoy half of authentication and rate limiting, rendered from the gateway config. Pure functions.

With an ``[auth]`` section the OpenAI listener's filter chain becomes::

    jwt_authn  ->  ext_proc  ->  local_ratelimit  ->  router

* ``jwt_authn`` verifies a bearer JWT (signature against the issuer's JWKS, ``iss``, ``aud``, ``exp``)
  and writes the verified claims to dynamic metadata (``payload_in_metadata``), never to headers; a
  failed token leaves its reason (``failed_status_in_metadata``). It lets every request through
  (``allow_missing_or_failed``): API keys are not JWTs, and the ext_proc makes the decision
  (:mod:`extproc.admission.gate`). A verified token is removed from the request (``forward: false``).
* ``ext_proc`` additionally forwards the ``envoy.filters.http.jwt_authn`` metadata namespace and the
  ``source.address`` attribute (failed authentication is limited per client address), and with
  ``settle = "usage"`` sees response bodies (``response_body_mode: STREAMED``) to read token usage, when
  a tenant may have a token budget (one of the file's has one, or ``[etcd]`` may add one).
* ``local_ratelimit`` keys one token bucket per tenant on the ``x-kvgate-tenant`` header, which only the
  ext_proc sets (the listener strips client copies before any filter runs). Over the rate it answers
  429 with ``x-ratelimit-*`` headers (draft 03) and ``Retry-After``; the listener's local reply
  mapping turns the body into OpenAI JSON. Requests of tenants without a rate use a huge default bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from contracts.epp import JWT_NS, JWT_PAYLOAD, JWT_STATUS, SOURCE_ADDRESS, TENANT_HEADER
from contracts.errors import ConfigError
from extproc.admission.gate import JwtConfig, Settle
from extproc.admission.tenants import RequestRate
from extproc.config import GatewayConfig
from kvgate.envoy.hosts import is_ip

JWT_PROVIDER = "kvgate"
JWKS_CLUSTER = "kvgate_jwks"
RATE_DESCRIPTOR = "tenant"
#: CA bundle Envoy trusts for an https JWKS endpoint (Envoy has no notion of "the system store").
SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
#: The ``Authorization`` schemes jwt_authn reads a token from: the scheme is case-insensitive (RFC 9110)
#: but Envoy compares prefixes as written, so every one of the 64 spellings of "bearer" is listed.
BEARER_PREFIXES = tuple(
    "".join(c.upper() if mask >> i & 1 else c for i, c in enumerate("bearer")) for mask in range(64)
)
#: Requests per second of the default bucket (tenants without a rate): effectively unlimited.
UNLIMITED = 1_000_000

_JWT_AUTHN = "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication"
_LOCAL_RL = "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
_UPSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"


@dataclass(frozen=True, slots=True)
class EdgeAuth:
    """What Envoy needs of the auth config: the JWT provider (``None``: API keys only), each limited
    tenant's request rate, and whether the ext_proc reads response bodies for token usage."""

    jwt: JwtConfig | None
    rates: tuple[tuple[str, RequestRate], ...]
    read_usage: bool
    jwks_ca_file: str = SYSTEM_CA_BUNDLE

    @classmethod
    def from_config(cls, config: GatewayConfig) -> EdgeAuth | None:
        """``None`` when the config has no ``[auth]`` section (the gateway is open)."""
        auth = config.auth
        if auth is None:
            return None
        rates = tuple((t.id, t.rate) for t in config.tenants if t.rate is not None)
        # With [etcd], tenants (and their token budgets) may come from etcd at any time after Envoy's
        # start: their usage must be readable too, so the bodies are sent whenever a budget may exist.
        budgets = config.etcd is not None or any(t.tokens is not None for t in config.tenants)
        return cls(auth.jwt, rates, read_usage=auth.settle is Settle.USAGE and budgets)


def http_filters(
    auth: EdgeAuth | None, ext_proc: dict[str, Any], router: dict[str, Any]
) -> list[dict[str, Any]]:
    """The listener's HTTP filter chain: ``[ext_proc, router]`` when open, else with auth around it."""
    if auth is None:
        return [ext_proc, router]
    chain = [] if auth.jwt is None else [jwt_authn_filter(auth.jwt)]
    chain.append(with_auth(ext_proc, auth))
    if auth.rates:
        chain.append(local_ratelimit_filter(auth.rates))
    return [*chain, router]


def clusters(auth: EdgeAuth | None, secure: bool = False) -> list[dict[str, Any]]:
    """Extra upstream clusters: the issuer's JWKS endpoint when keys are fetched remotely. ``secure``
    (the TLS profile) refuses a JWKS fetched without TLS (:func:`require_verified_jwks`)."""
    if auth is None or auth.jwt is None or auth.jwt.jwks_uri is None:
        return []
    if secure:
        require_verified_jwks(auth.jwt.jwks_uri)
    return [jwks_cluster(auth.jwt.jwks_uri, auth.jwks_ca_file)]


def require_verified_jwks(jwks_uri: str) -> None:
    """:class:`ConfigError` unless ``jwks_uri`` is ``https``: whoever can answer a plain-HTTP JWKS fetch
    chooses the keys Envoy accepts tokens signed with, so the secure profile never fetches one."""
    if urlsplit(jwks_uri).scheme != "https":
        raise ConfigError(
            f"auth.jwt.jwks_uri {jwks_uri!r}: the secure profile fetches signing keys over verified TLS "
            "only: use an https:// jwks_uri (its server certificate checked against the CA bundle) or a "
            "local jwks_file"
        )


def with_auth(ext_proc: dict[str, Any], auth: EdgeAuth) -> dict[str, Any]:
    """A copy of the ext_proc filter that also receives the JWT metadata (and response bodies when
    token usage is read from them)."""
    typed = dict(ext_proc["typed_config"])
    options = dict(typed.get("metadata_options", {}))
    forwarding = dict(options.get("forwarding_namespaces", {}))
    if auth.jwt is not None:
        forwarding["untyped"] = [*forwarding.get("untyped", []), JWT_NS]
    options["forwarding_namespaces"] = forwarding
    typed["metadata_options"] = options
    # The client's address as Envoy saw it: failed authentication is limited per address.
    typed["request_attributes"] = [*typed.get("request_attributes", []), SOURCE_ADDRESS]
    if auth.read_usage:
        typed["processing_mode"] = {**typed["processing_mode"], "response_body_mode": "STREAMED"}
    return {**ext_proc, "typed_config": typed}


def jwt_authn_filter(jwt: JwtConfig) -> dict[str, Any]:
    provider: dict[str, Any] = {
        "issuer": jwt.issuer,
        "audiences": list(jwt.audiences),
        "require_expiration": True,
        "clock_skew_seconds": jwt.clock_skew_s,
        # Only the Authorization header: no access_token query parameter (URLs end up in logs).
        "from_headers": [{"name": "authorization", "value_prefix": f"{p} "} for p in BEARER_PREFIXES],
        "forward": False,
        "payload_in_metadata": JWT_PAYLOAD,
        "failed_status_in_metadata": JWT_STATUS,
    }
    if jwt.jwks_uri is not None:
        provider["remote_jwks"] = {
            "http_uri": {"uri": jwt.jwks_uri, "cluster": JWKS_CLUSTER, "timeout": "5s"},
            "cache_duration": _duration(jwt.jwks_cache_s),
            # The listener opens after the first fetch (success or not); failures retry every second.
            "async_fetch": {"fast_listener": False, "failed_refetch_duration": "1s"},
            "retry_policy": {
                "num_retries": 3,
                "retry_back_off": {"base_interval": "0.2s", "max_interval": "2s"},
            },
        }
    else:
        provider["local_jwks"] = {"filename": jwt.jwks_file}
    return {
        "name": "envoy.filters.http.jwt_authn",
        "typed_config": {
            "@type": _JWT_AUTHN,
            "providers": {JWT_PROVIDER: provider},
            "rules": [
                {
                    "match": {"prefix": "/"},
                    # Verify when present, never reject here: the ext_proc decides (API keys, 401s).
                    "requires": {"allow_missing_or_failed": {}},
                }
            ],
        },
    }


def token_bucket(requests_per_s: float, burst: int) -> dict[str, Any]:
    """Envoy's integer token bucket for a rate: refill whole tokens per interval (>= 50 ms).

    At or above 1 req/s the interval is the smallest of 1, 2, 4, 5 or 10 s giving a whole number of
    tokens (else 1 s, rounded); below, one token every ``1/rate`` seconds.
    """
    if requests_per_s >= 1:
        for interval in (1, 2, 4, 5, 10):
            tokens = requests_per_s * interval
            if abs(tokens - round(tokens)) < 1e-6:
                break
        else:
            interval, tokens = 1, requests_per_s
        return {
            "max_tokens": burst,
            "tokens_per_fill": max(1, round(tokens)),
            "fill_interval": f"{interval}s",
        }
    return {"max_tokens": burst, "tokens_per_fill": 1, "fill_interval": _duration(1.0 / requests_per_s)}


def retry_after_s(rates: tuple[tuple[str, RequestRate], ...]) -> int:
    """Seconds a limited client should wait: the longest refill interval of any tenant's bucket."""
    longest = 1.0
    for _, rate in rates:
        fill = token_bucket(rate.requests_per_s, rate.burst)["fill_interval"]
        longest = max(longest, float(fill.rstrip("s")))
    return math.ceil(longest)


def local_ratelimit_filter(rates: tuple[tuple[str, RequestRate], ...]) -> dict[str, Any]:
    always = {"default_value": {"numerator": 100, "denominator": "HUNDRED"}}
    return {
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {
            "@type": _LOCAL_RL,
            "stat_prefix": "kvgate_tenant_rate",
            "token_bucket": token_bucket(UNLIMITED, UNLIMITED),
            "filter_enabled": {**always, "runtime_key": "kvgate.rate_limit.enabled"},
            "filter_enforced": {**always, "runtime_key": "kvgate.rate_limit.enforced"},
            "descriptors": [
                {
                    "entries": [{"key": RATE_DESCRIPTOR, "value": tenant}],
                    "token_bucket": token_bucket(r.requests_per_s, r.burst),
                }
                for tenant, r in rates
            ],
            "always_consume_default_token_bucket": False,
            "rate_limits": [
                {
                    "actions": [
                        {"request_headers": {"header_name": TENANT_HEADER, "descriptor_key": RATE_DESCRIPTOR}}
                    ]
                }
            ],
            "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
            "response_headers_to_add": [
                {
                    "header": {"key": "retry-after", "value": str(retry_after_s(rates))},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
            ],
        },
    }


def jwks_cluster(jwks_uri: str, ca_file: str = SYSTEM_CA_BUNDLE) -> dict[str, Any]:
    """The cluster Envoy fetches the JWKS through: TLS (server name and certificate checked) for https."""
    parts = urlsplit(jwks_uri)
    host = parts.hostname or ""
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    cluster: dict[str, Any] = {
        "name": JWKS_CLUSTER,
        "type": "STATIC" if is_ip(host) else "LOGICAL_DNS",
        "connect_timeout": "2s",
        "load_assignment": {
            "cluster_name": JWKS_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
                    ]
                }
            ],
        },
    }
    if not is_ip(host):
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    if tls:
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": _UPSTREAM_TLS,
                "sni": host,
                "common_tls_context": {
                    "validation_context": {
                        "trusted_ca": {"filename": ca_file},
                        "match_typed_subject_alt_names": [
                            {"san_type": "IP_ADDRESS" if is_ip(host) else "DNS", "matcher": {"exact": host}}
                        ],
                    }
                },
            },
        }
    return cluster


def _duration(seconds: float) -> str:
    """A protobuf Duration in JSON: fixed point, milliseconds at most (``g`` wrote 1e6 as ``1e+06s``,
    which Envoy refuses)."""
    return f"{round(seconds, 3):.3f}".rstrip("0").rstrip(".") + "s"
