"""The counter-based drift alarm in memory: engine-wide hit rates against the rates routed there."""

from __future__ import annotations

import pytest

from extproc.drift.counters import MAX_PENDING, MIXED, CounterDrift
from extproc.drift.monitor import COUNTERS, DriftPolicy, DriftView, Key

POLICY = DriftPolicy(window=8, min_samples=4, trip_error=0.5, clear_error=0.25)


def drift() -> tuple[CounterDrift, dict[Key, DriftView]]:
    published: dict[Key, DriftView] = {}
    return CounterDrift(POLICY, published), published


def run(d: CounterDrift, rounds: list[tuple[int, int, float, float]], start: float = 0.0) -> list[bool]:
    """Each round: ``requests`` routed to ``e`` (each predicted ``p`` of 100 prompt tokens), then a
    reading that adds ``hits`` of ``queries``; the alarm after each."""
    hits = queries = 0.0
    d.reading("e", hits, queries, at=start, now=start)  # the baseline
    out = []
    for i, (requests, p, d_hits, d_queries) in enumerate(rounds, 1):
        for _ in range(requests):
            d.routed("e", "m", p, 100, at=start + i - 0.5)
        hits, queries = hits + d_hits, queries + d_queries
        d.reading("e", hits, queries, at=start + i, now=start + i)
        out.append(d.views(start + i)[0].tripped)
    return out


def test_an_engine_that_hits_what_was_predicted_never_trips() -> None:
    d, published = drift()
    assert d.reading("e", 0, 0, at=0, now=0) is None  # nothing routed there: not compared
    assert not any(run(d, [(2, 64, 128, 200)] * 20))
    (view,) = d.views(20.0)
    assert view.ratio == pytest.approx(1.0) and view.error == 0.0 and view.source == COUNTERS
    assert published[("m", "e", COUNTERS)] == view


def test_an_engine_that_hits_nothing_trips_once_min_samples_requests_predicted() -> None:
    d, _ = drift()
    assert run(d, [(1, 64, 0, 100)] * 5) == [False, False, False, True, True]
    (view,) = d.views(5.0)
    assert view.ratio == 0.0 and view.error == 1.0 and view.samples == 5


def test_rates_not_sums_other_gateways_traffic_does_not_trip_it() -> None:
    """The engine also serves another gateway's traffic (its queries triple) at the same hit rate."""
    d, _ = drift()
    assert not any(run(d, [(1, 64, 192, 300)] * 10))


def test_a_restart_restarts_the_comparison_and_a_stale_reading_is_skipped() -> None:
    d, _ = drift()
    run(d, [(1, 64, 64, 100)] * 3)
    d.routed("e", "m", 64, 100, at=9.5)
    assert d.reading("e", 5.0, 10.0, at=10, now=10) is None  # counters went down: a new baseline
    assert d.reading("e", 5.0, 10.0, at=10, now=11) is None  # the same reading again
    assert d.views(11.0)[0].samples == 3


def test_several_models_at_one_endpoint_are_one_alarm() -> None:
    d, published = drift()
    d.routed("e", "m", 64, 100, at=0)
    d.reading("e", 0, 0, at=0, now=0)
    d.routed("e", "other", 64, 100, at=0.5)
    d.reading("e", 64, 100, at=1, now=1)
    assert [k for k in published] == [(MIXED, "e", COUNTERS)]


def test_requests_routed_after_a_reading_was_taken_wait_for_the_next_one() -> None:
    """A burst of 16 (the first cold, the rest predicted 160 of 180 tokens each, as the engine then holds)
    routed before the reading taken after the first was heard: it compares the first alone, not the 16
    against the engine's one (a rate of 0 against 0.83: tripped, as an agent-fed engine's reading heard a
    scrape round late did on CI). The next reading holds the rest."""
    d, _ = drift()
    d.reading("e", 0, 0, at=0, now=0)
    d.routed("e", "m", 0, 180, at=0.1)
    for i in range(15):
        d.routed("e", "m", 160, 180, at=0.2 + i / 100)
    assert d.reading("e", 0, 180, at=0.15, now=0.5) is None  # taken at 0.15, heard after all 16
    (view,) = d.views(0.5)
    assert not view.tripped and view.samples == 0 and view.ratio is None and view.observed == 16
    d.reading("e", 15 * 160, 16 * 180, at=1.0, now=1.0)
    (view,) = d.views(1.0)
    assert not view.tripped and view.samples == 15 and view.ratio == pytest.approx(1.0)


def test_an_endpoint_never_read_holds_only_the_newest_requests() -> None:
    """An engine that exports no counters is never read: what it is routed stays bounded."""
    d, _ = drift()
    for i in range(MAX_PENDING + 10):
        d.routed("e", "m", 64, 100, at=float(i))
    d.reading("e", 0, 0, at=0, now=0)
    d.reading("e", 64, 100, at=float(MAX_PENDING + 10), now=float(MAX_PENDING + 10))
    (view,) = d.views(float(MAX_PENDING + 10))
    assert view.samples == MAX_PENDING and view.observed == MAX_PENDING + 10
