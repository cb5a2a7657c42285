from __future__ import annotations

from contracts.events import EndpointId
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.fleet import Fleet

EP = Endpoint(EndpointId("a"), "127.0.0.1:1", frozenset({"m"}))


def test_load_is_engine_queue_plus_requests_routed_since_the_scrape() -> None:
    fleet = Fleet([EP])
    state = fleet.get(EP.id)
    assert state is not None
    state.routed_since_scrape = 3
    assert state.load == 3  # no metrics yet: what this gateway routed
    routed_before = state.routed_since_scrape  # the scrape is sent now...
    state.routed_since_scrape += 2  # ...two more requests are routed while it is in flight
    fleet.record_scrape(EP.id, EngineMetrics(waiting=1.0, running=4.0, kv_usage=None, at=0.0), routed_before)
    assert state.routed_since_scrape == 2 and state.load == 7.0
    fleet.record_scrape(EP.id, EngineMetrics(waiting=0.0, running=0.0, kv_usage=None, at=1.0))
    assert state.load == 0.0


def test_stale_metrics_fall_back_to_open_streams() -> None:
    fleet = Fleet([EP])
    state = fleet.get(EP.id)
    assert state is not None
    fleet.record_scrape(EP.id, EngineMetrics(waiting=5.0, running=5.0, kv_usage=0.5, at=0.0))
    state.in_flight = 2
    fleet.expire_metrics(now=10.0, stale_after=2.0)
    assert state.metrics is None and state.load == 2.0
