"""End to end with node agents: etcd registration, agent death, drains and run-time policy.

One stack (``kvgate up --agents 3``: a local etcd, three agents each supervising a simulated vLLM, the
ext_proc following etcd and the agents' feeds, Envoy) serves the module; the tests that take an agent
down run last, and extra agents are started beside it with :func:`start_agent`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.gguf import ensure_model_dir, smollm2_gguf_path
from kvgate.dev.procs import Child, http_get
from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM
from tests.polling import poll

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
LEASE_TTL_S = 2
LONG = "Node agents register their engines in etcd under a lease and stream KV events to gateways. " * 10
_LOAD = "kvgate_endpoint_load{"
_GAUGE = re.compile(r'^kvgate_endpoint_healthy\{endpoint="([^"]+)"\} (\S+)$')


# -- helpers (also used by test_precise) -----------------------------------------------------------------


def start_agent(
    workdir: Path,
    etcd_address: str,
    index: int,
    *,
    args: tuple[str, ...] = FAST_SIM,
    lease_ttl_s: int = LEASE_TTL_S,
    drain_timeout_s: float = 10.0,
    engine_options: dict[str, Any] | None = None,
) -> tuple[Child, Path]:
    """Start ``python -m agent.main`` for node ``node-<index>`` supervising simulated engine
    ``sim-<index>`` (extra sim flags ``args``, extra ``[[engines]]`` keys ``engine_options``), written like
    :class:`kvgate.dev.up.Stack` writes its nodes. Returns the child and its ready-file path (not waited
    for)."""
    node = f"node-{index}"
    config = {
        "agent": {
            "id": node,
            "lease_ttl_s": lease_ttl_s,
            "drain_timeout_s": drain_timeout_s,
            "state_dir": str(workdir / node),
        },
        "etcd": {"endpoints": [etcd_address]},
        "engines": [
            {
                "id": f"sim-{index}",
                "kind": "sim",
                "model": MODEL,
                "model_path": str(ensure_model_dir(smollm2_gguf_path())),
                "args": list(args),
                **(engine_options or {}),
            }
        ],
    }
    path = workdir / f"{node}.json"
    path.write_text(json.dumps(config, indent=2))
    ready = workdir / f"{node}.ready.json"
    argv = [sys.executable, "-m", "agent.main", "--config", str(path), "--ready-file", str(ready)]
    return Child(node, argv, workdir / f"{node}.log"), ready


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


# -- this module's helpers -------------------------------------------------------------------------------


def healthy_gauges(stack: Stack) -> dict[str, float]:
    """``kvgate_endpoint_healthy`` per endpoint, as the ext_proc exports it now."""
    got = http_get(f"http://127.0.0.1:{stack.extproc_ports['metrics']}/metrics")
    assert got is not None and got[0] == 200
    gauges = {}
    for line in got[1].decode().splitlines():
        m = _GAUGE.match(line)
        if m:
            gauges[m.group(1)] = float(m.group(2))
    return gauges


def gauge_is(stack: Stack, endpoint: str, value: float | None) -> Callable[[], bool | None]:
    """A probe: the endpoint's healthy gauge equals ``value`` (``None``: the endpoint is not exported)."""
    return lambda: True if healthy_gauges(stack).get(endpoint) == value else None


def chat(stack: Stack, prompt: str, max_tokens: int = 2) -> str:
    """Send a chat request through Envoy; the replica that served it (it must succeed)."""
    resp = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    return resp.headers["x-kvgate-replica"]


def kvgate(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvgate ARGS`` as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kvgate.cli", *args], capture_output=True, text=True, timeout=60, check=False
    )


def etcd_of(stack: Stack) -> str:
    assert stack.etcd is not None
    return stack.etcd.address


def agent_status(stack: Stack, i: int) -> dict[str, Any]:
    """What agent ``i`` wrote to its ready-file (its status once every engine was ready)."""
    status: dict[str, Any] = json.loads(stack.agent_configs[i].with_suffix(".ready.json").read_text())
    return status


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        agents=3,
        agent_args=FAST_SIM,
        lease_ttl_s=LEASE_TTL_S,
        port=0,
        workdir=tmp_path_factory.mktemp("agents"),
    )
    with Stack(options) as running:
        poll(lambda: True if len(healthy_gauges(running)) == 3 else None, 10, "3 endpoints in the ext_proc")
        yield running


