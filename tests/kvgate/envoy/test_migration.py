"""Envoy's side of in-flight migration: opted-in models go to the proxy with the ext_proc's hosts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from contracts.epp import MODEL_HEADER
from contracts.errors import ConfigError
from extproc.config import parse_config
from extproc.migration.proxy import LIMIT_HEADER, UPSTREAMS_HEADER
from kvgate.cli import main as kvgate
from kvgate.envoy.bootstrap import STRIPPED_REQUEST_HEADERS, EnvoyParams, render
from kvgate.envoy.migration import CLUSTER, EnvoyMigration, migrating_models
from kvgate.envoy.migration import routes as migration_routes
from kvgate.envoy.tls import EnvoyTls
from tests.kvgate.envoy.test_bootstrap import hcm_of, validate

MIGRATION = EnvoyMigration("127.0.0.1", 9010, (("m", 2, 30.0),))


def test_route_cluster_and_headers(tmp_path: Path) -> None:
    p = EnvoyParams(listen_port=0, admin_port=0, migration=MIGRATION)
    cfg = render(p)
    routes = hcm_of(cfg)["route_config"]["virtual_hosts"][0]["routes"]
    first = routes[0]
    assert first["match"]["headers"] == [{"name": MODEL_HEADER, "string_match": {"exact": "m"}}]
    assert first["route"]["cluster"] == CLUSTER and "retry_policy" not in first["route"]
    assert first["route"]["idle_timeout"] == "30.0s"
    added = {h["header"]["key"]: h["header"]["value"] for h in first["request_headers_to_add"]}
    # The hosts come from the ext_proc's metadata only; a client's copies never pass the listener.
    assert added == {
        UPSTREAMS_HEADER: "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%",
        LIMIT_HEADER: "2",
    }
    assert UPSTREAMS_HEADER in STRIPPED_REQUEST_HEADERS and LIMIT_HEADER in STRIPPED_REQUEST_HEADERS
    assert routes[-1]["route"]["cluster"] == "kvgate_engines"  # every other model: as before
    # A model without its own idle timeout gets the stream idle timeout on its route (the listener's
    # covers the holds before a decision: resilience.py).
    plain = EnvoyMigration("127.0.0.1", 9010, (("m", 2, None),))
    (route,) = migration_routes(plain, 300.0)
    assert route["route"]["idle_timeout"] == "300.0s"
    clusters = [c["name"] for c in cfg["static_resources"]["clusters"]]
    assert CLUSTER in clusters
    validate(tmp_path, p)


def test_without_migration_nothing_changes() -> None:
    cfg = render(EnvoyParams(listen_port=0, admin_port=0))
    assert CLUSTER not in [c["name"] for c in cfg["static_resources"]["clusters"]]


def model(**extra: object) -> dict[str, object]:
    return {"name": "m", "gguf": "smollm2", **extra}


def test_models_opt_in_and_are_validated() -> None:
    config = parse_config({"models": [model(migration=True, migration_limit=2), {**model(), "name": "n"}]})
    assert migrating_models(config) == (("m", 2, None),)
    assert parse_config({"models": [model(migration=True)]}).models[0].migration_limit == 3
    for bad in (
        {"migration": "yes"},
        {"migration_limit": 0},
        {"migration_limit": 17},
        {"migration_limit": 1.5},
    ):
        with pytest.raises(ConfigError, match="migration"):
            parse_config({"models": [model(**bad)]})


def test_envoy_config_renders_the_opted_in_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gateway = tmp_path / "gateway.toml"
    gateway.write_text('[[models]]\nname = "m"\ngguf = "smollm2"\nmigration = true\n')
    argv = ["envoy-config", "--gateway-config", str(gateway)]
    assert kvgate(argv) == 2  # where the proxy listens must be said
    assert "--migration-proxy" in capsys.readouterr().err
    assert kvgate([*argv, "--migration-proxy", "127.0.0.1:9010"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == CLUSTER]
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "127.0.0.1", "port_value": 9010}


@pytest.mark.parametrize("host", ["10.0.0.5", "proxy.internal", "localhost", "0.0.0.0"])
def test_the_secure_profile_refuses_a_migration_proxy_off_loopback(host: str) -> None:
    """The proxy serves plain HTTP: under the secure profile (TLS on every hop) Envoy may reach it only on
    this machine's loopback, never send prompts across a network in clear."""
    migration = EnvoyMigration(host, 9010, (("m", 2, None),))
    with pytest.raises(ConfigError, match="--migration-proxy"):
        render(EnvoyParams(tls=EnvoyTls(), migration=migration))
    render(EnvoyParams(migration=migration))  # the plaintext profile: the operator's network


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1"])
def test_the_secure_profile_takes_a_migration_proxy_on_loopback(host: str) -> None:
    cfg = render(EnvoyParams(tls=EnvoyTls(), migration=EnvoyMigration(host, 9010, (("m", 2, None),))))
    assert CLUSTER in [c["name"] for c in cfg["static_resources"]["clusters"]]


def test_a_migration_proxy_named_by_host_name_validates(tmp_path: Path) -> None:
    """``--migration-proxy localhost:9010``: a name, resolved by DNS (a STATIC cluster takes addresses
    only, and Envoy refused the whole config)."""
    p = EnvoyParams(
        listen_port=0, admin_port=0, migration=EnvoyMigration("localhost", 9010, (("m", 2, None),))
    )
    (cluster,) = [c for c in render(p)["static_resources"]["clusters"] if c["name"] == CLUSTER]
    assert cluster["type"] == "STRICT_DNS"
    validate(tmp_path, p)
    p = EnvoyParams(listen_port=0, admin_port=0, migration=MIGRATION)
    (cluster,) = [c for c in render(p)["static_resources"]["clusters"] if c["name"] == CLUSTER]
    assert cluster["type"] == "STATIC"
