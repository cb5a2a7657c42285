"""agent.supervised: a failed long-running agent task is logged by type, counted and restarted with
back-off; in process, an agent whose KV event pump fails keeps following its engine's events (a real
ZMQ PUB socket and replay ROUTER standing in for the engine)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

import agent.main as agent_main
from agent.config import AgentSection, NodeConfig, parse_node_config
from agent.launch import EngineLaunch
from agent.main import Agent, _Engine
from agent.supervised import RestartPolicy, supervise
from agent.supervisor import EngineSupervisor
from contracts.events import Cleared, Event
from tests.agent.conftest import FakeEngine

SECRET = "prompt tokens 101 102 103"  # what an exception's message may carry: never logged


class Clock:
    """A fake monotonic clock that the fake sleep advances."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_restart_policy_doubles_up_to_the_cap() -> None:
    policy = RestartPolicy(base_s=0.5, max_s=4.0)
    assert [policy.delay(k) for k in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert policy.delay(10_000) == 4.0
    for bad in ({"base_s": 0}, {"base_s": 5, "max_s": 4}, {"healthy_after_s": 0}):
        with pytest.raises(ValueError):
            RestartPolicy(**bad)


async def test_failures_are_counted_by_type_cleaned_up_and_restarted_with_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, runs, counted, cleanups = Clock(), [], [], []
    failures: list[Exception] = [ValueError(SECRET), KeyError(SECRET), ValueError(SECRET)]

    async def run() -> None:
        runs.append(clock.now)
        if failures:
            raise failures.pop(0)

    async def cleanup() -> None:
        cleanups.append(clock.now)
        if len(cleanups) == 2:
            raise RuntimeError(SECRET)  # a failing cleanup does not stop the restarts

    with caplog.at_level(logging.DEBUG, logger="agent.supervised"):
        await supervise(
            "kv-e1",
            run,
            count=counted.append,
            on_failure=cleanup,
            policy=RestartPolicy(base_s=0.5, max_s=30.0),
            clock=clock,
            sleep=clock.sleep,
        )
    assert counted == ["ValueError", "KeyError", "ValueError"]
    assert clock.slept == [0.5, 1.0, 2.0] and len(runs) == 4 and len(cleanups) == 3
    text = caplog.text
    assert "kv-e1" in text and "ValueError" in text and "KeyError" in text and "RuntimeError" in text
    assert SECRET not in text and "Traceback" not in text


async def test_a_run_that_lasted_starts_the_backoff_again() -> None:
    clock, counted = Clock(), []
    lengths = [0.0, 0.0, 100.0, 0.0]  # seconds each run lasts before it fails; then one that returns

    async def run() -> None:
        if not lengths:
            return
        clock.now += lengths.pop(0)
        raise OSError("x")

    policy = RestartPolicy(base_s=1.0, max_s=30.0, healthy_after_s=60.0)
    await supervise("t", run, count=counted.append, policy=policy, clock=clock, sleep=clock.sleep)
    assert clock.slept == [1.0, 2.0, 1.0, 2.0] and counted == ["OSError"] * 4


async def test_cancellation_ends_the_supervision_even_during_a_backoff() -> None:
    started = asyncio.Event()

    async def run() -> None:
        started.set()
        raise ValueError

    task = asyncio.create_task(supervise("t", run, count=lambda _: None, policy=RestartPolicy(base_s=30)))
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)


# --- in process: the agent's KV event pump --------------------------------------------------------------


async def test_an_agent_whose_kv_pump_fails_counts_it_and_follows_the_engine_again(
    tmp_path: Path, fake_engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    agent = Agent(NodeConfig(AgentSection(id="node-a", state_dir=str(tmp_path)), ()), index_block_size=16)
    agent.task_restarts = RestartPolicy(base_s=0.05, max_s=0.05)
    published: list[list[Event]] = []
    monkeypatch.setattr(agent.feed, "publish", lambda events: published.append(list(events)))
    calls = {"n": 0}
    real = agent_main.feed_batches

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # the first live batch after the catch-up
            raise RuntimeError(SECRET)
        return real(*args, **kwargs)

    monkeypatch.setattr(agent_main, "feed_batches", flaky)
    fake_engine.answer_replays()
    pub, router = fake_engine.endpoints()
    config = parse_node_config(
        {
            "agent": {"id": "node-a"},
            "engines": [{"id": "e1", "kind": "sim", "model": "m", "model_path": "m", "port": 1}],
        }
    ).engines[0]
    launch = EngineLaunch((), (), "http://127.0.0.1:1", "127.0.0.1:1", "/health", None, True, pub, router, "")
    eng = _Engine(config, cast(EngineSupervisor, SimpleNamespace(launch=launch)))
    with caplog.at_level(logging.INFO):
        async with eng.kv_lock:
            await agent._follow_kv_events(eng)
        try:
            first = eng.subscriber
            deadline = time.monotonic() + 30
            # The engine publishes until the pump failed, was restarted on a new subscription and
            # delivered again (the translator's reset, a Cleared, published in between).
            while not (agent.task_failures and eng.subscriber is not first and calls["n"] >= 4):
                assert time.monotonic() < deadline, (agent.task_failures, calls)
                assert eng.pump is not None and not eng.pump.done()
                fake_engine.send()
                await asyncio.sleep(0.02)  # pacing the engine's batches; the loop condition is the check
            assert agent.task_failures == {("e1", "kv_events", "RuntimeError"): 1}
            assert fake_engine.replays >= 2  # the new subscription caught up from the replay socket
            assert any(e == Cleared("e1", None) for events in published for e in events)
            status = agent.status()["task_failures"]
            assert status == [{"engine": "e1", "task": "kv_events", "error": "RuntimeError", "count": 1}]
        finally:
            await agent._stop_feed(eng)
    assert eng.pump is None and eng.subscriber is None
    assert "RuntimeError" in caplog.text and SECRET not in caplog.text
