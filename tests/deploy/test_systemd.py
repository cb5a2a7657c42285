"""deploy/systemd: each unit passes ``systemd-analyze verify`` and ``systemd-analyze security`` (offline)
with its commands pointing at this virtualenv's real executables, and the readiness each unit relies on
works: the daemons' sd_notify ``READY=1`` (``Type=notify``: a real kvcached started with
``$NOTIFY_SOCKET``), and Envoy's ``ExecStartPost`` probe against a real Envoy."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config import AgentSection
from kvgate.dev.procs import Child, start_envoy
from kvgate.envoy.bootstrap import EnvoyParams, render_yaml
from runtime.lifecycle import announce_ready, notify_systemd
from tests.deploy.prom import DEPLOY, binary

UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
#: Where the units expect kvgate's virtualenv (ExecStart paths); the test points them at this one.
INSTALL_PREFIX = "/opt/kvgate"
#: systemd-analyze security's overall exposure (0-100, 10x what it prints) each unit must stay under.
MAX_EXPOSURE = 25


def unit(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The units with ``/opt/kvgate`` replaced by this virtualenv (verify checks that commands exist)."""
    where = tmp_path_factory.mktemp("units")
    for path in UNITS:
        (where / path.name).write_text(path.read_text().replace(INSTALL_PREFIX, sys.prefix))
    return where


