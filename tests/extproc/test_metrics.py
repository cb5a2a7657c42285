"""The ext_proc's index and feed metrics (issue 19: the KV dashboard's index size and feed staleness)."""

from __future__ import annotations

from prometheus_client import generate_latest

from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.fleet import Fleet
from extproc.metrics import FEED_COUNTERS, GatewayMetrics


def test_index_blocks_and_feed_counters_are_read_at_scrape_time() -> None:
    metrics = GatewayMetrics(Fleet([]))
    held = {EndpointId("a"): 3}
    counters = {"batches": 2, "events": 7}
    metrics.watch_index(lambda: held)
    metrics.watch_feeds(lambda: counters)
    metrics.feed_staleness.observe(0.02)
    held[EndpointId("b")] = 5
    counters["gaps"] = 1
    text = generate_latest(metrics.registry).decode()
    assert 'kvgate_index_blocks{endpoint="a"} 3.0' in text
    assert 'kvgate_index_blocks{endpoint="b"} 5.0' in text
    for name in FEED_COUNTERS:
        value = {"batches": 2, "events": 7, "gaps": 1}.get(name, 0)
        assert f"kvgate_feed_{name}_total {float(value)}" in text
    assert "kvgate_feed_staleness_seconds_count 1.0" in text
    assert "kvgate_etcd_endpoint_claims_refused_total 0.0" in text
    counters["endpoint_claims_refused"] = 2
    assert "kvgate_etcd_endpoint_claims_refused_total 2.0" in generate_latest(metrics.registry).decode()


def test_an_index_changing_during_the_scrape_is_read_again() -> None:
    metrics = GatewayMetrics(Fleet([]))
    calls = []

    def occupancy() -> dict[EndpointId, int]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("dictionary changed size during iteration")
        return {EndpointId("a"): 1}

    metrics.watch_index(occupancy)
    assert 'kvgate_index_blocks{endpoint="a"} 1.0' in generate_latest(metrics.registry).decode()


def test_ejection_series_of_an_endpoint_that_left_are_dropped() -> None:
    """A fleet with churn (pods replaced, each a new endpoint id) must not keep a series per endpoint
    ever ejected: the series of an endpoint no longer in the fleet go, the others stay."""
    metrics = GatewayMetrics(Fleet([]))
    metrics.ejected("a", "upstream_connection_failure")
    metrics.ejected("a", "http_503")
    metrics.ejected("b", "http_503")
    metrics.ejected("b", "http_503")
    metrics.keep_endpoints({"b", "c"})
    text = generate_latest(metrics.registry).decode()
    assert 'endpoint="a"' not in text
    assert 'kvgate_endpoint_ejections_total{endpoint="b",kind="http_503"} 2.0' in text
    metrics.keep_endpoints(set())
    assert "kvgate_endpoint_ejections_total{" not in generate_latest(metrics.registry).decode()
    metrics.ejected("a", "http_503")  # back again (same id): counted from 0
    text = generate_latest(metrics.registry).decode()
    assert 'kvgate_endpoint_ejections_total{endpoint="a",kind="http_503"} 1.0' in text


def test_flow_queue_series_of_a_model_no_endpoint_serves_go_when_its_queue_empties() -> None:
    """With a waiting room, a request for any model name is held until it times out (503): a client
    naming a new model each time must not leave a ``kvgate_flow_queued`` series per name. A served
    model's emptied band reads 0."""
    fleet = Fleet([Endpoint(EndpointId("e"), "10.0.0.1:8000", frozenset({"m"}))])
    metrics = GatewayMetrics(fleet)
    for i in range(100):
        metrics.depth({("m", 0): 1, (f"ghost-{i}", 0): 1})
        metrics.depth({})
    text = generate_latest(metrics.registry).decode()
    assert "ghost" not in text
    assert 'kvgate_flow_queued{model="m",priority="0"} 0.0' in text
