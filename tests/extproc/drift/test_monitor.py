"""The drift alarm's core in memory: the formulas of extproc/drift/README.md, the trip and clear rule,
the number of requests needed to trip, expiry, and the ``[drift]`` config table."""

from __future__ import annotations

import pytest

from contracts.config import Section
from contracts.errors import ConfigError
from extproc.drift.monitor import DriftMonitor, DriftPolicy, parse_drift

M, E = "model-a", "sim-0"
POLICY = DriftPolicy(window=8, min_samples=4, trip_error=0.5, clear_error=0.25, max_age_s=100.0)


def feed(monitor: DriftMonitor, samples: list[tuple[int, int]], now: float = 0.0) -> list[bool]:
    """Observe each (predicted, actual); the alarm's state after each."""
    out = []
    for predicted, actual in samples:
        monitor.observe(M, E, predicted, actual, now)
        out.append(monitor.views(now)[0].tripped)
    return out


@pytest.mark.parametrize(
    ("samples", "ratio", "error"),
    [
        ([(64, 64), (32, 32)], 1.0, 0.0),
        ([(64, 0), (32, 0)], 0.0, 1.0),
        ([(64, 32), (64, 64)], 0.75, 0.25),
        # More reused than predicted (a smaller engine block) does not hide another's shortfall.
        ([(64, 128), (64, 0)], 1.0, 0.5),
        # Nothing predicted: counted as observed, not compared.
        ([(0, 48), (64, 64)], 1.75 / 1.75, 0.0),
    ],
)
def test_ratio_and_error(samples: list[tuple[int, int]], ratio: float, error: float) -> None:
    monitor = DriftMonitor(POLICY)
    feed(monitor, samples)
    (view,) = monitor.views(0.0)
    assert view.ratio == pytest.approx(ratio) and view.error == pytest.approx(error)
    assert view.observed == len(samples) and view.samples == sum(p > 0 for p, _ in samples)


def test_an_engine_reusing_nothing_trips_at_min_samples() -> None:
    monitor = DriftMonitor(POLICY)
    assert feed(monitor, [(64, 0)] * 5) == [False, False, False, True, True]


def test_a_correct_engine_never_trips_and_requests_without_prediction_never_count() -> None:
    monitor = DriftMonitor(POLICY)
    states = feed(monitor, [(64, 64), (0, 0), (48, 64), (64, 48), (32, 32)] * 20)
    assert not any(states)


def test_turning_wrong_trips_after_w_times_trip_error_requests_and_clears_with_hysteresis() -> None:
    monitor = DriftMonitor(POLICY)
    feed(monitor, [(64, 64)] * 8)  # a full, right window: e0 = 0
    # k >= W (trip - e0) / (1 - e0) = 8 * 0.5 = 4 wrong samples
    assert feed(monitor, [(64, 0)] * 4) == [False, False, False, True]
    # Clears only at error <= 0.25: at the 6th right sample, 2 wrong of 8 are left (0.375 held it).
    assert feed(monitor, [(64, 64)] * 6) == [True, True, True, True, True, False]


def test_a_transition_is_returned_once() -> None:
    monitor = DriftMonitor(POLICY)
    changes = [monitor.observe(M, E, 64, 0, 0.0) for _ in range(6)]
    assert [c is not None for c in changes] == [False, False, False, True, False, False]
    assert changes[3] is not None and changes[3].tripped and (changes[3].model, changes[3].endpoint) == (M, E)


def test_per_model_and_endpoint_and_published_for_the_metrics_thread() -> None:
    monitor = DriftMonitor(POLICY)
    for _ in range(4):
        monitor.observe(M, "sim-1", 64, 0, 0.0)
        monitor.observe(M, "sim-0", 64, 64, 0.0)
        monitor.observe("model-b", "sim-1", 64, 64, 0.0)
    views = {(v.model, v.endpoint): v.tripped for v in monitor.views(0.0)}
    assert views == {(M, "sim-0"): False, (M, "sim-1"): True, ("model-b", "sim-1"): False}
    assert {k[:2]: v.tripped for k, v in monitor.published.items()} == views
    assert {k[2] for k in monitor.published} == {"responses"}
    monitor.forget("sim-1")
    assert set(monitor.published) == {(M, "sim-0", "responses")}


def test_old_samples_leave_the_window() -> None:
    monitor = DriftMonitor(POLICY)
    feed(monitor, [(64, 0)] * 4, now=0.0)
    (view,) = monitor.views(101.0)
    assert view.samples == 0 and view.ratio is None and not view.tripped


def test_the_config_table() -> None:
    assert parse_drift(Section({}, "drift")) == DriftPolicy()
    assert parse_drift(Section({"window": 10, "min_samples": 5}, "drift")).min_samples == 5
    for bad in ({"windw": 3}, {"window": 4, "min_samples": 8}, {"trip_error": 0.2, "clear_error": 0.3}):
        with pytest.raises(ConfigError):
            parse_drift(Section(bad, "drift"))
