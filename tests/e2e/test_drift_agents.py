"""End to end: the drift alarm's counter source for endpoints whose load comes from their agent's feed.

``kvgate up --agents 2`` style: a local etcd and two node agents, each supervising one simulated engine
registered without a ``metrics_url`` (the gateway never scrapes them: their load, and now the engine's
prefix-cache counters, travel in the agent's ``Load``; contracts/events.py, agent/telemetry.py).
``sim-1`` renders prompts with a deliberately wrong chat template (tests/e2e/test_drift.py's
``REVERSED_TEMPLATE``); ``sim-0`` with the model's own. Neither publishes KV events, so the router predicts
from its own decisions (the approximate index), which the wrong template makes untrue. Only streamed
requests are sent: their answers carry no cached-token count, so the counters are the only source.

With ``window = 32, min_samples = 8``: ``sim-1``'s ``counters`` alarm trips once the 9th request (the
first predicts nothing) is in a reading of its agent's, not before; ``sim-0``'s never does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from kvgate.dev.up import Stack
from tests.e2e.test_drift import (
    MIN_SAMPLES,
    MODEL,
    REVERSED_TEMPLATE,
    ask,
    drift_stack,
    settled,
    streams_trip_the_counters_alarm,
)

pytestmark = pytest.mark.e2e


def engine(i: int, *args: str) -> dict[str, object]:
    return {
        "id": f"sim-{i}",
        "kind": "sim",
        "model": MODEL,
        "model_path": "smollm2",
        "kv_events": False,
        "args": ["--time-scale", "0.05", *args],
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with drift_stack(
        tmp_path_factory.mktemp("drift-agents"),
        agents=2,
        agent_engines=(engine(0), engine(1, "--chat-template", REVERSED_TEMPLATE)),
    ) as running:
        yield running


def test_the_engines_are_agent_fed(stack: Stack) -> None:
    """The gateway has no metrics URL for them: whatever counters it compares came from the feeds."""
    assert stack.etcd is not None and sorted(e["id"] for e in stack.engines) == ["sim-0", "sim-1"]
    assert all("metrics_url" not in e for e in stack.engines)


async def test_streams_to_a_mistemplated_agent_fed_engine_trip_the_alarm(stack: Stack) -> None:
    await streams_trip_the_counters_alarm(stack, "sim-1")


async def test_the_correct_agent_fed_engine_never_trips(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        for i in range(MIN_SAMPLES):
            await ask(client, stack, "sim-0", 300 + i, stream=True)
        for batch in range(2):  # 4 at a time: predictions made while an earlier prefill still runs
            await asyncio.gather(
                *(ask(client, stack, "sim-0", 400 + 4 * batch + j, stream=True) for j in range(4))
            )
        view = await settled(stack, "sim-0", 2 * MIN_SAMPLES)
    assert not view.tripped and view.ratio is not None and view.ratio >= 0.8
