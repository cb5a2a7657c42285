"""Fault injection under steady load (issue 24 part 4): the scenarios, shared by ``tests/faults`` (short
windows, bounds asserted) and ``load/bench/faults.py`` (longer windows, a JSON record).

Each scenario runs :class:`~load.steady.SteadyLoad` (streamed and non-streamed chats) through a running
:class:`~kvgate.dev.up.Stack` (real Envoy, separate processes, supervised), injects one fault into one
process (SIGKILL, SIGSTOP then SIGCONT, or TCP resets from an engine), waits for full service to come
back, and returns a :class:`FaultRun`: the :class:`~load.steady.FaultRecord` (sent, succeeded, failed
by status, hung, time to recovery) and the facts the bounds are checked on (when the gateway detected
it, tries Envoy sent to the failed engine after that, ...). Waits are event-driven (:func:`watch` polls);
the only sleeps are the load's own measurement windows (``Windows``).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvgate.dev.procs import admin_get
from kvgate.dev.supervise import Backoff
from kvgate.dev.supervisor import Service
from kvgate.dev.up import Stack, StackOptions
from load.steady import FaultRecord, Outcome, SteadyLoad

MODEL = "SmolLM2-135M-Instruct"
#: The model's bounds: a stream's response headers, silence either way, the whole response.
FIRST_BYTE_S, IDLE_S, REQUEST_S = 2.0, 3.0, 5.0
#: Bounds the suite states: detection, a restart, and a recovered engine taking traffic again.
DETECT_S, RESTART_S, ROTATION_S = 2.0, 20.0, 5.0
#: Client-side slack over Envoy's bounds (scheduling on a loaded 2-core machine).
SLACK_S = 1.5
#: A request that took longer than this hung: past every configured bound plus the slack.
HANG_S = REQUEST_S + SLACK_S
#: A decision made just before the gateway noticed a failure still reaches Envoy within this.
DISPATCH_S = 0.2
FAST_RESTART = Backoff(initial_s=0.1, max_s=1.0, stable_s=30.0)
#: Simulators 20x faster than the H100 timing model (routing and wire behaviour, not latency).
FAST_SIM = ("--time-scale", "0.05")
#: 4x slower than the H100 timing model: a 48-token stream lasts over 1 s, so a kill of an engine that
#: runs a request finds a stream in flight.
STREAMING_SIM = ("--time-scale", "4")
STREAM_TOKENS = 48


@dataclass(frozen=True, slots=True)
class Windows:
    """Seconds of load before the fault (``warm``) and after full service returned (``after``); a
    benchmark lengthens them, the CI suite keeps them short."""

    warm: float = 1.5
    after: float = 2.0
    #: How long a SIGSTOPped process stays stopped.
    stopped: float = FIRST_BYTE_S + 1.0


@dataclass
class FaultRun:
    record: FaultRecord
    outcomes: list[Outcome]
    injected: float
    #: What the checks need: ``detected`` (monotonic), ``after_detection`` (tries Envoy sent to the
    #: failed engine once detected), ``address``, ``victim`` ...
    facts: dict[str, Any] = field(default_factory=dict)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]


# --- the stacks --------------------------------------------------------------------------------------------


def sims_options(workdir: Any, extprocs: int = 2) -> StackOptions:
    """Four simulator processes and ``extprocs`` ext_procs (``[extproc] workers``), short bounds."""
    return StackOptions(
        replicas=4,
        extprocs=extprocs,
        port=0,
        sim_args=FAST_SIM,
        workdir=workdir,
        overlay={
            "timeouts": {"request_s": REQUEST_S, "first_byte_s": FIRST_BYTE_S},
            "models": [{"name": MODEL, "gguf": "smollm2", "idle_timeout_s": IDLE_S}],
        },
    )


def streaming_options(workdir: Any, migration: bool = True) -> StackOptions:
    """Three slower simulators (long streams), the model opted in to in-flight migration or not. Its idle
    bound is the request bound: a non-streamed answer that migrates is re-issued whole on another engine
    and stays silent until it is done, up to twice its usual time (``extproc/migration/README.md``); the
    plain stack keeps the same bounds, for the comparison."""
    model = {"name": MODEL, "gguf": "smollm2", "idle_timeout_s": REQUEST_S, "migration": migration}
    return StackOptions(
        replicas=3,
        port=0,
        sim_args=STREAMING_SIM,
        workdir=workdir,
        overlay={"timeouts": {"request_s": REQUEST_S, "first_byte_s": FIRST_BYTE_S}, "models": [model]},
    )


def agents_options(workdir: Any) -> StackOptions:
    """Three node agents (one simulated engine each) and a local etcd."""
    return StackOptions(agents=3, port=0, agent_args=FAST_SIM, workdir=workdir)


# --- what the gateway exposes ------------------------------------------------------------------------------


def _metrics(stack: Stack, ports: dict[str, int]) -> str:
    return httpx.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=2).text


def healthy(stack: Stack, endpoint_id: str) -> list[bool]:
    """Each ext_proc's view: is ``endpoint_id`` eligible (``kvgate_endpoint_healthy``)?"""
    out = []
    for ports in stack.extproc_listeners:
        text = _metrics(stack, ports)
        m = re.search(rf'^kvgate_endpoint_healthy{{endpoint="{re.escape(endpoint_id)}"}} (\S+)$', text, re.M)
        out.append(m is not None and float(m.group(1)) == 1.0)
    return out


