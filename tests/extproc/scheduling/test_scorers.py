from __future__ import annotations

import math
import random

import pytest

from contracts.digest import Digest
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.fleet import EndpointState
from extproc.scheduling.interface import CycleState, SchedulingRequest, Scorer
from extproc.scheduling.scorers import (
    CacheSpreadScorer,
    InFlightScorer,
    KVUtilizationScorer,
    PrefixParams,
    PrefixScorer,
    QueueScorer,
    TierParams,
    TierScorer,
)


def endpoint(
    i: int, *, waiting: float | None = None, kv: float | None = None, in_flight: int = 0
) -> EndpointState:
    metrics = None if waiting is None else EngineMetrics(waiting=waiting, running=0.0, kv_usage=kv, at=0.0)
    ep = Endpoint(EndpointId(f"e{i}"), f"10.0.0.{i}:8000", frozenset({"m"}))
    # ``in_flight`` here is what the gateway routed since the last scrape: load = waiting + it
    return EndpointState(ep, in_flight=in_flight, routed_since_scrape=in_flight, metrics=metrics)


def request(blocks: int) -> SchedulingRequest:
    digests = tuple(Digest(i.to_bytes(16, "big")) for i in range(blocks))
    return SchedulingRequest(request_id="r", model="m", digests=digests, prompt_tokens=blocks * 16, now=0.0)


def ep_map(values: list[float]) -> dict[EndpointId, float]:
    return {EndpointId(f"e{i}"): v for i, v in enumerate(values)}


@pytest.mark.parametrize(
    ("blocks", "matched", "max_blocks", "expected"),
    [
        (10, {"e0": 10, "e1": 5}, 256, [1.0, 0.5, 0.0]),
        (4, {"e0": 1, "e2": 3}, 256, [0.25, 0.0, 0.75]),
        (0, {"e0": 3}, 256, []),  # no full block: no prefix signal at all (every endpoint scores 0)
        (300, {"e0": 256, "e1": 128}, 256, [1.0, 0.5, 0.0]),  # only max_blocks can ever match
        (8, {"e0": 9}, 256, [1.0, 0.0, 0.0]),  # an impossible count is capped
    ],
)
def test_prefix_scorer(blocks: int, matched: dict[str, int], max_blocks: int, expected: list[float]) -> None:
    state = CycleState(prefix_blocks={EndpointId(k): v for k, v in matched.items()})
    candidates = [endpoint(i) for i in range(3)]
    scores = PrefixScorer(params=PrefixParams(max_blocks=max_blocks)).score(
        request(blocks), state, candidates
    )
    assert scores == pytest.approx(ep_map(expected))


@pytest.mark.parametrize(
    ("waiting", "expected"),
    [
        ([0, 5, 10], [1.0, 0.5, 0.0]),  # past saturation (8): scaled by the busiest
        ([0, 2, 4], [1.0, 0.75, 0.5]),  # under saturation: scaled by saturation
        ([3, 3, 3], [0.625, 0.625, 0.625]),
        ([0, 1], [1.0, 0.875]),  # one extra queued request costs 1/8, not the whole score
        ([2, None, 16], {"e0": 0.875, "e2": 0.0}),  # no metrics: 0 (absent) and ignored for the max
        ([None, 4, None], {"e1": 0.5}),
        ([None, None], {}),
        ([1, math.nan, 3], {"e0": 0.875, "e2": 0.625}),  # a non-finite scrape counts as missing
        ([1, math.inf, 3], {"e0": 0.875, "e2": 0.625}),
        ([], {}),
    ],
)
def test_queue_scorer(waiting: list[float | None], expected: list[float] | dict[str, float]) -> None:
    candidates = [endpoint(i, waiting=w) for i, w in enumerate(waiting)]
    want = ep_map(expected) if isinstance(expected, list) else expected
    assert QueueScorer().score(request(1), CycleState(), candidates) == pytest.approx(want)


@pytest.mark.parametrize(
    ("kv", "expected"),
    [
        ([0.0, 0.25, 1.0], {"e0": 1.0, "e1": 0.75, "e2": 0.0}),
        ([None, 0.5], {"e1": 0.5}),  # metrics without kv_usage: 0
        ([1.2, -0.5], {"e0": 0.0, "e1": 1.0}),  # out-of-range usage is clamped
        ([math.nan], {}),
    ],
)
def test_kv_utilization_scorer(kv: list[float | None], expected: dict[str, float]) -> None:
    candidates = [endpoint(i, waiting=0.0, kv=u) for i, u in enumerate(kv)]
    candidates.append(endpoint(9))  # no metrics at all: 0
    assert KVUtilizationScorer().score(request(1), CycleState(), candidates) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("in_flight", "expected"),
    [
        ([0, 2, 4], [1.0, 0.75, 0.5]),
        ([8, 8], [0.0, 0.0]),
        ([0], [1.0]),
        ([0, 0, 10, 0], [1.0, 1.0, 0.0, 1.0]),
        ([16, 4], [0.0, 0.75]),
    ],
)
def test_in_flight_scorer(in_flight: list[int], expected: list[float]) -> None:
    candidates = [endpoint(i, in_flight=n) for i, n in enumerate(in_flight)]
    assert InFlightScorer().score(request(1), CycleState(), candidates) == pytest.approx(ep_map(expected))


