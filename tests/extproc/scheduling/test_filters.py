from __future__ import annotations

import pytest

from contracts.events import EndpointId
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.fleet import EndpointState
from extproc.scheduling.filters import (
    BalanceFilter,
    BalanceParams,
    HealthyFilter,
    LoadThresholdFilter,
    LoadThresholdParams,
    ModelFilter,
    SubsetFilter,
)
from extproc.scheduling.interface import CycleState, SchedulingRequest


def endpoint(
    i: int,
    *,
    models: tuple[str, ...] = ("m",),
    healthy: bool = True,
    draining: bool = False,
    waiting: float | None = None,
    kv: float | None = None,
    in_flight: int = 0,
) -> EndpointState:
    metrics = None if waiting is None else EngineMetrics(waiting=waiting, running=0.0, kv_usage=kv, at=0.0)
    ep = Endpoint(EndpointId(f"e{i}"), f"10.0.0.{i}:8000", frozenset(models))
    # ``in_flight`` here is what the gateway routed since the last scrape: load = waiting + it
    return EndpointState(
        ep,
        healthy=healthy,
        draining=draining,
        in_flight=in_flight,
        routed_since_scrape=in_flight,
        metrics=metrics,
    )


def request(model: str = "m", subset: frozenset[str] | None = None) -> SchedulingRequest:
    return SchedulingRequest(request_id="r", model=model, digests=(), prompt_tokens=0, now=0.0, subset=subset)


def ids(states: list[EndpointState]) -> list[str]:
    return [s.id for s in states]


@pytest.mark.parametrize(
    ("model", "served", "expected"),
    [
        ("m", [("m",), ("m", "x"), ("x",)], ["e0", "e1"]),
        ("x", [("m",), ("m", "x"), ("x",)], ["e1", "e2"]),
        ("y", [("m",), ("x",)], []),
        ("m", [], []),
    ],
)
def test_model_filter(model: str, served: list[tuple[str, ...]], expected: list[str]) -> None:
    candidates = [endpoint(i, models=m) for i, m in enumerate(served)]
    assert ids(ModelFilter().filter(request(model), CycleState(), candidates)) == expected


@pytest.mark.parametrize(
    ("healthy", "draining", "kept"),
    [(True, False, True), (False, False, False), (True, True, False), (False, True, False)],
)
def test_healthy_filter(healthy: bool, draining: bool, kept: bool) -> None:
    candidates = [endpoint(0, healthy=healthy, draining=draining), endpoint(1)]
    assert ids(HealthyFilter().filter(request(), CycleState(), candidates)) == (
        ["e0", "e1"] if kept else ["e1"]
    )


@pytest.mark.parametrize(
    ("subset", "expected"),
    [
        (None, ["e0", "e1", "e2"]),
        (frozenset({"10.0.0.1:8000"}), ["e1"]),
        (frozenset({"10.0.0.2:8000", "10.0.0.0:8000", "10.9.9.9:1"}), ["e0", "e2"]),
        (frozenset({"10.0.0.1:9999"}), []),  # same host, other port: not a match
        (frozenset(), []),  # empty hint: nothing eligible (the caller answers 503)
    ],
)
def test_subset_filter(subset: frozenset[str] | None, expected: list[str]) -> None:
    candidates = [endpoint(i) for i in range(3)]
    assert ids(SubsetFilter().filter(request(subset=subset), CycleState(), candidates)) == expected


