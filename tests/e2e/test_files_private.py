"""Issue 26, defect 6: what ``kvgate up`` leaves on disk, and Envoy's admin, are this user's only.

A log may hold what a debug level prints (request headers, API keys among them), and Envoy's admin can
raise that level (``POST /logging?level=debug``): so every log is 0600, the work directory the launcher
makes is 0700, and the admin listens on a 0600 Unix socket in it instead of a loopback TCP port that any
local user can reach. One small real stack (one simulated replica); the work directory is one the
launcher has to create (``--workdir`` naming a directory that does not exist yet).
"""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from kvgate.dev.procs import UNIX_PREFIX, admin_get
from kvgate.dev.supervise import Backoff
from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM
from tests.polling import until


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("private") / "work"
    options = StackOptions(replicas=1, port=0, sim_args=FAST_SIM, workdir=workdir)
    with Stack(options) as running:
        model = running.models[0]
        body = {"model": model, "prompt": "hello", "max_tokens": 2}
        assert httpx.post(f"{running.url}/v1/completions", json=body, timeout=30).status_code == 200
        yield running


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_workdir_is_private(stack: Stack) -> None:
    assert mode(stack.workdir) == 0o700


def test_every_log_is_private(stack: Stack) -> None:
    """Each log ``stack.json`` lists and every ``*.log`` in the work directory (children's, Envoy's,
    Envoy's access log): no group or other bits."""
    assert stack.info is not None
    logs = {Path(p) for p in stack.info.logs.values()} | set(stack.workdir.glob("*.log"))
    assert {stack.access_log, stack.workdir / "envoy.log", stack.workdir / "sim.log"} <= logs
    for path in logs:
        assert mode(path) & 0o077 == 0, f"{path} is {oct(mode(path))}"


async def test_access_log_written_and_still_private(stack: Stack) -> None:
    """Envoy appends to the access log made for it, keeping its mode (flushed within a second)."""
    await until(lambda: stack.access_log.stat().st_size > 0, 10)
    assert mode(stack.access_log) == 0o600


def test_admin_is_a_private_unix_socket(stack: Stack) -> None:
    """No loopback TCP admin: the rendered bootstrap's admin is a 0600 socket, the only way in."""
    assert stack.admin_url == f"{UNIX_PREFIX}{stack.admin_socket}"
    assert stat.S_ISSOCK(stack.admin_socket.lstat().st_mode) and mode(stack.admin_socket) == 0o600
    admin = yaml.safe_load((stack.workdir / "envoy.yaml").read_text())["admin"]
    assert admin == {"address": {"pipe": {"path": str(stack.admin_socket), "mode": 0o600}}}
    got = admin_get(stack.admin_url, "/ready")
    assert got is not None and got[0] == 200


async def test_restarted_envoy_serves_its_admin_on_the_same_socket(stack: Stack) -> None:
    """SIGKILLed, Envoy leaves its socket behind; the restart removes it and binds it anew (still 0600),
    and its log, appended to, stays private."""
    assert stack.envoy is not None
    old = stack.envoy.pid
    stack.supervise(Backoff(initial_s=0.05, max_s=0.5))
    os.kill(old, signal.SIGKILL)

    def ready_again() -> bool:
        assert stack.envoy is not None
        got = admin_get(stack.admin_url, "/ready")
        return stack.envoy.pid != old and got is not None and got[0] == 200

    await until(ready_again, 30)
    assert mode(stack.admin_socket) == 0o600 and mode(stack.workdir / "envoy.log") == 0o600


def test_admin_socket_of_a_long_workdir_is_in_a_private_directory(tmp_path: Path) -> None:
    """A work directory too long for a socket's path (108 bytes) puts the socket in a 0700 directory of
    its own instead of failing Envoy's start."""
    workdir = tmp_path / ("w" * 120)
    sock = Stack(StackOptions(replicas=1, port=0, workdir=workdir)).admin_socket
    try:
        assert len(os.fsencode(sock)) < 108 and sock.parent != workdir and mode(sock.parent) == 0o700
    finally:
        sock.parent.rmdir()
