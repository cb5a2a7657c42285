"""Faults under a small steady load, through real Envoy, separate engine processes and supervision.

Each test kills or stops one process of a running ``kvgate up`` stack while :class:`SteadyLoad` sends
requests, then checks what issue 23 promises: only requests in flight on the failed process fail, no
request is sent to a dead or hung endpoint once the gateway has detected it, nothing outlives its
configured bound, and the stack recovers (the process restarted, the engine back in rotation) within a
stated time. Timings are event-driven (``tests/polling.py``); the only waits are the load's own windows.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.dev.procs import admin_get
from kvgate.dev.supervise import Backoff
from kvgate.dev.supervisor import Service
from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM
from tests.e2e.steady import Outcome, SteadyLoad

MODEL = "SmolLM2-135M-Instruct"
#: The model's bounds: a stream's response headers, silence either way, the whole response.
FIRST_BYTE_S, IDLE_S, REQUEST_S = 2.0, 3.0, 5.0
#: Bounds this file states: detection, a restart, and a recovered engine taking traffic again.
DETECT_S, RESTART_S, ROTATION_S = 2.0, 15.0, 5.0
#: Client-side slack over Envoy's bounds (scheduling on a loaded 2-core machine).
SLACK_S = 1.5
#: A decision made just before the gateway noticed a failure still reaches Envoy within this.
DISPATCH_S = 0.2
FAST_RESTART = Backoff(initial_s=0.1, max_s=1.0, stable_s=30.0)


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Four simulator processes and two ext_procs, supervised, with short first-byte and request bounds."""
    options = StackOptions(
        replicas=4,
        extprocs=2,
        port=0,
        sim_args=FAST_SIM,
        workdir=tmp_path_factory.mktemp("faults"),
        overlay={
            "timeouts": {"request_s": REQUEST_S, "first_byte_s": FIRST_BYTE_S},
            "models": [{"name": MODEL, "gguf": "smollm2", "idle_timeout_s": IDLE_S}],
        },
    )
    with Stack(options) as stack:
        stack.supervise(FAST_RESTART)
        yield stack


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Three node agents (one simulated engine each) and a local etcd, supervised."""
    options = StackOptions(
        agents=3, port=0, agent_args=FAST_SIM, workdir=tmp_path_factory.mktemp("faults-agents")
    )
    with Stack(options) as stack:
        stack.supervise(FAST_RESTART)
        yield stack


# --- what the gateway exposes ----------------------------------------------------------------------------


def healthy(stack: Stack, endpoint_id: str) -> list[bool]:
    """Each ext_proc's view: is ``endpoint_id`` eligible (``kvgate_endpoint_healthy``)?"""
    out = []
    for ports in stack.extproc_listeners:
        text = httpx.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=2).text
        m = re.search(rf'^kvgate_endpoint_healthy{{endpoint="{re.escape(endpoint_id)}"}} (\S+)$', text, re.M)
        out.append(m is not None and float(m.group(1)) == 1.0)
    return out


def ejections(stack: Stack, endpoint_id: str) -> list[float]:
    """Each ext_proc's count of ejections of ``endpoint_id`` (any kind)."""
    out = []
    for ports in stack.extproc_listeners:
        text = httpx.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=2).text
        pattern = (
            rf'^kvgate_endpoint_ejections_total{{endpoint="{re.escape(endpoint_id)}",kind="[^"]+"}} (\S+)$'
        )
        out.append(sum(float(v) for v in re.findall(pattern, text, re.M)))
    return out


def envoy_counter(stack: Stack, address: str, counter: str) -> int:
    """Envoy's per-host counter of the engine cluster (``cx_connect_fail``: tries that found no process
    listening; ``rq_total``: tries sent)."""
    got = admin_get(stack.admin_url, "/clusters", timeout_s=2)
    assert got is not None and got[0] == 200, got
    text = got[1].decode()
    m = re.search(rf"^kvgate_engines::{re.escape(address)}::{counter}::(\d+)$", text, re.M)
    return int(m.group(1)) if m else 0


