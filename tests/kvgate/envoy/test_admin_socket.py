"""Envoy's admin on a Unix socket (issue 26, defect 6): ``EnvoyParams.admin_socket`` and ``kvgate
envoy-config --admin-socket``. The admin can raise Envoy's log level until request headers (API keys)
are logged, so only this user may reach it: a 0600 socket, where loopback TCP is open to every local user.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml

from contracts.errors import ConfigError
from kvgate.cli import main as kvgate
from kvgate.dev.procs import UNIX_PREFIX, admin_get, start_envoy
from kvgate.envoy import ready
from kvgate.envoy.bootstrap import EnvoyParams, render, render_yaml


def test_default_admin_stays_on_loopback_tcp() -> None:
    admin = render(EnvoyParams(admin_port=9901))["admin"]
    assert admin == {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9901}}}


def test_cli_admin_socket(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvgate(["envoy-config", "--admin-socket", "/run/kvgate/admin.sock"]) == 0
    admin = yaml.safe_load(capsys.readouterr().out)["admin"]
    assert admin == {"address": {"pipe": {"path": "/run/kvgate/admin.sock", "mode": 0o600}}}


def test_real_envoy_serves_admin_on_a_private_socket(tmp_path: Path) -> None:
    """The bundled Envoy binds the socket 0600 and answers its admin there; its log is 0600 too."""
    sock = tmp_path / "admin.sock"
    params = EnvoyParams(listen_port=0, admin_socket=str(sock), extproc_port=1, access_log_path=None)
    child, admin, port = start_envoy("envoy", render_yaml(params), tmp_path, timeout_s=30)
    try:
        assert admin == f"{UNIX_PREFIX}{sock}" and port > 0
        assert stat.S_ISSOCK(sock.lstat().st_mode) and stat.S_IMODE(sock.lstat().st_mode) == 0o600
        got = admin_get(admin, "/server_info")
        assert got is not None and got[0] == 200 and b'"state": "LIVE"' in got[1]
        assert stat.S_IMODE(child.log_path.stat().st_mode) == 0o600
    finally:
        child.stop()


def test_stats_listener_needs_a_nameable_admin() -> None:
    """The stats listener proxies to the admin: a TCP admin on port 0 has no address to name."""
    with pytest.raises(ConfigError):
        render(EnvoyParams(admin_port=0, stats_port=9902))
    config = render(EnvoyParams(admin_socket="/run/kvgate/admin.sock", stats_port=9902))
    names = [listener["name"] for listener in config["static_resources"]["listeners"]]
    assert names == ["openai", "stats"]
    (admin,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "kvgate_envoy_admin"]
    endpoint = admin["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"] == {"pipe": {"path": "/run/kvgate/admin.sock", "mode": 0o600}}


def test_cli_stats_port(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvgate(["envoy-config", "--admin-socket", "/run/kvgate/admin.sock", "--stats-port", "9902"]) == 0
    static = yaml.safe_load(capsys.readouterr().out)["static_resources"]
    (stats,) = [listener for listener in static["listeners"] if listener["name"] == "stats"]
    assert stats["address"] == {"socket_address": {"address": "127.0.0.1", "port_value": 9902}}


@pytest.mark.parametrize(
    "argv",
    [
        ["--admin-url", "http://127.0.0.1:notaport"],  # was a traceback (http.client.InvalidURL)
        ["--admin-url", "https://127.0.0.1:9901"],  # the admin speaks plain HTTP: was "not ready" forever
        ["--admin-url", "127.0.0.1:9901"],
        ["--admin-url", "http://127.0.0.1:9901/ready"],
        ["--admin-socket", "/run/kvgate/admin.sock", "--interval-s", "-1"],  # was a traceback (sleep)
        ["--admin-socket", "/run/kvgate/admin.sock", "--timeout-s", "nan"],
    ],
)
def test_ready_refuses_bad_usage_with_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m kvgate.envoy.ready``'s usage errors exit 2 with a message, as its docstring says."""
    with pytest.raises(SystemExit) as exc:
        ready.main(argv)
    assert exc.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_ready_takes_an_admin_url() -> None:
    """A well-formed URL of a closed port: probed, not ready (exit 1, quickly)."""
    assert ready.main(["--admin-url", "http://127.0.0.1:1", "--timeout-s", "0.2"]) == 1
    assert ready.main(["--admin-url", "http://[::1]:1/", "--timeout-s", "0.2"]) == 1
