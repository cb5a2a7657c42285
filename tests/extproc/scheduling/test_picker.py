from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.fleet import EndpointState
from extproc.scheduling.picker import MaxScoreParams, MaxScorePicker


def endpoint(i: int) -> EndpointState:
    return EndpointState(Endpoint(EndpointId(f"e{i}"), f"10.0.0.{i}:8000", frozenset({"m"})))


def scored(scores: list[float]) -> list[tuple[EndpointState, float]]:
    return [(endpoint(i), s) for i, s in enumerate(scores)]


def pick_ids(picker: MaxScorePicker, scores: list[float], seed: int = 0) -> list[str]:
    return [s.id for s in picker.pick(scored(scores), random.Random(seed))]


@pytest.mark.parametrize(
    ("scores", "max_fallbacks", "expected"),
    [
        ([1.0, 3.0, 2.0, 0.5], 2, ["e1", "e2", "e0"]),
        ([1.0, 3.0, 2.0, 0.5], 0, ["e1"]),
        ([1.0, 3.0, 2.0, 0.5], 1, ["e1", "e2"]),
        ([1.0, 3.0, 2.0, 0.5], 10, ["e1", "e2", "e0", "e3"]),  # never more than there are
        ([5.0], 2, ["e0"]),
        ([], 2, []),
        ([math.nan, 0.0, 1.0], 2, ["e2", "e1", "e0"]),  # NaN ranks last
    ],
)
def test_order_and_fallback_count(scores: list[float], max_fallbacks: int, expected: list[str]) -> None:
    picker = MaxScorePicker(params=MaxScoreParams(max_fallbacks=max_fallbacks))
    assert pick_ids(picker, scores) == expected


def test_exact_ties_spread_over_all_tied_endpoints() -> None:
    picker = MaxScorePicker()
    firsts = Counter(pick_ids(picker, [2.0, 2.0, 2.0, 2.0, 1.0], seed)[0] for seed in range(400))
    assert set(firsts) == {"e0", "e1", "e2", "e3"}
    assert min(firsts.values()) > 60  # about 100 each: uniform, not biased to list order


def test_ties_never_displace_a_better_endpoint() -> None:
    picker = MaxScorePicker(params=MaxScoreParams(max_fallbacks=2))
    for seed in range(50):
        result = pick_ids(picker, [1.0, 2.0, 1.0, 1.0], seed)
        assert result[0] == "e1"
        assert set(result[1:]) <= {"e0", "e2", "e3"} and len(result) == 3


def test_tied_fallbacks_are_shuffled_too() -> None:
    picker = MaxScorePicker(params=MaxScoreParams(max_fallbacks=1))
    seconds = Counter(pick_ids(picker, [9.0, 1.0, 1.0, 1.0], seed)[1] for seed in range(300))
    assert set(seconds) == {"e1", "e2", "e3"}


def test_near_ties_within_epsilon_are_ties() -> None:
    near = [1.0, 1.0 - 1e-12, 0.5]
    loose = MaxScorePicker()
    strict = MaxScorePicker(params=MaxScoreParams(epsilon=0.0))
    assert {pick_ids(loose, near, seed)[0] for seed in range(100)} == {"e0", "e1"}
    assert {pick_ids(strict, near, seed)[0] for seed in range(100)} == {"e0"}
    wide = MaxScorePicker(params=MaxScoreParams(epsilon=0.6))
    assert {pick_ids(wide, near, seed)[0] for seed in range(200)} == {"e0", "e1", "e2"}


def test_same_seed_same_order() -> None:
    picker = MaxScorePicker(params=MaxScoreParams(max_fallbacks=5))
    scores = [1.0] * 6
    assert pick_ids(picker, scores, 7) == pick_ids(picker, scores, 7)
    assert len({tuple(pick_ids(picker, scores, seed)) for seed in range(20)}) > 10


def test_duplicate_endpoints_are_returned_once() -> None:
    a, b = endpoint(0), endpoint(1)
    result = MaxScorePicker().pick([(a, 2.0), (a, 2.0), (b, 1.0), (a, 0.5)], random.Random(0))
    assert [s.id for s in result] == ["e0", "e1"]


@pytest.mark.parametrize("kwargs", [{"max_fallbacks": -1}, {"epsilon": -1e-3}, {"epsilon": math.inf}])
def test_params_are_checked(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        MaxScoreParams(**kwargs)  # type: ignore[arg-type]