def test_every_daemon_has_a_unit() -> None:
    names = {p.name for p in UNITS}
    assert names == {f"kvgate-{d}.service" for d in ("envoy", "extproc", "agent", "kvcached")}
    assert (DEPLOY / "systemd" / "kvgate.sysusers.conf").read_text().count("\nu kvgate ") == 1


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_unit_verifies_cleanly(path: Path, installed: Path) -> None:
    """No error and no warning (an unknown key or a bad value is only a warning, exit 0)."""
    done = subprocess.run(
        [binary("systemd-analyze"), "verify", str(installed / path.name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), done


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_unit_is_hardened(path: Path, installed: Path) -> None:
    service = unit(path)["Service"]
    assert service["User"] == "kvgate" and service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict" and service["PrivateTmp"] == "yes"
    assert "CapabilityBoundingSet" in service and service["Restart"] == "on-failure"
    assert service["Type"] in ("notify", "exec")
    if service["Type"] == "exec":  # no sd_notify: readiness by the documented ExecStartPost probe
        assert "-m kvgate.envoy.ready" in service["ExecStartPost"]
    done = subprocess.run(
        [
            binary("systemd-analyze"),
            "security",
            "--offline=yes",
            "--no-pager",
            f"--threshold={MAX_EXPOSURE}",
            str(installed / path.name),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr


# -- readiness ----------------------------------------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(120)
    yield sock
    sock.close()


def test_notify_systemd_abstract_and_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify_systemd("READY=1") is False
    name = f"kvgate-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        announce_ready(None, {})
        assert sock.recv(4096).decode() == f"READY=1\nMAINPID={os.getpid()}"


def test_kvcached_notifies_systemd(tmp_path: Path, notify_socket: socket.socket) -> None:
    """A real kvcached daemon sends READY=1 once it serves, and STOPPING=1 at SIGTERM, then exits 0."""
    config = tmp_path / "kvcached.toml"
    config.write_text(
        f'[kvcached]\nnode = "n1"\nlisten_unix = "{tmp_path / "kv.sock"}"\nram_bytes = 1048576\n'
        'feed_listen = "127.0.0.1:0"\nmetrics_listen = "127.0.0.1:0"\n'
    )
    argv = [sys.executable, "-m", "kvcached.main", "--config", str(config)]
    child = Child(
        "kvcached", argv, tmp_path / "kvcached.log", env={"NOTIFY_SOCKET": notify_socket.getsockname()}
    )
    try:
        message = notify_socket.recv(4096).decode()
        assert message == f"READY=1\nMAINPID={child.pid}", child.tail()
        assert (tmp_path / "kv.sock").exists()  # it serves when it says so
        os.kill(child.pid, signal.SIGTERM)
        assert notify_socket.recv(4096) == b"STOPPING=1"
        assert child.proc.wait(timeout=30) == 0, child.tail()
    finally:
        child.stop()


def test_envoy_ready_probe(tmp_path: Path) -> None:
    """``python -m kvgate.envoy.ready`` (the Envoy unit's ExecStartPost) exits 0 against a ready Envoy's
    admin socket and 1 when nothing answers in time."""
    sock = tmp_path / "admin.sock"
    params = EnvoyParams(listen_port=0, admin_socket=str(sock), extproc_port=1, access_log_path=None)
    envoy, _, _ = start_envoy("envoy", render_yaml(params), tmp_path, timeout_s=60)
    probe = [sys.executable, "-m", "kvgate.envoy.ready", "--timeout-s", "30"]
    try:
        done = subprocess.run(
            [*probe, "--admin-socket", str(sock)], capture_output=True, timeout=60, check=False
        )
        assert done.returncode == 0, done
    finally:
        envoy.stop()
    missing = [*probe[:-1], "0.3", "--admin-socket", str(tmp_path / "none.sock")]
    done = subprocess.run(missing, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and "not ready" in done.stderr


def exec_start(path: Path) -> list[str]:
    """The unit's ExecStart as argv, pointed at this virtualenv."""
    return shlex.split(unit(path)["Service"]["ExecStart"].replace(INSTALL_PREFIX, sys.prefix))


def test_envoy_unit_command_validates_the_documented_bootstrap(tmp_path: Path) -> None:
    """The Envoy unit's own command line, on the bootstrap its header says to render, passes Envoy's
    ``--mode validate`` (flags and config both)."""
    path = DEPLOY / "systemd" / "kvgate-envoy.service"
    header = [line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#   ")]
    render = shlex.split(" ".join(line.removesuffix("\\").strip() for line in header))
    assert render[:2] == ["kvgate", "envoy-config"] and render[-2] == ">"
    config = tmp_path / "envoy.yaml"
    rendered = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", *render[1:-2]],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    config.write_text(rendered.stdout)
    argv = [config.as_posix() if a == render[-1] else a for a in exec_start(path)]
    done = subprocess.run(
        [*argv, "--mode", "validate"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and "OK" in done.stdout + done.stderr, (
        done.stdout[-2000:] + done.stderr[-2000:]
    )


@pytest.mark.parametrize("daemon", ["extproc", "agent", "kvcached"])
def test_daemon_units_run_a_kvgate_command_with_its_flags(daemon: str) -> None:
    argv = exec_start(DEPLOY / "systemd" / f"kvgate-{daemon}.service")
    assert Path(argv[0]) == Path(sys.prefix) / "bin" / "kvgate" and argv[1] == daemon
    helped = subprocess.run(
        [*argv[:2], "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert {a for a in argv[2:] if a.startswith("--")} <= set(re.findall(r"--[a-z][a-z-]*", helped))


#: systemd's specifiers for the system manager's directories, as the units use them.
SPECIFIERS = {"%S": "/var/lib", "%C": "/var/cache", "%t": "/run", "%L": "/var/log"}


def test_the_agents_engines_have_a_writable_home() -> None:
    """The engines the agent starts inherit its environment and write their caches under ``$HOME``
    (Hugging Face downloads, vLLM, Triton, torch). With ``ProtectSystem=strict`` only the unit's own
    state, cache, runtime and log directories and its private /tmp are writable, so ``$HOME`` (the
    kvgate user's home from the sysusers file, unless the unit sets it) must lie in one of them."""
    path = DEPLOY / "systemd" / "kvgate-agent.service"
    service = unit(path)["Service"]
    assert service["ProtectSystem"] == "strict" and service["PrivateTmp"] == "yes"
    (user,) = [
        shlex.split(line)
        for line in (DEPLOY / "systemd" / "kvgate.sysusers.conf").read_text().splitlines()
        if line.startswith("u kvgate ")
    ]
    environment = dict(
        assignment.split("=", 1)
        for line in path.read_text().splitlines()
        if line.startswith("Environment=")
        for assignment in shlex.split(line.removeprefix("Environment="))
    )
    home = environment.get("HOME", user[4])
    for specifier, directory in SPECIFIERS.items():
        home = home.replace(specifier, directory)
    assert any(Path(home).is_relative_to(w) for w in writable(path)), (home, writable(path))


def writable(path: Path) -> list[str]:
    """What a unit with ``ProtectSystem=strict`` and ``PrivateTmp`` may write: its private /tmp, its own
    state, cache, runtime and log directories, and ``ReadWritePaths``."""
    service = unit(path)["Service"]
    paths = ["/tmp"]
    for key, root in (
        ("StateDirectory", "/var/lib"),
        ("CacheDirectory", "/var/cache"),
        ("RuntimeDirectory", "/run"),
        ("LogsDirectory", "/var/log"),
    ):
        paths += [f"{root}/{d}" for d in service.get(key, "").split()]
    return paths + service.get("ReadWritePaths", "").split()


def test_the_agent_may_write_its_default_state_dir() -> None:
    """The agent's ``[agent] state_dir`` (engine logs, KV-event sockets, slot saves, offload files) by
    default, as README and every recipe's node.toml set it, is one the agent's unit may write."""
    state_dir = AgentSection(id="").state_dir
    path = DEPLOY / "systemd" / "kvgate-agent.service"
    assert any(Path(state_dir).is_relative_to(w) for w in writable(path)), (state_dir, writable(path))


def test_the_kvcached_paths_the_readme_names_are_writable_by_its_unit() -> None:
    """deploy/README.md names kvcached's socket and SSD tier for the units: both lie in a directory the
    kvcached unit may write, and the agent's ``kvcached`` address is that socket."""
    text = " ".join((DEPLOY / "README.md").read_text().split())
    (socket_path,) = set(re.findall(r'`listen_unix = "([^"]+)"`', text))
    (ssd_path,) = set(re.findall(r'`ssd_path = "([^"]+)"`', text))
    (agent_address,) = set(re.findall(r'`kvcached = "([^"]+)"`', text))
    allowed = writable(DEPLOY / "systemd" / "kvgate-kvcached.service")
    for path in (Path(socket_path).parent, Path(ssd_path)):
        assert any(path.is_relative_to(w) for w in allowed), (path, allowed)
    assert agent_address == f"unix:{socket_path}"