@pytest.mark.parametrize(
    ("params", "loads", "expected"),
    [
        # loads: (waiting, kv_usage, in_flight) per endpoint; waiting None = no metrics
        (LoadThresholdParams(max_waiting_ratio=None), [(0, 0.1, 0), (8, 0.95, 0), (9, 0.1, 0)], ["e0", "e1"]),
        # relative waiting: a queue over max_waiting counts only above 1.5 x mean waiting + 2
        (
            LoadThresholdParams(),
            [(12, None, 0), (0, None, 0), (0, None, 0), (0, None, 0)],
            ["e1", "e2", "e3"],
        ),
        (
            LoadThresholdParams(),
            [(12, None, 0), (9, None, 0), (10, None, 0), (11, None, 0)],
            ["e0", "e1", "e2", "e3"],
        ),
        (LoadThresholdParams(max_waiting_ratio=1.0, waiting_slack=0), [(10, None, 0), (9, None, 0)], ["e1"]),
        (LoadThresholdParams(), [(0, None, 0), (8, None, 0), (9, None, 0)], ["e0", "e1", "e2"]),
        (LoadThresholdParams(), [(0, 0.99, 0), (1, 0.5, 0)], ["e0", "e1"]),  # KV use not checked by default
        (LoadThresholdParams(max_kv_usage=0.95), [(0, 0.96, 0), (1, 0.5, 0)], ["e1"]),
        # relative in-flight: mean 2.5, limit 1.5 x 2.5 + 2 = 5.75
        (LoadThresholdParams(), [(0, None, 6), (0, None, 4), (0, None, 0), (0, None, 0)], ["e1", "e2", "e3"]),
        (LoadThresholdParams(max_in_flight_ratio=None), [(0, None, 6), (0, None, 0)], ["e0", "e1"]),
        (LoadThresholdParams(in_flight_slack=0), [(0, None, 2), (0, None, 0)], ["e1"]),
        (LoadThresholdParams(), [(20, 0.1, 0), (None, None, 0)], ["e1"]),  # no metrics: never overloaded
        (LoadThresholdParams(), [(3, None, 0), (30, None, 0)], ["e0"]),  # no kv_usage: only waiting counts
        (
            LoadThresholdParams(max_kv_usage=0.95),
            [(20, 0.1, 0), (3, 0.99, 0)],
            ["e0", "e1"],
        ),  # all over: keep all
        (LoadThresholdParams(max_in_flight=4), [(0, 0.1, 5), (None, None, 4)], ["e1"]),
        (LoadThresholdParams(max_in_flight=4), [(0, 0.1, 5), (0, 0.1, 9)], ["e0", "e1"]),
        (
            LoadThresholdParams(max_waiting=0, max_kv_usage=2.0, max_waiting_ratio=None),
            [(1, 1.5, 0), (0, 1.5, 0)],
            ["e1"],
        ),
        (LoadThresholdParams(), [], []),
    ],
)
def test_load_threshold_filter(
    params: LoadThresholdParams, loads: list[tuple[float | None, float | None, int]], expected: list[str]
) -> None:
    candidates = [endpoint(i, waiting=w, kv=kv, in_flight=f) for i, (w, kv, f) in enumerate(loads)]
    result = LoadThresholdFilter(params=params).filter(request(), CycleState(), candidates)
    assert ids(result) == expected


