"""extproc.control.feeds: batches from real agent feeds (runtime.feed.server over gRPC on 127.0.0.1)
applied to a fake index and a real Fleet; lost and restored feeds."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from contracts.events import (
    Cleared,
    EndpointId,
    Gpu,
    IndexEvent,
    Load,
    Removed,
    Stored,
)
from engines.endpoint import Endpoint
from extproc.control.feeds import FeedManager
from extproc.fleet import Fleet
from runtime.feed.log import FeedLog
from runtime.feed.server import FeedServer
from tests.runtime.feed.test_server import Held, eventually

D1, D2, D3 = (bytes([i]) * 16 for i in (1, 2, 3))


E1, E2 = EndpointId("e1"), EndpointId("e2")


class FakeIndex:
    """Records what the manager applies (the EventIndex protocol)."""

    def __init__(self) -> None:
        self.applied: list[tuple[list[IndexEvent], float]] = []
        self.cleared: list[EndpointId] = []

    def apply(self, events: list[IndexEvent], now: float) -> None:
        self.applied.append((list(events), now))

    def clear_endpoint(self, endpoint: EndpointId) -> None:
        self.cleared.append(endpoint)

    def events(self) -> list[IndexEvent]:
        return [e for events, _ in self.applied for e in events]


@pytest.fixture
async def agent() -> AsyncIterator[FeedServer]:
    srv = FeedServer(FeedLog("node-a"), Held())
    await srv.start()
    yield srv
    await srv.aclose()


def fleet_for(feed: str) -> Fleet:
    return Fleet(
        [
            Endpoint(E1, "127.0.0.1:9001", frozenset({"m"}), node="node-a", feed=feed, kv_events=True),
            Endpoint(E2, "127.0.0.1:9002", frozenset({"m"}), node="node-a", feed=feed, kv_events=True),
            Endpoint(EndpointId("e3"), "127.0.0.1:9003", frozenset({"m"})),
        ]
    )


@pytest.fixture
async def manager(agent: FeedServer) -> AsyncIterator[tuple[FeedManager, FakeIndex, Fleet]]:
    index, fleet = FakeIndex(), fleet_for(f"127.0.0.1:{agent.port}")
    mgr = FeedManager(index, fleet, subscriber="extproc-test", clock=lambda: 100.0)
    mgr.sync()
    yield mgr, index, fleet
    await mgr.aclose()


async def test_manager_applies_index_events_and_loads(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    mgr, index, fleet = manager
    client = mgr.clients[f"127.0.0.1:{agent.port}"]
    await eventually(lambda: client.connected)
    gpu = Gpu(0, "NVIDIA H100", power_w=350.0)
    agent.publish([Stored("e1", [D1, D2]), Load("e1", 2, 3, 0.5, gpus=[gpu]), Removed("e1", [D2])])
    await eventually(lambda: mgr.stats.batches == 2)
    assert index.applied[-1] == ([Stored("e1", [D1, D2]), Removed("e1", [D2])], 100.0)
    state = fleet.get(E1)
    assert state is not None and state.metrics is not None
    assert (state.metrics.waiting, state.metrics.running, state.metrics.kv_usage, state.metrics.at) == (
        2,
        3,
        0.5,
        100.0,
    )
    assert state.healthy and not state.draining and mgr.gpus[E1] == [gpu]

    agent.publish([Load("e1", 0, 1, 0.5, draining=True), Load("e2", 0, 0, None, healthy=False)])
    await eventually(lambda: mgr.stats.batches == 3)
    e2 = fleet.get(E2)
    assert state.draining and e2 is not None and not e2.healthy and e2.metrics is None

    agent.publish([Load("e1", 0, 0, 0.1), Load("e2", 1, 0, 0.2)])
    await eventually(lambda: mgr.stats.batches == 4)
    assert not state.draining and e2.healthy and e2.metrics is not None  # the agent lifted its own drain

    state.draining = True  # a drain ordered elsewhere (etcd) is not lifted by the agent's loads
    agent.publish([Load("e1", 0, 0, 0.1)])
    await eventually(lambda: mgr.stats.batches == 5)
    assert state.draining
    assert mgr.stats.events == 0 + 3 + 2 + 2 + 1 and mgr.stats.resets == 1 and mgr.stats.gaps == 0


async def test_snapshot_clears_every_endpoint_the_feed_spoke_of(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    mgr, index, _ = manager
    address = f"127.0.0.1:{agent.port}"
    await eventually(lambda: mgr.clients[address].connected)
    agent.publish([Stored("e9", [D1])])  # an endpoint the fleet does not list (yet)
    await eventually(lambda: mgr.stats.batches == 2)
    # The agent restarts on the same port and no longer serves e9.
    port = agent.port
    await agent.aclose()
    held = Held()
    held.events = [Stored("e1", [D3])]
    again = FeedServer(FeedLog("node-a"), held, listen=address)
    await again.start()
    try:
        assert again.port == port
        await eventually(lambda: mgr.stats.resets == 2)
        assert set(index.cleared) >= {EndpointId("e9"), E1}
        assert index.applied[-1][0] == [Cleared("e1"), Stored("e1", [D3])]
    finally:
        await again.aclose()


async def test_lost_feed_marks_its_endpoints_unhealthy_until_restored(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    mgr, _, fleet = manager
    address = f"127.0.0.1:{agent.port}"
    client = mgr.clients[address]
    await eventually(lambda: client.connected)
    agent.publish([Load("e2", 0, 0, None, healthy=False)])
    await eventually(lambda: mgr.stats.batches == 2)
    await agent.aclose()
    states = [fleet.get(EndpointId(e)) for e in ("e1", "e2", "e3")]
    await eventually(lambda: not any(s.healthy for s in states[:2] if s is not None))
    assert states[2] is not None and states[2].healthy  # not fed by this agent
    again = FeedServer(FeedLog("node-a"), Held(), listen=address)
    await again.start()
    try:
        await eventually(lambda: client.connected)
        e1, e2 = states[0], states[1]
        assert e1 is not None and e1.healthy
        assert e2 is not None and not e2.healthy  # its last Load said so; the snapshot will say again
        assert mgr.stats.reconnects >= 1
    finally:
        await again.aclose()


async def test_set_addresses_stops_removed_feeds_and_clears_their_endpoints(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    mgr, index, _ = manager
    address = f"127.0.0.1:{agent.port}"
    await eventually(lambda: mgr.clients[address].connected)
    agent.publish([Stored("e1", [D1])])
    await eventually(lambda: mgr.stats.batches == 2)
    mgr.set_addresses(set())
    assert mgr.clients == {} and index.cleared[-1:] == [E1]
    await eventually(lambda: agent.subscribers == 0)