def ejections(stack: Stack, endpoint_id: str) -> list[float]:
    """Each ext_proc's count of ejections of ``endpoint_id`` (any kind)."""
    out = []
    for ports in stack.extproc_listeners:
        text = _metrics(stack, ports)
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
    m = re.search(rf"^kvgate_engines::{re.escape(address)}::{counter}::(\d+)$", got[1].decode(), re.M)
    return int(m.group(1)) if m else 0


def sim_address(stack: Stack, name: str) -> str:
    (engine,) = [e for e in stack.engines if e["id"] == name]
    return engine["address"]


def running(stack: Stack, name: str) -> float:
    """Requests the engine ``name`` runs now (its ``vllm:num_requests_running``; 0 when unreachable)."""
    (engine,) = [e for e in stack.engines if e["id"] == name]
    try:
        text = httpx.get(f"http://{engine['address']}/metrics", timeout=2).text
    except httpx.TransportError:
        return 0.0
    m = re.search(r"^vllm:num_requests_running{[^}]*} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def proxy_metric(stack: Stack, name: str, **labels: str) -> float:
    """A counter of the migration proxy (summed over the series matching ``labels``)."""
    text = httpx.get(f"http://127.0.0.1:{stack.migration_ports['metrics']}/metrics", timeout=2).text
    total = 0.0
    for m in re.finditer(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


async def watch(condition: Callable[[], bool], deadline_s: float) -> float:
    """Poll ``condition()`` until true, in a thread (it reads HTTP; the load shares this event loop): the
    monotonic time it became true. A process not answering yet (restarting) counts as false."""
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


async def window(seconds: float) -> None:
    await asyncio.sleep(seconds)  # the load runs meanwhile: a measurement window, not a readiness wait


def load(stack: Stack, max_tokens: int = 8) -> SteadyLoad:
    return SteadyLoad(stack.url, MODEL, clients=4, max_tokens=max_tokens, client_timeout_s=REQUEST_S + 10)


def busiest(stack: Stack, steady: SteadyLoad) -> Service[Any]:
    """The simulator that served the most of the load so far: one in rotation (with one shared prompt and
    prefix affinity, a replica that never got it stays idle under a light load, by design)."""
    served = Counter(o.endpoint for o in steady.outcomes if o.ok)
    return max(stack.sims, key=lambda s: served[sim_address(stack, s.name)])


def all_healthy(stack: Stack) -> bool:
    """Every engine of the stack eligible in every ext_proc: full service."""
    return all(all(healthy(stack, e["id"])) for e in stack.engines)


def _run(fault: str, steady: SteadyLoad, injected: float, recovered: float, **facts: Any) -> FaultRun:
    record = FaultRecord.of(fault, steady.outcomes, HANG_S, recovered - injected)
    return FaultRun(record, list(steady.outcomes), injected, dict(facts))


# --- simulators and ext_procs ------------------------------------------------------------------------------


async def kill_engine(stack: Stack, w: Windows) -> FaultRun:
    """SIGKILL the busiest simulator (while it runs a request); the supervisor restarts it."""
    async with load(stack) as steady:
        await window(w.warm)
        victim = busiest(stack, steady)
        address, old_pid = sim_address(stack, victim.name), victim.pid
        await watch(lambda: running(stack, victim.name) >= 1, 10)
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        detected = await watch(lambda: not any(healthy(stack, victim.name)), DETECT_S)
        await window(DISPATCH_S)  # decisions made just before detection reach Envoy
        refused_at_detection = envoy_counter(stack, address, "cx_connect_fail")
        back = await watch(lambda: victim.pid != old_pid and all(healthy(stack, victim.name)), RESTART_S)
        refused_after = envoy_counter(stack, address, "cx_connect_fail") - refused_at_detection
        await window(max(w.after, ROTATION_S))
    served = [o for o in steady.between(back, back + ROTATION_S) if o.endpoint == address and o.ok]
    return _run(
        "SIGKILL engine running a request (short answers)",
        steady,
        killed,
        back,
        detected=detected,
        back=back,
        address=address,
        after_detection=refused_after,
        served_after_restart=len(served),
    )


async def _kill_and_restart(
    stack: Stack, w: Windows, victim: Service[Any]
) -> tuple[SteadyLoad, float, float]:
    """Under load: SIGKILL ``victim``, wait for the supervisor's new process and for full service; the
    load, the kill's and full service's monotonic times."""
    old_pid = victim.pid
    async with load(stack) as steady:
        await window(w.warm)
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        await watch(lambda: victim.pid != old_pid and victim.returncode is None, RESTART_S)
        back = await watch(lambda: all_healthy(stack), RESTART_S)
        await window(w.after)
    return steady, killed, back


async def kill_extproc(stack: Stack, w: Windows, index: int = 0) -> FaultRun:
    """SIGKILL one ext_proc replica; Envoy's health check moves its decisions to the others."""
    victim = stack.extprocs[index]
    others = {s.name: s.pid for s in stack.extprocs if s is not victim}
    steady, killed, back = await _kill_and_restart(stack, w, victim)
    survivors_kept = all(s.pid == others[s.name] for s in stack.extprocs if s is not victim)
    return _run(
        f"SIGKILL ext_proc ({len(stack.extprocs)} workers)", steady, killed, back, others=survivors_kept
    )


async def stop_engine(stack: Stack, w: Windows) -> FaultRun:
    """SIGSTOP the busiest simulator (a hang) for ``w.stopped`` seconds, then SIGCONT."""
    async with load(stack) as steady:
        await window(w.warm)
        victim = busiest(stack, steady)
        address, pid = sim_address(stack, victim.name), victim.pid
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            detected = await watch(lambda: not any(healthy(stack, victim.name)), DETECT_S + 1.0)
            await window(DISPATCH_S)
            tries_at_detection = envoy_counter(stack, address, "rq_total")
            await window(w.stopped)
            tries_after = envoy_counter(stack, address, "rq_total") - tries_at_detection
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        back = await watch(lambda: all(healthy(stack, victim.name)), ROTATION_S)
        await window(w.after)
    return _run(
        "SIGSTOP engine, then SIGCONT",
        steady,
        stopped,
        back,
        detected=detected,
        resumed=resumed,
        back=back,
        address=address,
        victim=victim.name,
        pid_kept=victim.pid == pid,
        after_detection=tries_after,
        timed_out_tries=envoy_counter(stack, address, "rq_timeout"),
        ejections=ejections(stack, victim.name),
    )


async def stop_extproc(stack: Stack, w: Windows, index: int = 0) -> FaultRun:
    """SIGSTOP one ext_proc replica for ``w.stopped`` seconds, then SIGCONT: Envoy's gRPC health check
    and the ext_proc filter's message timeout bound what waits on it."""
    victim = stack.extprocs[index]
    pid = victim.pid
    async with load(stack) as steady:
        await window(w.warm)
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            await window(w.stopped)
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        back = await watch(lambda: all_healthy(stack), ROTATION_S)
        await window(w.after)
    return _run(
        "SIGSTOP ext_proc, then SIGCONT", steady, stopped, back, resumed=resumed, pid_kept=victim.pid == pid
    )


async def _reset_next(address: str, n: int, after: int) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        response = await http.post(f"http://{address}/_sim/reset_next", params={"n": n, "after": after})
        response.raise_for_status()


async def reset_engine(stack: Stack, w: Windows, resets: int = 2, after: int = 2) -> FaultRun:
    """The busiest simulator answers its next ``resets`` requests with a TCP RST (streams after their
    ``after``-th event, whole answers before any byte), then serves normally again."""
    async with load(stack, max_tokens=16) as steady:
        await window(w.warm)
        victim = busiest(stack, steady)
        address = sim_address(stack, victim.name)
        ejected_before = sum(ejections(stack, victim.name))
        injected = time.monotonic()
        await _reset_next(address, resets, after)
        ejected = await watch(lambda: sum(ejections(stack, victim.name)) > ejected_before, 10)
        # Each reset try ejects it again once back, for twice as long (2 s, 4 s, ...): RESTART_S bounds
        # the default two.
        back = await watch(lambda: all(healthy(stack, victim.name)), RESTART_S)
        await window(w.after)
    return _run(
        "engine resets connections (TCP RST)",
        steady,
        injected,
        back,
        address=address,
        ejected=ejected,
        ejections=ejections(stack, victim.name),
    )


# --- in-flight migration -----------------------------------------------------------------------------------


def _migrated(stack: Stack) -> dict[str, float]:
    if stack.migration is None:
        return {}
    return {
        o: proxy_metric(stack, "kvgate_migrations_total", outcome=o) for o in ("resumed", "reissued", "lost")
    }


async def kill_streaming_engine(stack: Stack, w: Windows) -> FaultRun:
    """SIGKILL a simulator while it runs a request (long streams: one is in flight), with or without
    migration (``stack.migration``)."""
    async with load(stack, max_tokens=STREAM_TOKENS) as steady:
        await window(w.warm)
        migrated_before = _migrated(stack)
        victim: Service[Any] | None = None

        def serving() -> bool:
            nonlocal victim
            for sim in stack.sims:
                if sim.alive() and running(stack, sim.name) >= 1:
                    victim = sim
                    return True
            return False

        await watch(serving, 10)
        assert victim is not None
        name, old_pid = victim.name, victim.pid
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        detected = await watch(lambda: not any(healthy(stack, name)), DETECT_S)
        sim = victim
        back = await watch(lambda: sim.pid != old_pid and all(healthy(stack, name)), RESTART_S)
        await window(w.after)
    migrated = {k: v - migrated_before[k] for k, v in _migrated(stack).items()}
    return _run(
        f"SIGKILL engine mid-stream, migration {'on' if stack.migration else 'off'}",
        steady,
        killed,
        back,
        detected=detected,
        migrated=migrated,
        address=sim_address(stack, name),
    )


async def reset_migrating_engine(stack: Stack, w: Windows, resets: int = 2, after: int = 2) -> FaultRun:
    """An engine of an opted-in model resets its connections mid-stream: the proxy continues each stream
    elsewhere, and the gateway must still learn of the failed tries (eject the engine)."""
    async with load(stack, max_tokens=STREAM_TOKENS) as steady:
        await window(w.warm)
        victim = busiest(stack, steady)
        # With migration, x-kvgate-endpoint names the proxy: the engine that serves is the one running.
        victim = next((s for s in stack.sims if running(stack, s.name) >= 1), victim)
        address = sim_address(stack, victim.name)
        ejected_before = sum(ejections(stack, victim.name))
        injected = time.monotonic()
        await _reset_next(address, resets, after)
        ejected = await watch(lambda: sum(ejections(stack, victim.name)) > ejected_before, 10)
        back = await watch(lambda: all_healthy(stack), RESTART_S)
        await window(w.after)
    return _run(
        "engine resets connections, migration on",
        steady,
        injected,
        back,
        address=address,
        ejected=ejected,
        ejections=ejections(stack, victim.name),
    )


# --- agents and etcd ---------------------------------------------------------------------------------------


async def kill_agent(stack: Stack, w: Windows, index: int = 1) -> FaultRun:
    """SIGKILL one node agent (its engine is its child: a new one starts with it)."""
    steady, killed, back = await _kill_and_restart(stack, w, stack.agents[index])
    return _run("SIGKILL agent", steady, killed, back)


async def _kvgate(*argv: str) -> None:
    """``kvgate ARGV`` as an operator runs it (in a thread: the load shares this event loop)."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "kvgate.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, (argv, done.stdout, done.stderr)


async def drain_engine(stack: Stack, w: Windows) -> FaultRun:
    """``kvgate drain`` the busiest engine through etcd under load, then ``kvgate drain --undo``: once
    every ext_proc shows it draining, Envoy sends it no new try; nothing fails (its requests in flight
    finish); the undo puts it back in rotation."""
    assert stack.etcd is not None
    etcd = ("--etcd", stack.etcd.address)
    async with load(stack) as steady:
        await window(w.warm)
        served = Counter(o.endpoint for o in steady.outcomes if o.ok)
        engine = max(stack.engines, key=lambda e: served[e["address"]])
        name, address = str(engine["id"]), str(engine["address"])
        drained = time.monotonic()
        await _kvgate("drain", name, *etcd)
        written = time.monotonic()  # the command wrote the drain to etcd and returned
        detected = await watch(lambda: not any(healthy(stack, name)), DETECT_S)
        await window(DISPATCH_S)  # decisions made just before the drain showed reach Envoy
        tries_at_detection = envoy_counter(stack, address, "rq_total")
        await window(w.stopped)
        tries_after = envoy_counter(stack, address, "rq_total") - tries_at_detection
        await _kvgate("drain", name, "--undo", *etcd)
        undone = time.monotonic()
        back = await watch(lambda: all(healthy(stack, name)), ROTATION_S)
        await window(w.after)
    return _run(
        "kvgate drain engine, then --undo",
        steady,
        drained,
        back,
        written=written,
        detected=detected,
        undone=undone,
        back=back,
        address=address,
        victim=name,
        after_detection=tries_after,
    )


async def kill_etcd(stack: Stack, w: Windows) -> FaultRun:
    """SIGKILL the local etcd; the supervisor restarts it on the same data directory."""
    etcd = stack.etcd
    assert etcd is not None
    old_pid = etcd.pid
    async with load(stack) as steady:
        await window(w.warm)
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        back = await watch(lambda: etcd.pid != old_pid and etcd.returncode is None, RESTART_S)
        await window(w.after)
    return _run("SIGKILL etcd", steady, killed, back)
