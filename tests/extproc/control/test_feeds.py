"""extproc.control.feeds: batches from real agent feeds (runtime.feed.server over gRPC on 127.0.0.1)
applied to a fake index and a real Fleet; lost and restored feeds."""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator

import pytest

from contracts.digest import Digest
from contracts.events import (
    Cleared,
    EndpointId,
    Gpu,
    IndexEvent,
    Load,
    Power,
    Removed,
    Stored,
    load_problem,
)
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.control.feeds import FeedManager
from extproc.fleet import EndpointState, Fleet
from extproc.scheduling.interface import CycleState, SchedulingRequest
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile
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


async def connected(agent: FeedServer, mgr: FeedManager) -> None:
    """Wait for the manager's feed client of ``agent`` to connect."""
    client = mgr.clients[f"127.0.0.1:{agent.port}"]
    await eventually(lambda: client.connected)


async def test_manager_applies_index_events_and_loads(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    mgr, index, fleet = manager
    await connected(agent, mgr)
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
    assert state.healthy and not state.draining and mgr.loads[E1].gpus == [gpu]

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
    await connected(agent, mgr)
    # e2 is registered with this feed; e9 nowhere: its events are dropped (the index ignores them until a
    # registration marks it precise), so nothing of it is kept or cleared.
    agent.publish([Stored("e2", [D1]), Stored("e9", [D1])])
    await eventually(lambda: mgr.stats.batches == 2)
    assert index.applied[-1][0] == [Stored("e2", [D1])]
    # The agent restarts on the same port and no longer serves e2.
    port = agent.port
    await agent.aclose()
    held = Held()
    held.events = [Stored("e1", [D3])]
    again = FeedServer(FeedLog("node-a"), held, listen=address)
    await again.start()
    try:
        assert again.port == port
        await eventually(lambda: mgr.stats.resets == 2)
        assert set(index.cleared) == {E2, E1}
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
    await connected(agent, mgr)
    agent.publish([Stored("e1", [D1])])
    await eventually(lambda: mgr.stats.batches == 2)
    mgr.set_addresses(set())
    assert mgr.clients == {} and index.cleared[-1:] == [E1]
    await eventually(lambda: agent.subscribers == 0)


# -- an engine restarted by its agent -------------------------------------------------------------------

NOW = 100.0  # the manager's clock in these tests
PREFIX = [Digest(bytes([i]) * 16) for i in range(32)]  # a shared system prompt: 32 blocks


def default_pick(candidates: list[EndpointState], holders: set[str]) -> str:
    """What the default profile picks at ``NOW`` among ``candidates`` (all idle) for a prompt of
    :data:`PREFIX` that ``holders`` hold (leads from engine KV events: exact)."""
    for state in candidates:
        state.metrics = EngineMetrics(0.0, 0.0, 0.1, NOW)
    blocks = {c.id: len(PREFIX) for c in candidates if c.id in holders}
    cycle = CycleState(prefix_blocks=blocks, cached_blocks=blocks, exact=True)
    request = SchedulingRequest("r1", "m", PREFIX, 16 * len(PREFIX), NOW)
    pick = build_profile(DEFAULT_SCHEDULING).schedule(request, cycle, candidates, random.Random(0)).pick
    assert pick is not None
    return pick.id


async def test_engine_restarted_by_its_agent_is_picked_again_at_once(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    """The agent's crash report (``Cleared``, unhealthy) and then its healthy ``Load``: the endpoint's
    routed share starts again from 0, so the default profile sends it the shared prefix's next request
    although the other replicas hold that prefix and it does not. With the crashed process's share kept,
    the ``balance`` filter kept all of them and the prefix scorer chose a holder, request after request
    (until that share had decayed: 21 s in the issue's measurement)."""
    mgr, _, fleet = manager
    await connected(agent, mgr)
    e1, e2 = fleet.get(E1), fleet.get(E2)
    assert e1 is not None and e2 is not None
    e1.count_routed(NOW, 300.0)  # before the crash
    e2.count_routed(NOW, 400.0)  # more, while e1 was away
    agent.publish([Cleared("e1")])  # what agent.main publishes when its engine exits
    agent.publish([Load("e1", 0, 0, None, healthy=False)])
    await eventually(lambda: mgr.stats.batches == 3)
    assert not e1.healthy and e1.recent_routed(NOW) == 300.0
    agent.publish([Load("e1", 0, 0, 0.0)])  # ready again
    await eventually(lambda: mgr.stats.batches == 4)
    assert e1.healthy and e1.recent_routed(NOW) == 0.0
    e3 = fleet.get(EndpointId("e3"))  # another replica holding the prefix
    assert e3 is not None
    e3.count_routed(NOW, 400.0)
    assert default_pick([e1, e2, e3], holders={"e2", "e3"}) == "e1"


async def test_engine_back_with_its_cache_keeps_its_routed_share(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    """Unhealthy then healthy without a ``Cleared`` (a hang that ended), or a ``Cleared`` while healthy
    (KV events lost, the engine still runs): the engine still holds its cache, its share stays."""
    mgr, _, fleet = manager
    await connected(agent, mgr)
    e1, e2 = fleet.get(E1), fleet.get(E2)
    assert e1 is not None and e2 is not None
    e1.count_routed(NOW, 300.0)
    e2.count_routed(NOW, 300.0)
    agent.publish([Load("e1", 0, 0, None, healthy=False)])
    agent.publish([Load("e1", 0, 0, 0.0)])
    agent.publish([Cleared("e2")])
    agent.publish([Load("e2", 0, 0, 0.0)])
    agent.publish([Load("e2", 0, 0, None, healthy=False)])  # a later outage, no Cleared before it
    agent.publish([Load("e2", 0, 0, 0.0)])
    await eventually(lambda: mgr.stats.batches == 7)
    assert e1.healthy and e2.healthy
    assert e1.recent_routed(NOW) == 300.0 and e2.recent_routed(NOW) == 300.0


async def test_snapshot_does_not_count_as_a_restart(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    """A resubscription's snapshot clears every endpoint of the feed; their engines did not restart."""
    mgr, _, fleet = manager
    address = f"127.0.0.1:{agent.port}"
    await connected(agent, mgr)
    e1 = fleet.get(E1)
    assert e1 is not None
    e1.count_routed(NOW, 300.0)
    agent.publish([Load("e1", 0, 0, None, healthy=False)])
    await eventually(lambda: mgr.stats.batches == 2)
    port = agent.port
    await agent.aclose()
    again = FeedServer(FeedLog("node-a"), Held(), listen=address)  # a new epoch: a snapshot
    await again.start()
    try:
        assert again.port == port
        await eventually(lambda: mgr.stats.resets == 2)
        again.publish([Load("e1", 0, 0, 0.0)])
        await eventually(lambda: e1.healthy)
        assert e1.recent_routed(NOW) == 300.0
    finally:
        await again.aclose()


async def test_power_readings_reach_the_endpoint_state(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    mgr, _, fleet = manager
    await connected(agent, mgr)
    power = [
        Power("dcgm", "dcgm", watts=612.0, limit_w=700.0, at=5.0),
        Power("bmc", "ipmi", at=5.0, error="x"),
    ]
    agent.publish([Load("e1", 0, 1, 0.2, power=power), Load("e2", 0, 0, None, healthy=False, power=power)])
    await eventually(lambda: mgr.stats.batches == 2)
    for endpoint in (E1, E2):  # an unhealthy engine's node still reports its power
        state = fleet.get(endpoint)
        assert state is not None and state.power == tuple(power) and state.power_at == 100.0


async def test_energy_per_token_is_learnt_from_the_node_loads(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    """e1 and e2 share node-a: its watts over the sum of their output tokens/s (one load level so far:
    the average energy per token); the same reading on both loads counts once."""
    mgr, _, fleet = manager
    await connected(agent, mgr)
    power = [Power("dcgm", "dcgm", watts=600.0, at=5.0)]
    agent.publish(
        [
            Load("e1", 0, 2, 0.2, power=power, output_tps=100.0),
            Load("e2", 0, 2, 0.2, power=power, output_tps=200.0),
        ]
    )
    await eventually(lambda: mgr.stats.batches == 2)
    e1, e2 = fleet.get(E1), fleet.get(E2)
    assert e1 is not None and e2 is not None
    assert e1.output_tps == 100.0 and e2.output_tps == 200.0
    # the first load's reading was learnt when only e1's rate was known; the second is the same reading
    assert e1.energy_per_token == e2.energy_per_token == 6.0
    agent.publish(
        [Load("e1", 0, 2, 0.2, power=[Power("dcgm", "dcgm", watts=900.0, at=6.0)], output_tps=100.0)]
    )
    await eventually(lambda: mgr.stats.batches == 3)
    assert e1.energy_per_token == e2.energy_per_token == 3.0  # 900 W / 300 tokens/s
    # with an energy counter: the mean draw since the previous reading, not the instantaneous watts
    counted = [Power("dcgm", "dcgm", watts=70.0, energy_j=10_000.0, at=7.0)]
    agent.publish([Load("e1", 0, 2, 0.2, power=counted, output_tps=100.0)])
    await eventually(lambda: mgr.stats.batches == 4)
    later = [Power("dcgm", "dcgm", watts=70.0, energy_j=10_600.0, at=8.0)]  # 600 J in 1 s
    agent.publish([Load("e1", 0, 2, 0.2, power=later, output_tps=100.0)])
    await eventually(lambda: mgr.stats.batches == 5)
    assert e1.energy_per_token == 2.0  # 600 W / 300 tokens/s
    # the same readings give the node's power curve (the marginal-energy scorer's): busy readings only
    # so far, at 100-300 tokens/s with 2 requests running on each engine
    assert e1.power_curve is not None and e1.power_curve is e2.power_curve
    assert e1.power_curve.seq_tps is not None and e1.power_curve.seq_tps > 0


async def test_what_is_kept_per_endpoint_and_node_goes_with_them(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    """A fleet with churn (a replaced pod has a new name) keeps no load nor energy state of names gone,
    and a load naming an endpoint outside the fleet keeps nothing."""
    mgr, _, fleet = manager
    await connected(agent, mgr)
    power = [Power("dcgm", "dcgm", watts=600.0, at=5.0)]
    agent.publish(
        [
            Load("e1", 0, 2, 0.2, power=power, output_tps=100.0),
            Load("e2", 0, 2, 0.2, power=power, output_tps=200.0),
            Load("ghost", 0, 1, 0.1),
        ]
    )
    await eventually(lambda: mgr.stats.batches == 2)
    assert set(mgr.loads) == {E1, E2} and "node-a" in mgr._energy_at and "node-a" in mgr.energy._curves
    fleet.remove(E1)
    mgr.forget()
    assert set(mgr.loads) == {E2} and "node-a" in mgr._energy_at  # e2 is still on node-a
    fleet.remove(E2)
    mgr.forget()
    assert mgr.loads == {} and mgr._energy_at == {} and mgr._energy_last == {}
    assert "node-a" not in mgr.energy._curves and "node-a" not in mgr.energy._fits


async def test_lora_adapters_reach_the_endpoint_metrics(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    """An agent's Load names the engine's adapters (vllm:lora_requests_info): the fleet holds them."""
    mgr, _, fleet = manager
    await connected(agent, mgr)
    agent.publish(
        [Load("e1", 1, 2, 0.2, lora_running=["a1"], lora_waiting=["a2"], max_lora=2), Load("e2", 0, 0)]
    )
    await eventually(lambda: mgr.stats.batches == 2)
    e1, e2 = fleet.get(E1), fleet.get(E2)
    assert e1 is not None and e1.metrics is not None and e1.metrics.lora is not None
    assert e1.metrics.lora.running == {"a1"} and e1.metrics.lora.waiting == {"a2"}
    assert e1.metrics.lora.max_lora == 2 and e1.metrics.lora.free_slots == 0
    assert e2 is not None and e2.metrics is not None and e2.metrics.lora is None


async def test_prefix_cache_counters_reach_the_endpoint_metrics(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    """An agent's Load carries the engine's prefix-cache counters (the drift alarm's counter source); a
    Load without them (an older agent, an engine that exports none) leaves them unknown."""
    mgr, _, fleet = manager
    await connected(agent, mgr)
    agent.publish([Load("e1", 0, 1, 0.2, prefix_hits=96.0, prefix_queries=160.0), Load("e2", 0, 0)])
    await eventually(lambda: mgr.stats.batches == 2)
    e1, e2 = fleet.get(E1), fleet.get(E2)
    assert e1 is not None and e1.metrics is not None
    assert (e1.metrics.prefix_hits, e1.metrics.prefix_queries) == (96.0, 160.0)
    assert e2 is not None and e2.metrics is not None
    assert (e2.metrics.prefix_hits, e2.metrics.prefix_queries) == (None, None)


async def test_loads_with_nan_infinite_or_negative_queues_are_refused_and_counted(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    """A NaN queue compares false with every bound (it would read as idle): such a load is refused,
    counted malformed, and the endpoint keeps its last good load; the batch's other events apply."""
    mgr, index, fleet = manager
    await connected(agent, mgr)
    agent.publish([Load("e1", 4, 2, 0.5)])
    await eventually(lambda: mgr.stats.batches == 2)
    bad = [
        Load("e1", math.nan, 0, 0.1),
        Load("e1", 0, math.inf, 0.1),
        Load("e1", -math.inf, 0, 0.1),
        Load("e1", -1, 0, 0.1),
        Load("e1", 0, 0, math.nan),
        Load("e1", 0, 0, 0.1, healthy=False, draining=True),  # the one good load of the batch
    ]
    for i, load in enumerate(bad[:-1]):
        assert load_problem(load) is not None, i
    assert load_problem(bad[-1]) is None
    agent.publish([*bad[:-1], Stored("e1", [D3]), Load("e2", math.nan, math.nan, None), bad[-1]])
    await eventually(lambda: mgr.stats.batches == 3)
    assert mgr.stats.malformed == 6
    assert index.applied[-1] == ([Stored("e1", [D3])], 100.0)
    state, e2 = fleet.get(E1), fleet.get(E2)
    assert state is not None and state.metrics is not None and e2 is not None
    assert (state.metrics.waiting, state.metrics.running) == (4, 2)  # the last good load's
    assert not state.healthy and state.draining  # from the good load after them
    assert e2.metrics is None  # never had a good load


async def test_loads_with_nan_or_negative_prefix_counters_are_refused(
    agent: FeedServer, manager: tuple[FeedManager, FakeIndex, Fleet]
) -> None:
    """The drift alarm's counters ride on the Load: a NaN (or infinite, or negative) one would enter
    the alarm's window as NaN, whose error never trips. Such a load is refused and counted, as a NaN
    queue is; the endpoint keeps its last good load and counters."""
    mgr, _, fleet = manager
    await connected(agent, mgr)
    agent.publish([Load("e1", 4, 2, 0.5, prefix_hits=96.0, prefix_queries=160.0)])
    await eventually(lambda: mgr.stats.batches == 2)
    bad = [
        Load("e1", 0, 0, 0.1, prefix_hits=math.nan, prefix_queries=200.0),
        Load("e1", 0, 0, 0.1, prefix_hits=100.0, prefix_queries=math.nan),
        Load("e1", 0, 0, 0.1, prefix_hits=math.inf, prefix_queries=200.0),
        Load("e1", 0, 0, 0.1, prefix_hits=100.0, prefix_queries=-1.0),
    ]
    for i, load in enumerate(bad):
        assert load_problem(load) is not None, i
    agent.publish(bad)
    await eventually(lambda: mgr.stats.batches == 3)
    assert mgr.stats.malformed == len(bad)
    state = fleet.get(E1)
    assert state is not None and state.metrics is not None
    assert (state.metrics.prefix_hits, state.metrics.prefix_queries) == (96.0, 160.0)
    assert (state.metrics.waiting, state.metrics.running) == (4, 2)


# -- a feed speaks only for the endpoints registered with it ----------------------------------------------


async def test_a_feed_cannot_touch_endpoints_registered_with_another_feed(agent: FeedServer) -> None:
    """Agent A's feed naming e2, which agent B registered (``feed`` = B's address): a compromised or
    misconfigured agent must not add or remove e2's blocks, set its load, health or drain, clear it with a
    snapshot, or take it down with its own outage. Such events are dropped and counted (``foreign``);
    those of an endpoint not registered at all are dropped too (the index would ignore them: not precise
    before its registration), so A's snapshots and outages never reach endpoints it does not own."""
    b = FeedServer(FeedLog("node-b"), Held())
    await b.start()
    a_address, b_address = f"127.0.0.1:{agent.port}", f"127.0.0.1:{b.port}"
    fleet = Fleet(
        [
            Endpoint(E1, "127.0.0.1:9001", frozenset({"m"}), node="node-a", feed=a_address, kv_events=True),
            Endpoint(E2, "127.0.0.1:9002", frozenset({"m"}), node="node-b", feed=b_address, kv_events=True),
        ]
    )
    index = FakeIndex()
    mgr = FeedManager(index, fleet, subscriber="extproc-test", clock=lambda: 100.0)
    mgr.sync()
    try:
        await eventually(lambda: mgr.clients[a_address].connected and mgr.clients[b_address].connected)
        b.publish([Stored("e2", [D1]), Load("e2", 1, 1, 0.5)])
        await eventually(lambda: mgr.stats.batches == 3)
        e2 = fleet.get(E2)
        assert e2 is not None and e2.healthy and e2.metrics is not None and e2.metrics.waiting == 1
        applied = len(index.applied)
        agent.publish(
            [
                Stored("e2", [D2]),
                Removed("e2", [D1]),
                Cleared("e2"),
                Load("e2", 0, 0, None, healthy=False, draining=True),
                Stored("e9", [D3]),  # registered nowhere
                Stored("e1", [D3]),  # its own
            ]
        )
        await eventually(lambda: mgr.stats.batches == 4)
        assert index.applied[applied:] == [([Stored("e1", [D3])], 100.0)]
        assert e2.healthy and not e2.draining and e2.metrics.waiting == 1 and mgr.loads[E2].healthy
        assert mgr.stats.foreign == 4
        assert {v.address: v.endpoints for v in mgr.views(100.0)} == {a_address: ("e1",), b_address: ("e2",)}
        # A restarts (a snapshot) and then goes away: e2 is neither cleared nor marked unhealthy.
        port = agent.port
        await agent.aclose()
        await eventually(lambda: not mgr.clients[a_address].connected)
        e1 = fleet.get(E1)
        assert e1 is not None
        await eventually(lambda: not e1.healthy)
        assert e2.healthy
        held = Held()
        held.events = [Stored("e2", [D3]), Stored("e1", [D1])]
        again = FeedServer(FeedLog("node-a"), held, listen=a_address)
        await again.start()
        try:
            assert again.port == port
            await eventually(lambda: mgr.stats.resets == 3)
            assert E2 not in index.cleared and index.cleared[-1:] == [E1]
            assert index.applied[-1][0] == [Cleared("e1"), Stored("e1", [D1])]
        finally:
            await again.aclose()
    finally:
        await mgr.aclose()
        await b.aclose()


async def test_a_node_store_is_reported_by_its_own_kvcached_feed_only(agent: FeedServer) -> None:
    """``kvcached:<node>`` belongs to the feed its node's kvcached record names (``FeedManager.stores``):
    another node's daemon, or an agent, naming it is dropped and counted."""
    b = FeedServer(FeedLog("kvcached-b"), Held())
    await b.start()
    a_address, b_address = f"127.0.0.1:{agent.port}", f"127.0.0.1:{b.port}"
    index = FakeIndex()
    mgr = FeedManager(index, fleet_for(a_address), subscriber="extproc-test", clock=lambda: 100.0)
    mgr.stores = {"b": b_address}
    mgr.set_addresses({a_address, b_address})
    try:
        await eventually(lambda: mgr.clients[a_address].connected and mgr.clients[b_address].connected)
        b.publish([Stored("kvcached:b", [D1], tier="ram"), Stored("kvcached:a", [D2], tier="ram")])
        agent.publish([Stored("kvcached:b", [D3], tier="ram")])
        await eventually(lambda: mgr.stats.batches == 4)
        assert index.events() == [Stored("kvcached:b", [D1], tier="ram")]
        assert mgr.stats.foreign == 1  # kvcached:a has no record: dropped, not counted
    finally:
        await mgr.aclose()
        await b.aclose()


async def test_an_endpoint_registered_on_a_followed_feed_gets_what_it_held_before() -> None:
    """An agent's second engine: its catch-up went out on the feed before its registration reached the
    gateway (dropped then: it was nobody's); once the fleet names the feed for it, the feed is read again
    from a snapshot, which carries what the engine holds."""
    held = Held()
    agent = FeedServer(FeedLog("node-a"), held)
    await agent.start()
    address = f"127.0.0.1:{agent.port}"
    fleet = Fleet(
        [Endpoint(E1, "127.0.0.1:9001", frozenset({"m"}), node="node-a", feed=address, kv_events=True)]
    )
    index = FakeIndex()
    mgr = FeedManager(index, fleet, subscriber="extproc-test", clock=lambda: 100.0)
    mgr.sync()
    try:
        await eventually(lambda: mgr.clients[address].connected)
        held.events = [Stored("e2", [D1])]  # e2's catch-up, before its registration
        agent.publish([Cleared("e2"), Stored("e2", [D1])])
        await eventually(lambda: mgr.stats.batches == 2)
        assert Stored("e2", [D1]) not in index.events()
        fleet.upsert(
            Endpoint(E2, "127.0.0.1:9002", frozenset({"m"}), node="node-a", feed=address, kv_events=True)
        )
        mgr.sync()
        agent.publish([Load("e1", 0, 0, 0.1)])  # the next batch (loads go out every 0.1 s)
        await eventually(lambda: Stored("e2", [D1]) in index.events())
        assert mgr.stats.resets == 2 and mgr.stats.gaps == 0
    finally:
        await mgr.aclose()
        await agent.aclose()