# -- registration ----------------------------------------------------------------------------------------


def test_every_agent_endpoint_is_healthy_in_the_extproc(stack: Stack) -> None:
    assert healthy_gauges(stack) == {"sim-0": 1.0, "sim-1": 1.0, "sim-2": 1.0}
    served = {chat(stack, f"{i} registration. {LONG}") for i in range(9)}
    assert served <= {"sim-0-0", "sim-1-0", "sim-2-0"} and len(served) >= 2


def test_new_agent_is_routable_within_a_second_of_ready(stack: Stack) -> None:
    child, ready = start_agent(stack.workdir, etcd_of(stack), 3)
    try:
        child.wait_for_json_file(ready, 120)
        ready_at = ready.stat().st_mtime  # the agent wrote it once registered in etcd
        poll(gauge_is(stack, "sim-3", 1.0), 5, "sim-3 healthy in the ext_proc")
        delay = time.time() - ready_at
        assert delay < 1.0, f"ext_proc saw the new endpoint {delay:.3f} s after the agent was ready"
    finally:
        assert child.stop() == 0, child.tail()  # SIGTERM: a graceful drain, exit 0
    poll(gauge_is(stack, "sim-3", None), 5, "sim-3 deregistered")


# -- run-time policy -------------------------------------------------------------------------------------


def loads_zero(stack: Stack) -> bool | None:
    """Probe: the ext_proc estimates no request at any engine (every agent's latest load arrived)."""
    got = http_get(f"http://127.0.0.1:{stack.extproc_ports['metrics']}/metrics")
    assert got is not None and got[0] == 200
    loads = [float(line.split()[-1]) for line in got[1].decode().splitlines() if line.startswith(_LOAD)]
    return True if loads and not any(loads) else None


def batch_from_idle(stack: Stack, prompt: str) -> list[str]:
    """Once the ext_proc sees every engine idle, send ``prompt`` three times in a row; who served each."""
    poll(lambda: loads_zero(stack), 3, "every endpoint load 0 in the ext_proc")
    return [chat(stack, prompt) for _ in range(3)]


def test_policy_changes_routing_without_restart(stack: Stack) -> None:
    """From idle (load 0 everywhere), three copies of a long prompt in a row:

    - default policy: all three go to the replica holding the prompt (prefix weight 3 outweighs the
      in-flight score the first two cost it: 2 x 1/8);
    - ``weights/prefix 0``, ``weights/in-flight 10``, ``weights/cache-spread 0``: only the load the
      gateway just routed counts, so the three land on three different replicas. That cannot happen with
      the default weights, so seeing it proves the policy arrived through etcd (polled: the watch is
      asynchronous) in the running ext_proc.

    (Why from idle: an agent reports its engine's load when it changes and every 0.5 s otherwise, and
    requests this short start and finish between reports, so the gateway's "routed since the last
    report" count grows until the next one; past 4 the default load-threshold filter moves traffic off
    the prefix owner by itself.)
    """
    etcd = ["--etcd", etcd_of(stack)]
    prompt = f"policy test. {LONG}"
    extproc = stack.extproc
    assert extproc is not None
    pid = extproc.pid
    owner = chat(stack, prompt)
    sticky = batch_from_idle(stack, prompt)
    assert sticky == [owner] * 3, (owner, sticky)
    changed = (("weights/prefix", "0"), ("weights/in-flight", "10"), ("weights/cache-spread", "0"))
    try:
        for path, value in changed:
            done = kvgate("policy", "set", path, value, *etcd)
            assert done.returncode == 0, done.stderr
        poll(lambda: True if len(set(batch_from_idle(stack, prompt))) == 3 else None, 10, "spread", 0)

        refused = kvgate("policy", "set", "weights/prefix", "-1", *etcd)
        assert refused.returncode == 2 and "weights/prefix" in refused.stderr, refused
        got = kvgate("policy", "get", "weights/prefix", *etcd)
        assert got.returncode == 0 and float(got.stdout) == 0.0, got  # nothing written, 0 stays
        assert extproc.alive() and extproc.pid == pid  # no restart
    finally:
        for path, _ in changed:
            assert kvgate("policy", "unset", path, *etcd).returncode == 0
    got = kvgate("policy", "get", "weights/prefix", *etcd)
    assert float(got.stdout) == 3.0, got


