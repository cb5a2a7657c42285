"""`kvgate up` keeps its children running: SIGKILL one and it is restarted, on the same addresses, while
the rest serves; the launcher itself never stops for it.

Each launcher is ``python -m kvgate.cli up`` in a subprocess (the real command, its supervision and its
``stack.json``), with ``KVGATE_STATE_DIR`` in a temporary directory. One launcher with two simulated
replicas (one process each) and two ext_procs serves the first tests; one with two node agents the last.
Children are found by their PIDs in ``WORKDIR/stack.json``, which names each child's current PID once
it is ready again; nothing waits by sleeping: every wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.dev.procs import http_get
from tests.polling import until

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
BANNER_END = "Ctrl-C stops everything"


class Launcher:
    """One ``kvgate up`` subprocess: its output lines (read on a thread) and its ``stack.json``."""

    def __init__(self, args: list[str], workdir: Path, state_dir: Path) -> None:
        self.workdir = workdir
        env = {**os.environ, "KVGATE_STATE_DIR": str(state_dir)}
        argv = [sys.executable, "-m", "kvgate.cli", "up", "--port", "0", "--workdir", str(workdir), *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        self.lines: list[str] = []
        self._up = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            if BANNER_END in line:
                self._up.set()
        self._up.set()  # exited: whoever waits must look

    def wait_up(self, timeout_s: float) -> None:
        """Until the banner's last line (fails with the output if it exits or times out first)."""
        if not self._up.wait(timeout_s) or self.proc.poll() is not None:
            self.stop()
            raise AssertionError("kvgate up did not come up:\n" + "\n".join(self.lines))

    def info(self) -> dict[str, Any]:
        """``WORKDIR/stack.json`` as it is now."""
        data: dict[str, Any] = json.loads((self.workdir / "stack.json").read_text())
        return data

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def stop(self) -> int:
        """Ctrl-C, as a user stops it; its exit status (SIGKILL if it does not stop in 60 s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """``kvgate up --replicas 2 --extprocs 2``."""
    tmp = tmp_path_factory.mktemp("supervise-sims")
    up = Launcher(["--replicas", "2", "--extprocs", "2"], tmp / "w", tmp / "state")
    up.wait_up(180)
    yield up
    assert up.stop() == 0, "\n".join(up.lines)


def chat(base_url: str) -> httpx.Response | None:
    """One short chat completion through Envoy: the response, or ``None`` when nothing answered."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    try:
        return httpx.post(f"{base_url}/chat/completions", json=body, timeout=10)
    except httpx.HTTPError:
        return None


def served(base_url: str) -> bool:
    got = chat(base_url)
    return got is not None and got.status_code == 200


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def restarted(up: Launcher, name: str, pid: int) -> bool:
    """``stack.json`` names a new, running PID for child ``name`` (written once it is ready again)."""
    new = up.info()["pids"][name]
    return bool(new != pid and alive(new))


async def test_a_killed_replica_is_restarted_on_its_port_while_the_other_serves(sims: Launcher) -> None:
    before = sims.info()
    assert set(before["engines"]) == {"sim-0", "sim-1"} and {"sim-0", "sim-1"} <= set(before["pids"])
    pid, address = before["pids"]["sim-1"], before["engines"]["sim-1"]
    others = {name: p for name, p in before["pids"].items() if name != "sim-1"}
    os.kill(pid, signal.SIGKILL)
    await until(lambda: served(before["base_url"]), 10)  # meanwhile, through Envoy
    await until(lambda: restarted(sims, "sim-1", pid), 60)
    assert sims.proc.poll() is None, "the launcher stopped"
    assert sims.said(f"sim-1 (pid {pid}) died (signal SIGKILL): restarting it in 0.2 s (attempt 1)")
    after = sims.info()
    assert after["engines"]["sim-1"] == address  # the same port: the gateway's endpoint is unchanged
    assert {name: after["pids"][name] for name in others} == others and all(map(alive, others.values()))
    direct = chat(f"http://{address}/v1")
    assert direct is not None and direct.status_code == 200
    assert direct.headers["x-kvgate-replica"] == "sim-1"
    assert all(served(after["base_url"]) for _ in range(4))


async def test_a_killed_extproc_is_restarted_while_the_other_decides(sims: Launcher) -> None:
    before = sims.info()
    assert set(before["extprocs"]) == {"extproc-0", "extproc-1"}
    pid, ports = before["pids"]["extproc-0"], before["extprocs"]["extproc-0"]
    other = before["pids"]["extproc-1"]
    os.kill(pid, signal.SIGKILL)
    await until(lambda: served(before["base_url"]), 10)  # meanwhile, decided by extproc-1
    await until(lambda: restarted(sims, "extproc-0", pid), 60)
    assert sims.proc.poll() is None, "the launcher stopped"
    after = sims.info()
    assert after["extprocs"]["extproc-0"] == ports  # where Envoy's cluster sends its streams
    assert after["pids"]["extproc-1"] == other and alive(other)
    got = http_get(f"http://127.0.0.1:{ports['metrics']}/metrics")
    assert got is not None and got[0] == 200
    assert all(served(after["base_url"]) for _ in range(4))


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Launcher]:
    """``kvgate up --agents 2``."""
    up = Launcher(["--agents", "2"], tmp_path / "w", tmp_path / "state")
    up.wait_up(300)
    yield up
    assert up.stop() == 0, "\n".join(up.lines)


async def test_a_killed_agent_is_restarted(agents: Launcher) -> None:
    before = agents.info()
    pid, engines = before["pids"]["node-0"], before["engines"]
    os.kill(pid, signal.SIGKILL)
    await until(lambda: served(before["base_url"]), 10)  # meanwhile, on node-1's engine
    await until(lambda: restarted(agents, "node-0", pid), 120)
    assert agents.proc.poll() is None, "the launcher stopped"
    assert agents.said(f"node-0 (pid {pid}) died (signal SIGKILL)")
    after = agents.info()
    assert after["engines"] == engines  # the agent's engine is back on its port
    status = json.loads((agents.workdir / "node-0.ready.json").read_text())
    assert status["pid"] == after["pids"]["node-0"] and status["engines"][0]["state"] == "ready"
    assert all(served(after["base_url"]) for _ in range(4))
