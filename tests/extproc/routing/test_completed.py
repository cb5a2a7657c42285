"""Completions counted by the router: each request it routed counts once, at the endpoint that served it,
in a bounded table; the endpoint's load counts it down."""

from __future__ import annotations

import random
from collections.abc import Sequence

import orjson

from contracts.digest import Digest
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.fleet import EndpointState, Fleet
from extproc.index.approximate import ApproximateIndex
from extproc.models.registry import ModelRegistry
from extproc.routing.request import Kind, parse_body
from extproc.routing.router import MAX_OPEN_REQUESTS, Decision, Router, RoutingPolicy
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile

MODEL = "m"


def router() -> Router:
    """Two endpoints of model ``m``, no tokenizer (byte digests)."""
    fleet = Fleet([Endpoint(EndpointId(f"e{i}"), f"127.0.0.{i}:1", frozenset({MODEL})) for i in range(2)])
    policy = RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16)
    return Router(fleet, ModelRegistry([]), ApproximateIndex(), policy, rng=random.Random(0))


def route(r: Router, request_id: str, now: float = 0.0) -> Decision:
    request = parse_body(Kind.COMPLETION, orjson.dumps({"model": MODEL, "prompt": f"hello {request_id}"}))
    return r.decide(request, request_id=request_id, now=now)


class Heard:
    """A routing listener that keeps the endpoints it was told changed."""

    def __init__(self) -> None:
        self.changed: list[EndpointId] = []

    def recorded(self, endpoint: EndpointId, digests: Sequence[Digest], now: float) -> None:
        self.changed.append(endpoint)

    def released(self, endpoint: EndpointId) -> None:
        self.changed.append(endpoint)


def test_a_routed_request_completes_once_at_its_pick() -> None:
    r = router()
    heard = Heard()
    decision = route(r, "a")
    r.finish(decision)  # Envoy closed the ext_proc stream right after routing: the engine still has it
    r.listener = heard
    pick = decision.endpoints[0]
    assert (pick.routed_since_scrape, pick.completed_since_scrape, pick.load) == (1, 0, 1.0)
    assert r.completed("a", 1.0) is pick
    assert (pick.completed_since_scrape, pick.net_routed, pick.load) == (1, 0, 0.0)
    assert heard.changed == [pick.id]  # the siblings hear the new count
    assert r.completed("a", 1.0) is None  # each request counts once
    assert r.completed("someone-elses", 1.0) is None  # another replica's: nothing changes
    assert pick.completed_since_scrape == 1 and heard.changed == [pick.id]


def test_a_request_served_elsewhere_completes_where_it_was_served() -> None:
    r = router()
    decision = route(r, "a")
    pick = decision.endpoints[0]
    other = next(s for s in r.fleet if s is not pick)
    r.served(decision, other.address, 0.5)  # Envoy used a fallback
    assert r.completed("a", 1.0) is other
    assert (other.routed_since_scrape, other.completed_since_scrape) == (1, 1)
    assert (pick.routed_since_scrape, pick.completed_since_scrape) == (0, 0)


def test_the_open_table_is_bounded_oldest_forgotten() -> None:
    r = router()
    r.max_open = 3
    picks = [route(r, f"r{i}").endpoints[0] for i in range(5)]
    assert r.completed("r0", 1.0) is None and r.completed("r1", 1.0) is None  # forgotten (lost logs)
    assert [r.completed(f"r{i}", 1.0) for i in range(2, 5)] == picks[2:]
    assert MAX_OPEN_REQUESTS == 65_536 and router().max_open == MAX_OPEN_REQUESTS


def state() -> EndpointState:
    fleet = Fleet([Endpoint(EndpointId("a"), "127.0.0.1:1", frozenset({MODEL}))])
    got = fleet.get(EndpointId("a"))
    assert got is not None
    return got


def test_load_subtracts_completions_with_metrics_floored_at_zero() -> None:
    s = state()
    s.metrics = EngineMetrics(waiting=1.0, running=4.0, kv_usage=None, at=0.0)
    s.routed_since_scrape, s.completed_since_scrape = 2, 3  # 3 of its requests ended, 2 new ones
    assert s.load == 4 + 1 + 2 - 3
    s.sibling_routed = -2  # the siblings' requests ended too
    assert s.load == 2.0
    s.completed_since_scrape = 20  # more completions than the scrape knew of (it raced them)
    assert s.load == 0.0


def test_load_without_metrics_is_open_streams_or_the_net_routed() -> None:
    s = state()
    s.routed_since_scrape, s.completed_since_scrape = 5, 2
    assert s.load == 3.0  # never scraped: exactly the requests routed there and not complete
    s.sibling_routed = 1
    s.in_flight, s.sibling_in_flight = 1, 1
    assert s.load == 4.0
    s.completed_since_scrape = 9
    assert s.load == 2.0  # the open streams, never below
    s.in_flight = s.sibling_in_flight = 0
    assert s.load == 0.0


def test_a_scrape_zeroes_the_completions_it_already_counts() -> None:
    fleet = Fleet([Endpoint(EndpointId("a"), "127.0.0.1:1", frozenset({MODEL}))])
    s = fleet.get(EndpointId("a"))
    assert s is not None
    s.routed_since_scrape, s.completed_since_scrape = 4, 3
    fleet.record_scrape(s.id, EngineMetrics(waiting=0.0, running=1.0, kv_usage=None, at=0.0))
    assert (s.routed_since_scrape, s.completed_since_scrape, s.load) == (0, 0, 1.0)
    # Sent with 2 completions counted; 1 more arrives while it is in flight: that one is kept.
    s.routed_since_scrape, s.completed_since_scrape = 1, 3
    fleet.record_scrape(s.id, EngineMetrics(waiting=0.0, running=2.0, kv_usage=None, at=1.0), 1, 2)
    assert (s.routed_since_scrape, s.completed_since_scrape, s.load) == (0, 1, 1.0)


def test_a_commit_after_its_endpoint_left_the_fleet_records_nothing() -> None:
    """The index record runs after the answer; when the pick left the fleet meanwhile (its blocks already
    dropped from the index), the record would bring it back there for a new process reusing the id."""
    r = router()
    long_prompt = orjson.dumps({"model": MODEL, "prompt": "x" * 200})
    decision = r.decide(parse_body(Kind.COMPLETION, long_prompt), request_id="a", now=0.0)
    assert decision.served is not None
    gone = decision.served.id
    r.fleet.remove(gone)
    r.index.drop_endpoint(gone)  # as the cluster does when the fleet changes
    r.commit(decision, 0.0)
    assert decision.recorded and gone not in r.index.occupancy()
    kept = r.decide(parse_body(Kind.COMPLETION, long_prompt), request_id="b", now=0.0)
    r.commit(kept, 0.0)  # an endpoint still in the fleet records as before
    assert kept.served is not None and r.index.occupancy().get(kept.served.id, 0) > 0
