"""Faults of the control plane under steady load: a node agent and etcd SIGKILLed and restarted, and an
engine drained by an operator (three agents, one simulated engine each, a local etcd). Requests do not
depend on etcd or an agent: only requests in flight on the killed agent's engine (its child) may fail,
none for etcd or a drain; a drained engine gets no new try once the gateway shows the drain."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvgate.dev.up import Stack
from load import faults
from load.faults import FaultRun, Windows
from tests.faults.conftest import start

W = Windows()


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from start(faults.agents_options(tmp_path_factory.mktemp("faults-agents")))


async def test_a_killed_agent_costs_only_its_engines_requests_and_comes_back(
    agents: Stack, note: Any
) -> None:
    run: FaultRun = note(await faults.kill_agent(agents, W))
    late = [o for o in run.failures() if o.started >= run.injected + 0.1]
    assert not late, late
    assert run.record.hung == 0 and run.record.sent > 10


async def test_a_killed_etcd_changes_nothing_for_requests_and_comes_back(agents: Stack, note: Any) -> None:
    run: FaultRun = note(await faults.kill_etcd(agents, W))
    assert not run.failures(), run.failures()
    assert run.record.hung == 0 and run.record.sent > 10


async def test_a_drained_engine_gets_no_new_request_and_loses_none(agents: Stack, note: Any) -> None:
    run: FaultRun = note(await faults.drain_engine(agents, W))
    assert not run.failures(), run.failures()
    assert run.facts["detected"] - run.facts["written"] < faults.DETECT_S
    assert run.facts["after_detection"] == 0, run.facts
    assert run.record.hung == 0 and run.record.sent > 10
