"""End to end: an engine its agent restarts is back in rotation within seconds of being ready.

One stack (``kvgate up --agents 3``: a local etcd, three agents each supervising a simulated vLLM, the
ext_proc following etcd and the agents' feeds, Envoy) under steady load: every request carries the same
long system prompt, which the engines' KV events put in the gateway's precise index. The engine under
``node-0`` is SIGKILLed; its agent restarts it. The gateway must mark it unhealthy at once, send nothing
that fails after that, and route to the new process within :data:`READY_TO_ROUTED_S` of the agent seeing
it ready. (Before, the restarted engine, cache empty, got its first request 11 s after it was ready here,
19 s in the issue's run: the replicas holding the shared prompt won every pick, and the ``balance``
filter still counted the killed process's share.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM
from tests.e2e.test_agents import MODEL, agent_status, healthy_gauges, pid_alive
from tests.polling import poll, until

pytestmark = pytest.mark.e2e

SYSTEM = "You are a careful assistant for a test of engine restarts. " * 40  # ~500 tokens, every request
CLIENTS = 8
HISTORY_S = 10.0
"""Steady load before the fault. The routed share the ``balance`` filter remembers (30 s half-life) grows
with it: after 10 s, the gateway that kept the killed process's share sent the restarted engine its
first request 11 s after it was ready."""
UNHEALTHY_S = 1.0
"""Kill -> the gateway no longer routes there (the agent sees the exit and says so on its feed)."""
READY_TO_ROUTED_S = 5.0
"""The agent sees the new process ready -> a request sent from then on is served by it."""
RESTART_S = 30.0
"""Kill -> the agent sees the new process ready (restart backoff 0.5 s, then the simulator's start)."""


@dataclass(frozen=True, slots=True)
class Sent:
    """One request: when it was sent (monotonic s), its status (0: no response) and who served it."""

    at: float
    status: int
    replica: str | None


class Traffic:
    """:data:`CLIENTS` closed-loop clients through Envoy, each request with :data:`SYSTEM`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sent: list[Sent] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(n)) for n in range(CLIENTS)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def served_by(self, replica: str, since: float) -> bool:
        return any(s.replica == replica and s.at >= since for s in self.sent)

    async def _client(self, n: int) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            i = 0
            while not self._stop.is_set():
                i += 1
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{n}.{i}?"}]
                body = {"model": MODEL, "messages": messages, "max_tokens": 4}
                at = time.monotonic()
                try:
                    resp = await client.post(f"{self.url}/v1/chat/completions", json=body)
                except httpx.HTTPError:
                    self.sent.append(Sent(at, 0, None))
                    continue
                self.sent.append(Sent(at, resp.status_code, resp.headers.get("x-kvgate-replica")))


class Watch:
    """Follows, every 20 ms, the gateway's ``kvgate_endpoint_healthy`` gauge for ``endpoint`` and the
    agent's ``GET /status`` for its engine."""

    def __init__(self, stack: Stack, agent: int, endpoint: str) -> None:
        assert stack.extproc_ports.get("metrics")
        self._metrics = f"http://127.0.0.1:{stack.extproc_ports['metrics']}/metrics"
        self._status = f"http://127.0.0.1:{agent_status(stack, agent)['admin_port']}/status"
        self._endpoint = endpoint
        self.healthy: float | None = None
        self.engine: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None

    def ready_again(self, old_pid: int) -> bool:
        """The agent reports its engine ready in a process other than ``old_pid`` (a pid of ``None``: the
        old one was reaped and the new one not yet spawned)."""
        return self.engine.get("state") == "ready" and self.engine.get("pid") not in (None, old_pid)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        gauge = f'kvgate_endpoint_healthy{{endpoint="{self._endpoint}"}} '
        async with httpx.AsyncClient(timeout=2) as client:
            while True:
                lines = (await client.get(self._metrics)).text.splitlines()
                values = [float(line[len(gauge) :]) for line in lines if line.startswith(gauge)]
                self.healthy = values[0] if values else None
                self.engine = (await client.get(self._status)).json()["engines"][0]
                await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(agents=3, agent_args=FAST_SIM, port=0, workdir=tmp_path_factory.mktemp("rotation"))
    with Stack(options) as running:
        poll(lambda: True if len(healthy_gauges(running)) == 3 else None, 10, "3 endpoints in the ext_proc")
        yield running


async def test_engine_restarted_by_its_agent_takes_traffic_within_seconds_of_ready(stack: Stack) -> None:
    traffic, watch = Traffic(stack.url), Watch(stack, 0, "sim-0")
    traffic.start()
    watch.start()
    try:
        await until(lambda: watch.healthy == 1.0 and watch.engine.get("state") == "ready", 5)
        await asyncio.sleep(HISTORY_S)  # the load history the fault happens in (not a readiness wait)
        assert {s.replica for s in traffic.sent} >= {"sim-0-0", "sim-1-0", "sim-2-0"}
        old_pid = watch.engine["pid"]
        os.kill(old_pid, signal.SIGKILL)
        await until(lambda: watch.healthy == 0.0, UNHEALTHY_S)
        out = time.monotonic()
        await until(lambda: watch.ready_again(old_pid), RESTART_S)
        ready = time.monotonic()
        assert watch.engine["restarts"] == 1 and not pid_alive(old_pid)
        await until(lambda: traffic.served_by("sim-0-0", ready), READY_TO_ROUTED_S)
    finally:
        await traffic.stop()
        await watch.aclose()
    failed = [s for s in traffic.sent if s.status != 200 and s.at >= out]
    assert not failed, f"{len(failed)} requests sent after the kill was seen failed: {failed[:5]}"
