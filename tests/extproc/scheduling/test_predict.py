"""TTFT prediction (extproc/scheduling/predict.py), pure: the weighted line fit, what counts as queued
ahead, what a window of the engine's TTFT histogram teaches and what not; the ``slo`` filter and the
``ttft`` scorer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.fleet import EndpointState
from extproc.scheduling.filters import SLOFilter
from extproc.scheduling.interface import CycleState, SchedulingRequest
from extproc.scheduling.predict import (
    CONFIDENT_AFTER,
    PRIOR_BASE_S,
    PRIOR_TOKENS_PER_S,
    Fit,
    Observation,
    TTFTPredictor,
)
from extproc.scheduling.scorers import PredictedTTFTScorer

PRIOR_SLOPE = 1.0 / PRIOR_TOKENS_PER_S


def state(name: str = "a", waiting: float | None = None) -> EndpointState:
    s = EndpointState(Endpoint(name, f"10.0.0.{ord(name[0]) % 200}:8000", ("m",)))
    if waiting is not None:
        s.metrics = EngineMetrics(waiting, 0, 0.1, 0.0)
    return s


@pytest.mark.parametrize(
    ("points", "slope", "base"),
    [
        ([], PRIOR_SLOPE, PRIOR_BASE_S),  # nothing seen: the prior
        ([(100, 0.5)], PRIOR_SLOPE, 0.5 - PRIOR_SLOPE * 100),  # one point: the prior slope through it
        ([(1000, 0.3), (1010, 0.3), (1020, 0.3)], PRIOR_SLOPE, None),  # no spread: prior slope, mean
        ([(0, 0.05), (1000, 1.05), (2000, 2.05), (4000, 4.05)], 0.001, 0.05),  # a line: found exactly
        ([(0, 0.5), (1000, 0.5), (2000, 0.5)], PRIOR_SLOPE, None),  # flat (or falling): prior slope
        ([(10, 0.0001)], 0.0001 / 10, 0.0),  # the prior line would go below 0: through the origin
    ],
)
def test_the_fit_is_the_line_through_spread_points_else_the_prior_slope(
    points: list[tuple[float, float]], slope: float, base: float | None
) -> None:
    fit = Fit()
    for x, y in points:
        fit.add(x, y)
    got_slope, got_base = fit.line(PRIOR_SLOPE, PRIOR_BASE_S)
    if base is None:  # the line of the prior slope through the weighted means (later points weigh more)
        weights = [2.0 ** (-(len(points) - 1 - i) / 64.0) for i in range(len(points))]
        mean_x = sum(w * x for w, (x, _) in zip(weights, points, strict=True)) / sum(weights)
        mean_y = sum(w * y for w, (_, y) in zip(weights, points, strict=True)) / sum(weights)
        base = mean_y - slope * mean_x
    assert got_slope == pytest.approx(slope, rel=1e-3)
    assert got_base == pytest.approx(base, rel=1e-3, abs=1e-6)


def test_older_observations_weigh_less_so_the_line_follows_a_change() -> None:
    fit = Fit()
    for i in range(200):  # a slow engine, then a fast one
        fit.add(1000.0 * (i % 4), 0.002 * 1000 * (i % 4))
    for i in range(512):  # 8 half-lives: the slow ones weigh 1/256 of the fast
        fit.add(1000.0 * (i % 4), 0.0005 * 1000 * (i % 4))
    slope, _ = fit.line(PRIOR_SLOPE, PRIOR_BASE_S)
    assert slope == pytest.approx(0.0005, rel=0.05)


def test_prediction_adds_own_requests_queued_ahead_until_their_first_token() -> None:
    p = TTFTPredictor()
    a = state("a")
    assert p.predict(a, 1000, 0.0) == pytest.approx(PRIOR_BASE_S + PRIOR_SLOPE * 1000)
    first = p.routed("r1", a, 5000, 0.0)
    assert first == pytest.approx(PRIOR_BASE_S + PRIOR_SLOPE * 5000)
    assert p.ahead(a, 0.1) == 5000  # still prefilling at 0.1 s (first token due at ~0.52 s)
    assert p.predict(a, 1000, 0.1) == pytest.approx(PRIOR_BASE_S + PRIOR_SLOPE * 6000)
    assert p.ahead(a, first + 0.001) == 0  # past its predicted first token: decoding, not ahead
    assert p.ahead(state("b"), 0.1) == 0  # another endpoint's queue is its own
    p.routed("r2", a, 700, 1.0)
    p.forget("r2")  # its completion: gone from the tables
    assert p.ahead(a, 1.0) == 0 and len(p) == 1


def test_the_engine_queue_counts_when_it_holds_more_than_this_gateway_sent() -> None:
    p = TTFTPredictor()
    a = state("a", waiting=4)
    p.routed("r1", a, 800, 0.0)  # learns ~800 uncached tokens per request there
    assert p.ahead(a, 0.0) == pytest.approx(4 * 800)  # 4 waiting (others' too) x 800 > own 800
    a.metrics = EngineMetrics(0, 0, 0.1, 0.0)
    assert p.ahead(a, 0.0) == 800


def reading(s: EndpointState, at: float, total: float, count: float) -> None:
    """A scrape of ``s``: its TTFT histogram's cumulative sum and count at ``at``."""
    s.metrics = EngineMetrics(0, 0, 0.1, at, ttft_sum=total, ttft_count=count)


