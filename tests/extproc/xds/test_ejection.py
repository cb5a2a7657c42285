"""Ejection in memory: the schedule, its decay, its end; the fleet and the scheduler's ``healthy`` filter
reading it; the ``[ejection]`` config section."""

from __future__ import annotations

import random

import pytest

from contracts.errors import ConfigError
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.config import EjectionConfig, parse_config
from extproc.fleet import Fleet
from extproc.scheduling.filters import HealthyFilter
from extproc.scheduling.interface import CycleState, SchedulingRequest
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile
from extproc.xds.ejection import Ejector

E0 = EndpointId("e0")


@pytest.mark.parametrize(
    ("failures", "durations"),
    [
        # Each failure comes just after the previous ejection ended: 2, 4, 8, 16, then capped at 30.
        ([0.0, 2.5, 7.0, 15.5, 31.6, 62.0], [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]),
        # A quiet period of max_s (30 s) after an ejection's end starts over; just under it does not.
        ([0.0, 2.0 + 30.0], [2.0, 2.0]),
        ([0.0, 2.0 + 29.9], [2.0, 4.0]),
        ([0.0, 2.1, 6.1 + 30.0, 38.2], [2.0, 4.0, 2.0, 4.0]),
    ],
)
def test_schedule_doubles_up_to_max_and_decays(failures: list[float], durations: list[float]) -> None:
    ejector = Ejector(base_s=2.0, max_s=30.0)
    got = []
    for now in failures:
        ejection = ejector.fail(E0, "upstream_connection_failure", now)
        assert ejection is not None and ejection.start == now
        got.append(round(ejection.duration_s, 6))
    assert got == durations


def test_failures_while_ejected_change_nothing() -> None:
    ejector = Ejector(base_s=2.0, max_s=30.0)
    first = ejector.fail(E0, "upstream_connection_failure", 10.0)
    assert first is not None and (first.until, first.count, first.kind) == (
        12.0,
        1,
        "upstream_connection_failure",
    )
    # Other requests in flight, other Envoys: the same outage.
    assert ejector.fail(E0, "http_503", 10.5) is None
    assert ejector.fail(E0, "upstream_remote_reset", 11.999) is None
    # Its end: the next failure is the second in a row.
    second = ejector.fail(E0, "http_503", 12.0)
    assert second is not None and (second.count, second.duration_s, second.kind) == (2, 4.0, "http_503")
    # Endpoints are independent.
    other = ejector.fail(EndpointId("e1"), "upstream_request_timeout", 12.0)
    assert other is not None and other.count == 1


def test_a_failing_endpoint_never_overflows_the_schedule() -> None:
    ejector = Ejector(base_s=0.01, max_s=3600.0)
    now, durations = 0.0, []
    for _ in range(5000):
        ejection = ejector.fail(E0, "upstream_connection_failure", now)
        assert ejection is not None
        now = ejection.until
        durations.append(ejection.duration_s)
    assert durations[-1] == 3600.0 and durations[:3] == [0.01, 0.02, 0.04]


@pytest.mark.parametrize(("base_s", "max_s"), [(0.0, 30.0), (-1.0, 30.0), (31.0, 30.0), (2.0, float("inf"))])
def test_ejector_refuses_bad_bounds(base_s: float, max_s: float) -> None:
    with pytest.raises(ValueError, match="base_s"):
        Ejector(base_s, max_s)


def fleet(n: int = 3) -> Fleet:
    return Fleet(Endpoint(EndpointId(f"e{i}"), f"10.0.0.{i}:8000", frozenset({"m"})) for i in range(n))


def request(now: float) -> SchedulingRequest:
    return SchedulingRequest(request_id="r", model="m", digests=(), prompt_tokens=0, now=now)


def test_healthy_filter_drops_an_ejected_endpoint_until_its_ejection_ends() -> None:
    f = fleet()
    f.eject(E0, until=12.0)
    candidates = list(f)
    kept = {c.id for c in HealthyFilter().filter(request(11.999), CycleState(), candidates)}
    assert kept == {"e1", "e2"}
    kept = {c.id for c in HealthyFilter().filter(request(12.0), CycleState(), candidates)}
    assert kept == {"e0", "e1", "e2"}


def test_default_profile_never_picks_nor_falls_back_to_an_ejected_endpoint() -> None:
    f = fleet()
    f.eject(E0, until=100.0)
    profile = build_profile(DEFAULT_SCHEDULING, max_fallbacks=2)
    rng = random.Random(7)
    for _ in range(20):
        result = profile.schedule(request(50.0), CycleState(), list(f), rng)
        assert [e.id for e in result.endpoints] and E0 not in [e.id for e in result.endpoints]
    result = profile.schedule(request(100.0), CycleState(), list(f), rng)
    assert E0 in [e.id for e in result.endpoints]


def test_fleet_tells_watchers_of_ejections_and_never_shortens_one() -> None:
    f = fleet()
    calls: list[int] = []
    unwatch = f.watch(lambda: calls.append(1))
    f.eject(E0, until=10.0)
    f.eject(E0, until=5.0)  # shorter: ignored
    f.eject(EndpointId("nope"), until=10.0)  # unknown: ignored
    state = f.get(E0)
    assert state is not None and state.ejected_until == 10.0 and len(calls) == 1
    assert state.ejected(9.0) and not state.ejected(10.0)
    f.upsert(Endpoint(EndpointId("e9"), "10.0.0.9:8000", frozenset({"m"})))
    f.remove(EndpointId("e9"))
    f.record_scrape_failure(E0, unhealthy_after=1)
    f.record_scrape_failure(E0, unhealthy_after=1)  # already unhealthy: no change
    assert len(calls) == 4
    unwatch()
    f.eject(E0, until=20.0)
    assert len(calls) == 4


def test_ejection_config_defaults_and_values() -> None:
    assert parse_config({}).ejection == EjectionConfig(base_s=2.0, max_s=30.0)
    assert parse_config({"ejection": {"base_s": 0.5, "max_s": 10}}).ejection == EjectionConfig(0.5, 10.0)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"base_s": 0}, "ejection.base_s: must be a finite number >= 0.01"),
        ({"max_s": -1}, "ejection.max_s: must be a finite number >= 0.01"),
        ({"base_s": 40}, r"ejection.base_s: must be <= max_s \(30.0\)"),
        ({"max_s": 7200}, "ejection.max_s: must be <= 3600"),
        ({"base_s": "2"}, "ejection.base_s"),
        ({"base": 2}, "ejection"),
    ],
)
def test_ejection_config_errors(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"ejection": section})