# -- drain -----------------------------------------------------------------------------------------------


def test_drain_and_undo(stack: Stack) -> None:
    etcd = ["--etcd", etcd_of(stack)]
    done = kvgate("drain", "sim-1", *etcd)
    assert done.returncode == 0 and "draining" in done.stdout, done
    try:
        # The ext_proc follows etcd's watch: the drain shows within milliseconds; from then on nothing
        # new goes there.
        poll(gauge_is(stack, "sim-1", 0.0), 1, "sim-1 draining in the ext_proc")
        served = [chat(stack, f"{i} drain test. {LONG}") for i in range(12)]
        assert set(served) <= {"sim-0-0", "sim-2-0"}, served
    finally:
        undone = kvgate("drain", "sim-1", "--undo", *etcd)
        assert undone.returncode == 0 and "no longer draining" in undone.stdout, undone
    poll(gauge_is(stack, "sim-1", 1.0), 1, "sim-1 eligible again")
    counter = iter(range(10_000))
    poll(
        lambda: True if chat(stack, f"{next(counter)} undo test. {LONG}") == "sim-1-0" else None,
        10,
        "a request routed to sim-1 again",
        0,
    )


def test_sigterm_drains_gracefully(stack: Stack) -> None:
    """SIGTERM: the agent reports draining, lets the in-flight stream finish, deregisters, exits 0."""
    # Real-time steps (6 ms each): a 300-token stream takes about 2 s, so it is in flight at SIGTERM.
    child, ready = start_agent(stack.workdir, etcd_of(stack), 4, args=("--time-scale", "1"))
    try:
        status = child.wait_for_json_file(ready, 120)
        address = status["engines"][0]["address"]
        poll(gauge_is(stack, "sim-4", 1.0), 5, "sim-4 healthy in the ext_proc")
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "A long story, please."}],
            "max_tokens": 300,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        chunks: list[dict[str, Any]] = []
        with httpx.stream("POST", f"http://{address}/v1/chat/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    break
            child.proc.send_signal(signal.SIGTERM)
            poll(gauge_is(stack, "sim-4", 0.0), 1, "sim-4 draining in the ext_proc")
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        usage = chunks[-1]["usage"]
        assert usage is not None and usage["completion_tokens"] == 300
        assert child.proc.wait(30) == 0, child.tail()
        poll(gauge_is(stack, "sim-4", None), 1, "sim-4 deregistered")
        assert not pid_alive(status["engines"][0]["pid"])
    finally:
        child.stop()


# -- agent death (last: takes sim-2 away for good) -------------------------------------------------------


def test_killed_agent_is_dropped_and_traffic_moves(stack: Stack) -> None:
    engine_pid = agent_status(stack, 2)["engines"][0]["pid"]
    assert pid_alive(engine_pid)
    os.kill(stack.agents[2].pid, signal.SIGKILL)
    killed = time.monotonic()
    poll(gauge_is(stack, "sim-2", 0.0), 1, "sim-2 unhealthy (its feed lost)")
    unhealthy_s = time.monotonic() - killed
    poll(lambda: None if pid_alive(engine_pid) else True, 10, "the engine gone with its agent")
    poll(gauge_is(stack, "sim-2", None), LEASE_TTL_S + 3, "sim-2 removed (lease expired)")
    removed_s = time.monotonic() - killed
    assert unhealthy_s < 1.0 and removed_s < LEASE_TTL_S + 3, (unhealthy_s, removed_s)
    served = [chat(stack, f"{i} after the kill. {LONG}") for i in range(12)]
    assert set(served) <= {"sim-0-0", "sim-1-0"}, served