def test_windows_of_the_engine_ttft_histogram_teach_the_line() -> None:
    p = TTFTPredictor()
    seen: list[Observation] = []
    p.listener = seen.append
    a = state("a")
    total = count = 0.0
    for i in range(CONFIDENT_AFTER + 1):
        reading(a, at=10.0 * i, total=total, count=count)  # closes the last window, opens the next
        tokens = 1000 * (i % 4 + 1)
        p.routed(f"r{i}", a, tokens, 10.0 * i)  # alone: nothing ahead, x = tokens
        total, count = total + 2 * (0.05 + 0.0004 * tokens), count + 2  # its first token and one other's
    assert p.confident("a")
    assert p.line("a") == (pytest.approx(0.0004, rel=1e-6), pytest.approx(0.05, rel=1e-6))
    assert len(seen) == CONFIDENT_AFTER and {o.endpoint for o in seen} == {"a"}
    assert seen[0].observed_s == pytest.approx(0.05 + 0.0004 * 1000)
    assert seen[0].predicted_s == pytest.approx(PRIOR_BASE_S + PRIOR_SLOPE * 1000)


@pytest.mark.parametrize(
    ("readings", "routed_in_window", "learned"),
    [
        ([(0.0, 0.0, 0.0), (1.0, 0.5, 1.0)], True, 1),  # one window: one observation
        ([(0.0, 0.0, 0.0), (0.2, 0.5, 1.0)], True, 0),  # shorter than WINDOW_S: still open
        ([(0.0, 0.0, 0.0), (1.0, 0.5, 1.0)], False, 0),  # none of this gateway's requests: nothing to pair
        ([(0.0, 0.0, 0.0), (1.0, 0.0, 0.0)], True, 0),  # no first token counted
        ([(0.0, 9.0, 90.0), (1.0, 0.5, 1.0)], True, 0),  # the count fell: a restarted engine, start afresh
    ],
)
def test_what_a_window_teaches(
    readings: list[tuple[float, float, float]], routed_in_window: bool, learned: int
) -> None:
    p = TTFTPredictor()
    seen: list[Observation] = []
    p.listener = seen.append
    a = state("a")
    first, *rest = readings
    reading(a, *first)
    p.predict(a, 0, first[0])  # opens the window
    if routed_in_window:
        p.routed("r", a, 500, first[0])
    for at, total, count in rest:
        reading(a, at, total, count)
        p.predict(a, 0, at)
    assert len(seen) == learned


def test_readings_without_a_ttft_histogram_teach_nothing() -> None:
    p = TTFTPredictor()
    a = state("a", waiting=0)  # a load reading from an agent's feed: no histogram
    p.routed("r", a, 500, 0.0)
    a.metrics = EngineMetrics(0, 0, 0.1, 5.0)
    p.predict(a, 0, 5.0)
    assert not p.confident("a") and p.line("a") == (PRIOR_SLOPE, PRIOR_BASE_S)


def test_a_request_moved_to_a_fallback_counts_there() -> None:
    p = TTFTPredictor()
    a, b = state("a"), state("b")
    p.routed("r", a, 3000, 0.0)
    p.moved("r", b, 0.01)
    assert p.ahead(a, 0.02) == 0 and p.ahead(b, 0.02) == 3000
    p.moved("unknown", b, 0.01)
    assert len(p) == 1