@pytest.mark.parametrize(
    ("cached", "expected"),
    [
        ({}, [1.0, 1.0, 1.0]),  # nothing cached anywhere: all equal
        ({"e0": 100}, [0.0, 1.0, 1.0]),  # the one holding blocks is least attractive for a cold prefix
        ({"e0": 100, "e1": 50, "e2": 100}, [0.0, 0.5, 0.0]),
        ({"e0": 0, "e1": 0, "e2": 0}, [1.0, 1.0, 1.0]),
        ({"e0": 10, "e9": 1000}, [0.0, 1.0, 1.0]),  # non-candidates do not set the scale
        ({"e0": -5, "e1": 10}, [1.0, 0.0, 1.0]),
    ],
)
def test_cache_spread_scorer(cached: dict[str, int], expected: list[float]) -> None:
    state = CycleState(cached_blocks={EndpointId(k): v for k, v in cached.items()})
    candidates = [endpoint(i) for i in range(3)]
    assert CacheSpreadScorer().score(request(1), state, candidates) == pytest.approx(ep_map(expected))


ALL_SCORERS: list[Scorer] = [
    PrefixScorer(),
    QueueScorer(),
    KVUtilizationScorer(),
    InFlightScorer(),
    CacheSpreadScorer(),
]


@pytest.mark.parametrize("scorer", ALL_SCORERS, ids=lambda s: s.name)
def test_scores_stay_in_unit_interval_and_never_raise(scorer: Scorer) -> None:
    rng = random.Random(scorer.name)
    odd = [0.0, -1.0, 1e18, math.nan, math.inf, -math.inf]
    for _ in range(200):
        candidates = [
            endpoint(
                i,
                waiting=rng.choice([None, rng.random() * 50, rng.choice(odd)]),
                kv=rng.choice([None, rng.random() * 1.5, rng.choice(odd)]),
                in_flight=rng.randrange(0, 50),
            )
            for i in range(rng.randrange(0, 6))
        ]
        state = CycleState(
            prefix_blocks={c.id: rng.randrange(-2, 40) for c in candidates if rng.random() < 0.5},
            cached_blocks={c.id: rng.randrange(-2, 10**6) for c in candidates if rng.random() < 0.5},
        )
        scores = scorer.score(request(rng.randrange(0, 30)), state, candidates)
        assert set(scores) <= {c.id for c in candidates}
        assert all(0.0 <= v <= 1.0 for v in scores.values()), scores


def test_prefix_params_are_checked() -> None:
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixParams(max_blocks=0)


@pytest.mark.parametrize(
    ("gpu", "warm", "peer", "expected"),
    [
        ([0, 0, 0], [0, 0, 0], 0, [0.0, 0.0, 0.0]),  # no kvcached anywhere: 0 for everyone
        ([0, 0, 0], [8, 0, 0], 8, [0.5, 0.25, 0.25]),  # local fetch beats a peer fetch beats nothing
        ([8, 0, 0], [8, 0, 0], 8, [0.0, 0.25, 0.25]),  # already on the GPU: the tier adds nothing
        ([4, 0, 0], [8, 0, 0], 8, [0.25, 0.25, 0.25]),  # the GPU has half, kvcached the rest
        ([0, 2, 0], [0, 0, 6], 6, [0.1875, 0.125, 0.375]),  # peer blocks beyond what each already has
    ],
)
def test_tier_scorer_table(gpu: list[int], warm: list[int], peer: int, expected: list[float]) -> None:
    candidates = [endpoint(i) for i in range(3)]
    state = CycleState(
        prefix_blocks={EndpointId(f"e{i}"): n for i, n in enumerate(gpu) if n},
        warm_blocks={EndpointId(f"e{i}"): n for i, n in enumerate(warm) if n},
        peer_warm_blocks=peer,
    )
    scores = TierScorer().score(request(8), state, candidates)
    assert scores == pytest.approx(ep_map(expected))
    assert all(0.0 <= s <= 1.0 for s in scores.values())


def test_tier_params_are_ordered() -> None:
    with pytest.raises(ValueError, match="peer <= local"):
        TierParams(local=0.2, peer=0.5)
