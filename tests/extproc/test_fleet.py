from __future__ import annotations

import time

from contracts.events import EndpointId
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.fleet import Fleet
from extproc.metrics import GatewayMetrics

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


def test_the_eligibility_gauge_counts_an_ejection() -> None:
    """``kvgate_endpoint_healthy`` is 0 while the endpoint is ejected after a failed try (the scheduler
    skips it then), 1 again once the ejection is over."""
    fleet = Fleet([EP])
    metrics = GatewayMetrics(fleet)

    def gauge() -> float | None:
        return metrics.registry.get_sample_value("kvgate_endpoint_healthy", {"endpoint": "a"})

    assert gauge() == 1.0
    fleet.eject(EP.id, time.monotonic() + 60)
    assert gauge() == 0.0
    state = fleet.get(EP.id)
    assert state is not None
    state.ejected_until = time.monotonic() - 1  # the ejection ended
    assert gauge() == 1.0


def test_power_readings_are_gauges_per_node_and_source_and_expire() -> None:
    """The readings an agent sends with its loads land on the endpoint's state and in
    ``kvgate_power_*{node,source}`` (one series per node even when two endpoints carry them; the newest
    wins); a failed source is ``up`` 0 with no figures; stale readings are forgotten."""
    from contracts.events import Power

    a = Endpoint(EndpointId("a"), "127.0.0.1:1", frozenset({"m"}), node="node-a")
    b = Endpoint(EndpointId("b"), "127.0.0.1:2", frozenset({"m"}), node="node-a")
    fleet = Fleet([a, b])
    metrics = GatewayMetrics(fleet)
    old = Power("dcgm", "dcgm", watts=500.0, at=1.0)
    new = Power(
        "dcgm", "dcgm", watts=610.0, limit_w=700.0, energy_j=1.5e6, temperature_c=71.0, throttled=True, at=2.0
    )
    bmc = Power("bmc", "redfish", at=2.0, error="access refused (check username and password): HTTP 401")
    fleet.record_power(a.id, (old,), now=10.0)
    fleet.record_power(b.id, (new, bmc), now=10.0)
    state = fleet.get(b.id)
    assert state is not None and state.power == (new, bmc)

    def sample(name: str, source: str = "dcgm") -> float | None:
        return metrics.registry.get_sample_value(name, {"node": "node-a", "source": source})

    assert sample("kvgate_power_watts") == 610.0
    assert sample("kvgate_power_limit_watts") == 700.0
    assert sample("kvgate_power_temperature_celsius") == 71.0
    assert sample("kvgate_power_throttled") == 1.0
    assert sample("kvgate_power_source_up") == 1.0
    assert sample("kvgate_power_energy_joules_total") == 1.5e6  # the newest reading's counter
    assert sample("kvgate_power_source_up", "bmc") == 0.0 and sample("kvgate_power_watts", "bmc") is None
    assert sample("kvgate_power_energy_joules_total", "bmc") is None  # a silent source gives no figure
    fleet.expire_metrics(now=13.0, stale_after=2.0)
    assert state.power == () and sample("kvgate_power_watts") is None


def test_an_address_taken_by_another_endpoint_stays_that_ones() -> None:
    """A new pod at a reused IP registered before the old one left: the old one's removal (or its move
    to another address) leaves the address to the new one."""
    fleet = Fleet([Endpoint(EndpointId("old-pod"), "10.0.0.5:8000", frozenset({"m"}))])
    fleet.upsert(Endpoint(EndpointId("new-pod"), "10.0.0.5:8000", frozenset({"m"})))
    fleet.upsert(Endpoint(EndpointId("old-pod"), "10.0.0.9:8000", frozenset({"m"})))
    found = fleet.by_address("10.0.0.5:8000")
    assert found is not None and found.id == "new-pod"
    fleet.remove(EndpointId("old-pod"))
    found = fleet.by_address("10.0.0.5:8000")
    assert found is not None and found.id == "new-pod"
    assert fleet.by_address("10.0.0.9:8000") is None


def test_an_ipv6_address_is_found_however_it_is_written() -> None:
    """Envoy reports an upstream as ``[fd00::1]:8000`` whatever form the endpoint was registered in."""
    fleet = Fleet([Endpoint(EndpointId("v6"), "[FD00:0::1]:8000", frozenset({"m"}))])
    found = fleet.by_address("[fd00::1]:8000")
    assert found is not None and found.id == "v6"
    assert fleet.by_address("[fd00::2]:8000") is None
    fleet.remove(EndpointId("v6"))
    assert fleet.by_address("[fd00::1]:8000") is None