def test_the_routed_table_is_bounded_by_age(monkeypatch: pytest.MonkeyPatch) -> None:
    import extproc.scheduling.predict as predict

    monkeypatch.setattr(predict, "MAX_PENDING", 3)
    p = TTFTPredictor()
    a = state("a")
    for i in range(5):
        p.routed(f"r{i}", a, 10, float(i))
    assert len(p) == 3
    p.routed("late", a, 10, 10_000.0)  # everything older than the TTL goes
    assert len(p) == 1 and p.ahead(a, 10_000.0) == 10


def test_requests_answered_long_before_their_predicted_first_token_leave_the_heap() -> None:
    """An overloaded engine's queue makes predictions long (here ~800 s); requests answered within 2 s
    are forgotten, and the heap that drops requests as their first token falls due must not keep them all
    until then: it stays within about twice the requests not yet answered."""
    p = TTFTPredictor()
    s = state("a", waiting=500.0)
    now = 0.0
    for i in range(20_000):  # 1,000 requests/s for 20 s, each answered 2 s after routing
        now += 0.001
        predicted = p.routed(f"r{i}", s, 4000, now)
        if i >= 2000:
            p.forget(f"r{i - 2000}")
    assert predicted > 100 and len(p) == 2000
    pending = p._ahead["a"]
    assert len(pending.heap) <= 2 * 2000 + 64
    assert pending.counted == sum(1 for _, _, r in pending.heap if r.ahead) == 2000
    assert p.ahead(s, now) == 2000 * 4000  # what is still ahead is all counted


def request(budget: float | None) -> SchedulingRequest:
    return SchedulingRequest("r", "m", (), 100, 0.0, ttft_budget_s=budget)


def test_the_slo_filter_keeps_endpoints_predicted_in_time_else_all() -> None:
    a, b, c = state("a"), state("b"), state("c")
    slo = SLOFilter()
    predicted = {"a": 0.9, "b": 0.2, "c": 0.3}
    cycle = CycleState(predicted_ttft=predicted)
    assert [s.id for s in slo.filter(request(0.5), cycle, [a, b, c])] == ["b", "c"]
    assert [s.id for s in slo.filter(request(0.1), cycle, [a, b, c])] == ["a", "b", "c"]  # none: all
    assert [s.id for s in slo.filter(request(None), cycle, [a, b, c])] == ["a", "b", "c"]
    assert [s.id for s in slo.filter(request(0.5), CycleState(), [a, b])] == ["a", "b"]
    assert SLOFilter.soft


def test_the_ttft_scorer_rates_the_soonest_first_token_1() -> None:
    a, b, c = state("a"), state("b"), state("c")
    scores = PredictedTTFTScorer().score(
        request(None), CycleState(predicted_ttft={"a": 0.2, "b": 0.4}), [a, b, c]
    )
    assert scores == {"a": 1.0, "b": 0.5}
    assert PredictedTTFTScorer().score(request(None), CycleState(), [a]) == {}


def test_an_endpoint_that_leaves_the_fleet_is_forgotten() -> None:
    """What was learned of an endpoint goes with it (no growth as endpoints come and go); the router
    prunes on every fleet change."""
    p = TTFTPredictor()
    a, b = state("a", waiting=0), state("b", waiting=0)
    total = count = 0.0
    for i in range(3):
        for s in (a, b):
            reading(s, at=10.0 * i, total=total, count=count)
            p.routed(f"{s.id}{i}", s, 1000 * (i + 1), 10.0 * i)
        total, count = total + 1.0, count + 2
    assert p.line("a") != (PRIOR_SLOPE, PRIOR_BASE_S) and len(p) == 6
    p.retain({"b"})
    assert p.line("a") == (PRIOR_SLOPE, PRIOR_BASE_S) and p.ahead(a, 0.0) == 0
    assert len(p) == 3 and p.line("b") != (PRIOR_SLOPE, PRIOR_BASE_S)