@pytest.mark.parametrize(
    ("params", "exact", "expected"),
    [
        # mean 2.5: 1.5 x 2.5 + 2 = 5.75 drops e0's 6; with exact leads 2 x 2.5 + 2 = 7 keeps it
        (LoadThresholdParams(), False, ["e1", "e2", "e3"]),
        (LoadThresholdParams(), True, ["e0", "e1", "e2", "e3"]),
        (LoadThresholdParams(exact_in_flight_ratio=None), True, ["e1", "e2", "e3"]),  # the same ratio
        (LoadThresholdParams(exact_in_flight_ratio=1.0), True, ["e1", "e2", "e3"]),  # 1 x 2.5 + 2 = 4.5
        (LoadThresholdParams(max_in_flight_ratio=None), True, ["e0", "e1", "e2", "e3"]),  # off in both
        (LoadThresholdParams(max_in_flight_ratio=None), False, ["e0", "e1", "e2", "e3"]),
    ],
)
def test_the_relative_in_flight_limit_is_looser_with_exact_leads(
    params: LoadThresholdParams, exact: bool, expected: list[str]
) -> None:
    """A precise index's cycle (``CycleState.exact``) lets an owner run further over the mean before its
    requests move (the ``balance`` filter spreads a shared lead there); an approximate one's keeps 1.5."""
    candidates = [endpoint(i, waiting=0, in_flight=f) for i, f in enumerate([6, 4, 0, 0])]
    result = LoadThresholdFilter(params=params).filter(request(), CycleState(exact=exact), candidates)
    assert ids(result) == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"exact_in_flight_ratio": 0.5},
        {"exact_in_flight_ratio": float("inf")},
        {"max_waiting": -1.0},
        {"max_waiting": float("nan")},
        {"max_kv_usage": -0.1},
        {"max_in_flight": -1},
        {"max_waiting_ratio": 0.5},
        {"max_waiting_ratio": float("inf")},
        {"waiting_slack": -1.0},
    ],
)
def test_load_threshold_params_are_checked(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        LoadThresholdParams(**kwargs)  # type: ignore[arg-type]


def test_filters_carry_their_configured_names() -> None:
    assert ModelFilter("only-m").name == "only-m"
    assert LoadThresholdFilter().name == "load-threshold"


# --- balance -------------------------------------------------------------------------------------------


def routed(i: int, count: float, now: float = 0.0) -> EndpointState:
    state = endpoint(i)
    if count:
        state.count_routed(now, count)
    return state


def exact(prefix: dict[str, int] | None = None) -> CycleState:
    return CycleState(prefix_blocks={EndpointId(k): v for k, v in (prefix or {}).items()}, exact=True)


def test_recent_routed_decays_with_half_life() -> None:
    from extproc.fleet import ROUTED_HALF_LIFE_S

    state = routed(0, 8.0, now=100.0)
    assert state.recent_routed(100.0) == pytest.approx(8.0)
    assert state.recent_routed(100.0 + ROUTED_HALF_LIFE_S) == pytest.approx(4.0)
    assert state.recent_routed(50.0) == pytest.approx(8.0)  # a clock going backwards never inflates it
    state.count_routed(100.0 + ROUTED_HALF_LIFE_S, -1.0)
    assert state.recent_routed(100.0 + ROUTED_HALF_LIFE_S) == pytest.approx(3.0)
    state.count_routed(100.0 + ROUTED_HALF_LIFE_S, -10.0)
    assert state.recent_routed(100.0 + ROUTED_HALF_LIFE_S) == 0.0


def test_balance_drops_over_share_holders_of_a_prefix_others_hold_too() -> None:
    """A shared prefix (equal leads) no longer pins traffic to the replicas that hold it: the busy ones are
    dropped, an idle replica (cold, lead 0) and an under-share holder stay."""
    busy, idle, under = routed(0, 30.0), routed(1, 0.0), routed(2, 1.0)
    state = exact({"e0": 129, "e2": 129})
    kept = BalanceFilter().filter(request(), state, [busy, idle, under])
    assert ids(kept) == ["e1", "e2"]


def test_balance_keeps_an_over_share_replica_for_what_only_it_holds() -> None:
    """A session's follow-up: its own history is on the busy replica only (lead 8+ blocks longer)."""
    busy, idle = routed(0, 30.0), routed(1, 0.0)
    kept = BalanceFilter().filter(request(), exact({"e0": 140, "e1": 129}), [busy, idle])
    assert ids(kept) == ["e0", "e1"]
    kept = BalanceFilter().filter(request(), exact({"e0": 136, "e1": 129}), [busy, idle])
    assert ids(kept) == ["e1"]  # 7 blocks more is below min_lead_blocks (8)


def test_balance_limit_is_measured_from_the_least_loaded() -> None:
    """Against the mean, ratio x mean would let N / ratio replicas take all the traffic; from the least it
    cannot: here 6 equally busy replicas and 2 idle ones -> the busy ones go (no lead of their own)."""
    states = [routed(i, 10.0) for i in range(6)] + [routed(6, 0.0), routed(7, 0.0)]
    kept = BalanceFilter().filter(request(), exact(), states)
    assert ids(kept) == ["e6", "e7"]
    # within max(slack, (ratio - 1) x mean) of the least: all kept
    states = [routed(0, 12.0), routed(1, 10.0), routed(2, 10.5)]
    assert len(BalanceFilter().filter(request(), exact(), states)) == 3
    # a replica taking 75 % more than the least (it serves hits, so it finishes sooner) is within the
    # default share (2.0: limit 8 + 10); a ratio of 1.3 would drop it (limit 8 + 3)
    states = [routed(0, 14.0), routed(1, 8.0), routed(2, 8.0)]
    assert len(BalanceFilter().filter(request(), exact(), states)) == 3
    tight = BalanceFilter(params=BalanceParams(max_share_ratio=1.3))
    assert ids(tight.filter(request(), exact(), states)) == ["e1", "e2"]


def test_balance_needs_exact_leads_and_never_empties() -> None:
    busy, idle = routed(0, 30.0), routed(1, 0.0)
    inexact = CycleState(prefix_blocks={EndpointId("e0"): 129})
    assert ids(BalanceFilter().filter(request(), inexact, [busy, idle])) == ["e0", "e1"]
    assert ids(BalanceFilter().filter(request(), exact(), [busy])) == ["e0"]
    assert BalanceFilter().filter(request(), exact(), []) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_share_ratio": 0.9},
        {"max_share_ratio": float("inf")},
        {"share_slack": -1.0},
        {"min_lead_blocks": 0},
    ],
)
def test_balance_params_are_checked(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BalanceParams(**kwargs)  # type: ignore[arg-type]