def sim_address(stack: Stack, name: str) -> str:
    (engine,) = [e for e in stack.engines if e["id"] == name]
    return engine["address"]


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if not o.ok]


async def watch(condition: Callable[[], bool], deadline_s: float) -> float:
    """Poll ``condition()`` until true, in a thread (it reads HTTP; the load shares this event loop): the
    monotonic time it became true (``tests/polling.py`` ``until`` polls on the loop itself). A process
    not answering yet (restarting) counts as false."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if await asyncio.to_thread(_holds, condition):
            return time.monotonic()
        await asyncio.sleep(0.02)  # a polling period, not a readiness wait
    raise AssertionError(f"not true within {deadline_s} s")


def _holds(condition: Callable[[], bool]) -> bool:
    try:
        return condition()
    except httpx.TransportError:
        return False


def load(stack: Stack) -> SteadyLoad:
    return SteadyLoad(stack.url, MODEL, clients=4, client_timeout_s=REQUEST_S + 10)


async def window(seconds: float) -> None:
    await asyncio.sleep(seconds)  # the load runs meanwhile: a measurement window, not a readiness wait


# --- simulators and ext_procs ----------------------------------------------------------------------------


def busiest(stack: Stack, steady: SteadyLoad) -> Service[Any]:
    """The simulator that served the most of the load so far: one in rotation (with one shared prompt and
    prefix affinity, a replica that never got it stays idle under a light load, by design)."""
    served = Counter(o.endpoint for o in steady.outcomes if o.ok)
    return max(stack.sims, key=lambda s: served[sim_address(stack, s.name)])


async def test_a_killed_replica_costs_only_its_requests_in_flight(sims: Stack) -> None:
    async with load(sims) as steady:
        await window(1.5)
        victim = busiest(sims, steady)
        address, old_pid = sim_address(sims, victim.name), victim.pid
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        detected = await watch(lambda: not any(healthy(sims, victim.name)), DETECT_S)
        await window(DISPATCH_S)  # decisions made just before detection reach Envoy
        refused_at_detection = envoy_counter(sims, address, "cx_connect_fail")
        back = await watch(lambda: victim.pid != old_pid and all(healthy(sims, victim.name)), RESTART_S)
        refused_after_detection = envoy_counter(sims, address, "cx_connect_fail") - refused_at_detection
        await window(ROTATION_S)
    failed = failures(steady.outcomes)
    assert all(o.started < killed for o in failed), failed  # only requests already on the replica
    assert all(o.endpoint in (address, None) for o in failed), failed
    assert refused_after_detection == 0  # nothing sent to the dead process once it was detected
    served = [o for o in steady.between(back, back + ROTATION_S) if o.endpoint == address and o.ok]
    assert served, "the restarted replica took no traffic"
    assert detected - killed < DETECT_S and len(steady.between(killed, back)) > 10


async def test_a_killed_ext_proc_costs_only_its_decisions_in_flight(sims: Stack) -> None:
    victim, survivor = sims.extprocs[0], sims.extprocs[1]
    old_pid, other_pid = victim.pid, survivor.pid
    async with load(sims) as steady:
        await window(1.5)
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        await watch(lambda: victim.pid != old_pid and victim.returncode is None, RESTART_S)
        await watch(lambda: all(healthy(sims, s.name)[0] for s in sims.sims), RESTART_S)
        await window(1.0)
    late = [o for o in failures(steady.outcomes) if o.started >= killed]
    assert not late, (len(late), [round(o.started - killed, 3) for o in late])  # only decisions in flight
    assert survivor.pid == other_pid
    assert len(steady.between(killed, time.monotonic())) > 10


async def test_a_stopped_replica_is_bounded_detected_and_back_after_continue(sims: Stack) -> None:
    async with load(sims) as steady:
        await window(1.5)
        victim = busiest(sims, steady)
        address, pid = sim_address(sims, victim.name), victim.pid
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            detected = await watch(lambda: not any(healthy(sims, victim.name)), DETECT_S + 1.0)
            await window(DISPATCH_S)
            tries_at_detection = envoy_counter(sims, address, "rq_total")
            await window(FIRST_BYTE_S + 1.0)
            tries_while_stopped = envoy_counter(sims, address, "rq_total") - tries_at_detection
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        back = await watch(lambda: all(healthy(sims, victim.name)), ROTATION_S)
        await window(2.0)
    assert tries_while_stopped == 0  # nothing sent to the stopped replica once it was detected
    for o in steady.outcomes:  # nothing outlived its bound
        assert o.ended - o.started < REQUEST_S + SLACK_S, o
    failed = failures(steady.outcomes)
    # A whole answer waiting on the stopped replica is cut at the model's idle timeout, before its bound.
    assert all(o.ended - o.started < IDLE_S + SLACK_S for o in failed), failed
    assert all(o.endpoint == address and o.started < detected for o in failed), failed
    # Envoy's timeout (504, OpenAI JSON), or a stream the replica had begun, cut at the request's bound.
    assert all(o.status == 504 or (o.stream and o.status == 200) for o in failed), failed
    assert back - resumed < ROTATION_S
    assert any(o.endpoint == address and o.ok for o in steady.between(back, back + 2.0))
    # The request path saw it too: a try sent to it after it stopped timed out (a stream at its first-byte
    # bound, then retried elsewhere; a whole answer at its request bound, 504), and that failed try
    # ejected the replica in every ext_proc.
    if envoy_counter(sims, address, "rq_timeout"):
        assert all(n >= 1 for n in ejections(sims, victim.name)), ejections(sims, victim.name)
    assert victim.pid == pid and stopped < detected


# --- agents and etcd -------------------------------------------------------------------------------------


async def test_a_killed_agent_costs_only_its_engines_requests_and_comes_back(agents: Stack) -> None:
    victim = agents.agents[1]
    old_pid = victim.pid
    async with load(agents) as steady:
        await window(1.5)
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        await watch(lambda: victim.pid != old_pid, RESTART_S)
        await window(2.0)
    late = [o for o in failures(steady.outcomes) if o.started >= killed + 0.1]
    assert not late, late
    assert len(steady.between(killed, time.monotonic())) > 10


async def test_a_killed_etcd_changes_nothing_for_requests_and_comes_back(agents: Stack) -> None:
    etcd = agents.etcd
    assert etcd is not None
    old_pid = etcd.pid
    async with load(agents) as steady:
        await window(1.0)
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        await watch(lambda: etcd.pid != old_pid and etcd.returncode is None, RESTART_S)
        await window(1.0)
    assert not failures(steady.outcomes)
    assert len(steady.between(killed, time.monotonic())) > 10


def test_the_stack_files_name_the_current_processes(sims: Stack) -> None:
    info = sims.info
    assert info is not None and Path(sims.workdir / "stack.json").exists()


async def test_fail_open_serves_without_any_ext_proc(tmp_path: Path) -> None:
    """``--fail-open``: with its only ext_proc dead (not restarted here), Envoy proxies to an engine it last
    heard of (the bundled default, failing closed, is ``test_gateway.test_extproc_down_fails_closed``)."""
    options = StackOptions(replicas=2, port=0, sim_args=FAST_SIM, workdir=tmp_path, fail_open=True)
    with Stack(options) as stack:
        assert stack.extproc is not None
        async with load(stack) as steady:
            await window(0.5)
            killed = time.monotonic()
            os.kill(stack.extproc.pid, signal.SIGKILL)
            await window(2.0)
    before = [o for o in steady.outcomes if o.ended < killed]
    assert before and all(o.ok for o in before)  # routed by the ext_proc (whole bodies: BUFFERED mode)
    after = [o for o in steady.outcomes if o.started >= killed + 0.1]
    assert len(after) > 10 and all(o.ok for o in after), failures(after)
    assert {o.endpoint for o in after} <= {e["address"] for e in stack.engines}