def test_the_backlog_drains_at_the_slope_so_a_finished_prefill_counts_nothing() -> None:
    p = TTFTPredictor()
    a = state("a")
    slope = 1e-4  # 10,000 tokens/s
    assert p.backlog(a, 0.0, slope) == 0  # idle: nothing to wait for
    p.routed("r1", a, 5000, 0.0)
    assert p.backlog(a, 0.0, slope) == pytest.approx(5000)
    assert p.backlog(a, 0.1, slope) == pytest.approx(4000)  # 1,000 tokens computed since
    assert p.backlog(a, 0.6, slope) == 0  # its prefill is done (the entry stays until its completion)
    p.routed("r2", a, 1000, 0.2)  # queued behind r1's remaining 3,000
    assert p.backlog(a, 0.2, slope) == pytest.approx(4000)
    assert p.backlog(a, 0.3, slope) == pytest.approx(3000)
    p.routed("r3", a, 500, 1.0)  # after an idle gap: only its own tokens
    assert p.backlog(a, 1.0, slope) == pytest.approx(500)
    assert p.backlog(a, 1.0, 2e-4) == pytest.approx(1000 + 500)  # at half the rate 1,000 of r1, r2 remain
    assert p.backlog(a, 1.0, 0.0) == 0  # an infinitely fast one
    assert p.backlog(state("b"), 0.0, slope) == 0


def test_the_backlog_counts_the_engine_queue_when_it_holds_more() -> None:
    p = TTFTPredictor()
    a = state("a", waiting=3)
    p.routed("r1", a, 800, 0.0)
    assert p.backlog(a, 0.0, 1e-4) == pytest.approx(3 * 800)  # 3 waiting (others' too) x 800
    assert p.backlog(a, 0.1, 1e-4) == pytest.approx(3 * 800 - 1000)  # the reading drains since it was taken
    assert p.backlog(a, 10.0, 1e-4) == 0
    a.metrics = EngineMetrics(0, 0, 0.1, 0.0)
    assert p.backlog(a, 0.0, 1e-4) == pytest.approx(800)  # own request only


def test_the_fitted_slope_is_none_while_the_prior_stands() -> None:
    p = TTFTPredictor()
    a = state("a")
    assert p.fitted_slope("a") is None
    total = count = 0.0
    for i in range(4):
        reading(a, at=10.0 * i, total=total, count=count)
        p.routed(f"r{i}", a, 1000 * (i % 4 + 1), 10.0 * i)
        if i < 3:
            assert p.fitted_slope("a") is None  # fewer than 3 observations: the prior's slope
        total, count = total + 0.05 + 0.0004 * 1000 * (i % 4 + 1), count + 1
    reading(a, at=40.0, total=total, count=count)
    p.predict(a, 0, 40.0)
    assert p.fitted_slope("a") == pytest.approx(0.0004, rel=1e-6)
    fit = Fit()
    for x in (1000, 2000, 3000):
        fit.add(x, 0.5)  # flat: the prior slope stays
    assert not fit.own_slope()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["route", "forget", "ahead", "move"]),
            st.integers(0, 7),  # request id
            st.sampled_from("ab"),  # endpoint
            st.integers(0, 5_000),  # uncached tokens
            st.floats(-0.5, 2.0),  # step of the clock (backwards at times)
        ),
        max_size=60,
    )
)
def test_ahead_kept_incrementally_equals_a_walk_over_the_routed_requests(
    ops: list[tuple[str, int, str, int, float]],
) -> None:
    """:meth:`TTFTPredictor.ahead` keeps a running sum (and a heap by first token); whatever the order
    of routes, forgets, moves and clocks (an earlier ``now`` too), it says what a walk over every
    request routed to the endpoint and not forgotten says."""
    p = TTFTPredictor()
    states = {"a": state("a"), "b": state("b")}
    live: dict[str, tuple[str, int, float]] = {}  # request id -> (endpoint, tokens, first token at)
    now = 0.0
    for op, rid, name, tokens, step in ops:
        now += step
        s, request_id = states[name], f"r{rid}"
        if op == "route":
            predicted = p.routed(request_id, s, tokens, now)
            live[request_id] = (name, tokens, now + predicted)
        elif op == "forget":
            p.forget(request_id)
            live.pop(request_id, None)
        elif op == "move" and request_id in live:
            old = live[request_id]
            p.moved(request_id, s, now)
            if old[0] != name:
                live[request_id] = (name, old[1], p._routed[request_id].first_token_at)
        for e, es in states.items():
            walked = sum(t for (n, t, first) in live.values() if n == e and first > now)
            assert p.ahead(es, now) == float(walked)
            pending = p._ahead.get(e)
            if pending is not None:  # the heap holds what counts, and few forgotten ones besides
                assert pending.counted == sum(1 for _, _, r in pending.heap if r.ahead)
                assert len(pending.heap) <= 2 * pending.counted + 64
