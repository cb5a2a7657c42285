"""Faults of engines and ext_procs under steady streamed and non-streamed load, through real Envoy, four
simulator processes and two ext_procs (``[extproc] workers = 2``), supervised: SIGKILL and restart,
SIGSTOP then SIGCONT, an engine resetting its TCP connections; and fail-open without any ext_proc.

The bounds (issue 24 part 4): only requests in flight on the failed process fail; nothing is sent to a
dead or stopped engine once the gateway detected it; nothing outlives its configured bound (no hang); and
full service returns within a stated time.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgate.dev.up import Stack, StackOptions
from load import faults
from load.faults import (
    DETECT_S,
    FIRST_BYTE_S,
    HANG_S,
    IDLE_S,
    REQUEST_S,
    ROTATION_S,
    SLACK_S,
    FaultRun,
    Windows,
    load,
    window,
)
from tests.faults.conftest import start

W = Windows()


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from start(faults.sims_options(tmp_path_factory.mktemp("faults")))


async def test_a_killed_engine_costs_only_its_requests_in_flight(sims: Stack, note: Any) -> None:
    run: FaultRun = note(await faults.kill_engine(sims, W))
    f = run.facts
    failed = run.failures()
    assert all(o.started < run.injected for o in failed), failed  # only requests already on the engine
    assert all(o.endpoint in (f["address"], None) for o in failed), failed
    assert f["after_detection"] == 0  # nothing sent to the dead process once it was detected
    assert f["served_after_restart"], "the restarted engine took no traffic"
    assert f["detected"] - run.injected < DETECT_S and run.record.sent > 10
    assert run.record.hung == 0


async def test_a_killed_ext_proc_costs_only_its_decisions_in_flight(sims: Stack, note: Any) -> None:
    run: FaultRun = note(await faults.kill_extproc(sims, W))
    late = [o for o in run.failures() if o.started >= run.injected]
    assert not late, (len(late), [round(o.started - run.injected, 3) for o in late])
    assert run.facts["others"]  # the other worker kept running
    assert run.record.hung == 0 and run.record.sent > 10


async def test_a_stopped_engine_is_bounded_detected_and_back_after_continue(sims: Stack, note: Any) -> None:
    run: FaultRun = note(await faults.stop_engine(sims, W))
    f = run.facts
    assert f["after_detection"] == 0  # nothing sent to the stopped engine once it was detected
    assert run.record.hung == 0
    for o in run.outcomes:  # nothing outlived its bound
        assert o.ended - o.started < REQUEST_S + SLACK_S, o
    failed = run.failures()
    # A whole answer waiting on the stopped engine is cut at the model's idle timeout, before its bound.
    assert all(o.ended - o.started < IDLE_S + SLACK_S for o in failed), failed
    assert all(o.endpoint == f["address"] and o.started < f["detected"] for o in failed), failed
    # Envoy's timeout (504, OpenAI JSON), or a stream the engine had begun, cut at the request's bound.
    assert all(o.status == 504 or (o.stream and o.status == 200) for o in failed), failed
    assert f["back"] - f["resumed"] < ROTATION_S and f["pid_kept"]
    # Back in rotation: the resumed engine serves again.
    assert any(o.endpoint == f["address"] and o.ok and o.started >= f["back"] for o in run.outcomes)
    # A try sent to it after it stopped timed out and ejected it in every ext_proc.
    if f["timed_out_tries"]:
        assert all(n >= 1 for n in f["ejections"]), f["ejections"]


async def test_a_stopped_ext_proc_is_bounded(sims: Stack, note: Any) -> None:
    run: FaultRun = note(await faults.stop_extproc(sims, W))
    assert run.record.hung == 0, [o for o in run.outcomes if o.ended - o.started > HANG_S]
    # Only decisions the stopped worker held: those started while it was stopped, before Envoy's health
    # check took it out of the ext_proc cluster.
    failed = run.failures()
    assert all(run.injected - 0.1 <= o.started < run.facts["resumed"] for o in failed), failed
    assert run.facts["pid_kept"] and run.record.sent > 10


async def test_an_engine_resetting_connections_is_ejected_and_costs_only_cut_streams(
    sims: Stack, note: Any
) -> None:
    run: FaultRun = note(await faults.reset_engine(sims, W))
    failed = run.failures()
    # A reset before any response byte is retried on the next host; a stream already begun is lost.
    assert all(o.stream and o.status == 200 for o in failed), failed
    assert all(o.endpoint == run.facts["address"] for o in failed), failed
    assert len(failed) <= 2 and run.record.hung == 0
    assert all(n >= 1 for n in run.facts["ejections"]), run.facts["ejections"]


def test_the_stack_files_name_the_current_processes(sims: Stack) -> None:
    assert sims.info is not None and Path(sims.workdir / "stack.json").exists()


async def test_fail_open_serves_without_any_ext_proc(tmp_path: Path) -> None:
    """``--fail-open``: with its only ext_proc dead (not restarted here), Envoy proxies to an engine it last
    heard of (the bundled default, failing closed, is ``test_gateway.test_extproc_down_fails_closed``)."""
    options = StackOptions(replicas=2, port=0, sim_args=faults.FAST_SIM, workdir=tmp_path, fail_open=True)
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
    assert len(after) > 10 and all(o.ok for o in after), [o for o in after if not o.ok]
    assert {o.endpoint for o in after} <= {e["address"] for e in stack.engines}


def test_bounds_are_those_configured() -> None:
    assert FIRST_BYTE_S < IDLE_S < REQUEST_S < HANG_S
