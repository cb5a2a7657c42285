"""The burst endpoints' Envoy config: a DNS + verified-TLS cluster each, the key injected by Envoy from
its file (never rendered), a route chosen by the ext_proc's header that a client cannot send."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from contracts.errors import ConfigError
from extproc.burst.core import BURST_HEADER, parse_burst
from extproc.burst.records import parse_credentials
from kvgate.envoy.bootstrap import (
    ACCESS_LOG_FORMAT,
    STRIPPED_REQUEST_HEADERS,
    EnvoyParams,
    render,
    render_yaml,
)
from kvgate.envoy.burst import SYSTEM_CA_BUNDLE
from tests.kvgate.envoy.test_bootstrap import hcm_of, validate

KEY = "sk-never-rendered-0123"


def params(tmp_path: Path, key: bytes = KEY.encode(), ca: str | None = None) -> EnvoyParams:
    key_file = tmp_path / "hosted.key"
    key_file.write_bytes(key)
    raw = {"name": "hosted", "host": "api.example.com", "api_key_file": str(key_file), "models": {"a": "b"}}
    if ca is not None:
        raw["ca_file"] = ca
    return EnvoyParams(burst=parse_burst([raw]))


def test_cluster_route_and_injected_key(tmp_path: Path) -> None:
    p = params(tmp_path)
    cfg = render(p)
    (cluster,) = [c for c in cfg["static_resources"]["clusters"] if c["name"] == "kvgate_burst_hosted"]
    assert cluster["type"] == "STRICT_DNS"
    tls = cluster["transport_socket"]["typed_config"]
    assert tls["sni"] == "api.example.com"
    validation = tls["common_tls_context"]["validation_context"]
    assert validation["trusted_ca"] == {"filename": SYSTEM_CA_BUNDLE}
    assert validation["match_typed_subject_alt_names"][0]["matcher"] == {"exact": "api.example.com"}
    opts = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    injector = opts["http_filters"][0]["typed_config"]
    assert injector["overwrite"] is True
    (secret,) = cfg["static_resources"]["secrets"]
    assert secret["generic_secret"]["secret"] == {"filename": str(tmp_path / "hosted.key")}
    routes = hcm_of(cfg)["route_config"]["virtual_hosts"][0]["routes"]
    first = routes[0]
    assert first["match"]["headers"][0] == {"name": BURST_HEADER, "string_match": {"exact": "hosted"}}
    assert first["route"]["cluster"] == "kvgate_burst_hosted"
    assert first["route"]["host_rewrite_literal"] == "api.example.com"
    assert BURST_HEADER in STRIPPED_REQUEST_HEADERS  # a client cannot pick the burst route
    assert "authorization" in hcm_of(cfg)["route_config"]["request_headers_to_remove"]
    assert KEY not in render_yaml(p)
    validate(tmp_path, p)  # Envoy 1.40 accepts it: credential_injector as an upstream filter


def test_without_burst_nothing_changes(tmp_path: Path) -> None:
    cfg = render(EnvoyParams())
    assert "secrets" not in cfg["static_resources"]
    assert not any(c["name"].startswith("kvgate_burst_") for c in cfg["static_resources"]["clusters"])


@pytest.mark.parametrize("key", [b"", b"sk-with-newline\n", b"two words"])
def test_a_key_file_envoy_cannot_send_is_refused(tmp_path: Path, key: bytes) -> None:
    with pytest.raises(ConfigError, match="api_key_file"):
        render(params(tmp_path, key))


def test_missing_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ca_file"):
        render(params(tmp_path, ca=str(tmp_path / "missing.pem")))


def test_declared_credentials_give_static_secrets_cds_and_the_cluster_header_route(tmp_path: Path) -> None:
    """etcd's endpoints (burst/<name>): a static secret per declared credential, CDS from the ext_proc,
    and one route taking the cluster from the ext_proc's header (only ``kvgate_burst_*`` values)."""
    key_file = tmp_path / "openai.key"
    key_file.write_bytes(KEY.encode())
    (cred,) = parse_credentials({"openai": {"api_key_file": str(key_file), "hosts": ["api.example.com"]}})
    p = EnvoyParams(burst_credentials=(cred,))
    cfg = render(p)
    (secret,) = cfg["static_resources"]["secrets"]
    assert secret == {
        "name": "kvgate_burst_credential_openai",
        "generic_secret": {"secret": {"filename": str(key_file)}},
    }
    cds = cfg["dynamic_resources"]["cds_config"]["api_config_source"]
    assert cds["grpc_services"] == [{"envoy_grpc": {"cluster_name": "kvgate_extproc"}}]
    route = hcm_of(cfg)["route_config"]["virtual_hosts"][0]["routes"][0]
    assert route["match"]["headers"] == [{"name": BURST_HEADER, "string_match": {"prefix": "kvgate_burst_"}}]
    assert route["route"]["cluster_header"] == BURST_HEADER and route["route"]["auto_host_rewrite"] is True
    assert KEY not in render_yaml(p)
    validate(tmp_path, p)
    key_file.write_bytes(b"")  # a key Envoy cannot send is refused here too
    with pytest.raises(ConfigError, match="api_key_file"):
        render(p)


def test_burst_routes_keep_the_gateways_and_the_clients_headers_from_the_hosted_endpoint(
    tmp_path: Path,
) -> None:
    """Going out: the tenant (its rate limit has counted it), the headers that choose which organization or
    project of the key's account is billed, the client's addresses. Coming back: the account's cookies,
    organization and project. On both kinds of burst route (config and etcd)."""
    key_file = tmp_path / "openai.key"
    key_file.write_bytes(KEY.encode())
    (cred,) = parse_credentials({"openai": {"api_key_file": str(key_file), "hosts": ["api.example.com"]}})
    p = dataclasses.replace(params(tmp_path), burst_credentials=(cred,))
    routes = hcm_of(render(p))["route_config"]["virtual_hosts"][0]["routes"]
    burst_routes = [r for r in routes if r["match"].get("headers", [{}])[0].get("name") == BURST_HEADER]
    assert len(burst_routes) == 2
    for route in burst_routes:
        # the stream idle timeout of a decided request (the listener's covers holds: resilience.py)
        assert route["route"]["idle_timeout"] == "300.0s"
        removed = set(route["request_headers_to_remove"])
        assert {
            BURST_HEADER,
            "x-kvgate-model",
            "x-kvgate-tenant",
            "openai-organization",
            "openai-project",
        } <= removed
        assert {"x-forwarded-for", "x-real-ip", "forwarded", "x-envoy-external-address"} <= removed
        assert set(route["response_headers_to_remove"]) == {
            "set-cookie",
            "openai-organization",
            "openai-project",
        }
    validate(tmp_path, p)


def test_the_access_logs_tenant_is_the_decisions_not_the_header(tmp_path: Path) -> None:
    """A burst route removes x-kvgate-tenant before the hosted endpoint, and Envoy's access log sees request
    headers as the route left them: the tenant comes from the ext_proc's decision metadata."""
    assert ACCESS_LOG_FORMAT["tenant"] == "%DYNAMIC_METADATA(kvgate.decision:tenant)%"
