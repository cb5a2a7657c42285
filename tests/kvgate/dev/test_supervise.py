"""The restart policy of ``kvgate up``: capped exponential backoff, reset by a stable run (pure, no clock)."""

from __future__ import annotations

import signal

import pytest

from kvgate.dev.supervise import Backoff, Restart, RestartPlan, exit_reason


@pytest.mark.parametrize(
    ("attempt", "delay_s"),
    [(1, 0.2), (2, 0.4), (3, 0.8), (4, 1.6), (5, 3.2), (6, 6.4), (7, 10.0), (8, 10.0), (10_000, 10.0)],
)
def test_the_delay_doubles_from_initial_up_to_the_cap(attempt: int, delay_s: float) -> None:
    assert Backoff().delay_s(attempt) == pytest.approx(delay_s)


@pytest.mark.parametrize(
    "kwargs",
    [{"initial_s": 0}, {"initial_s": 2, "max_s": 1}, {"stable_s": 0}],
    ids=["zero", "above-cap", "stable"],
)
def test_a_backoff_that_cannot_work_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(**kwargs)


def test_attempts_start_at_one() -> None:
    with pytest.raises(ValueError, match="attempt"):
        Backoff().delay_s(0)


def test_a_child_that_keeps_dying_at_once_is_retried_at_growing_then_capped_delays() -> None:
    plan = RestartPlan(Backoff(initial_s=0.2, max_s=1.0, stable_s=30))
    plan.started(now=0.0)
    now, delays = 5.0, []
    for _ in range(6):
        restart = plan.exited(now)
        assert restart.at == pytest.approx(now + restart.delay_s)
        delays.append(restart.delay_s)
        now = restart.at
        plan.started(now)
        now += 0.05  # dies right after starting
    assert delays == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
    assert plan.attempt == 6


def test_a_stable_run_resets_the_sequence() -> None:
    plan = RestartPlan(Backoff(initial_s=0.2, max_s=10, stable_s=30))
    plan.started(now=0.0)
    assert plan.exited(now=1.0) == Restart(attempt=1, delay_s=0.2, at=1.2)
    plan.started(now=1.2)
    assert plan.exited(now=2.0) == Restart(attempt=2, delay_s=0.4, at=2.4)
    plan.started(now=2.4)
    assert plan.exited(now=2.4 + 29.9).attempt == 3  # just short of stable
    plan.started(now=100.0)
    assert plan.exited(now=130.0) == Restart(attempt=1, delay_s=0.2, at=130.2)  # ran 30 s: stable


def test_a_child_found_dead_before_any_start_was_seen_restarts_at_the_initial_delay() -> None:
    plan = RestartPlan()
    assert plan.exited(now=7.0) == Restart(attempt=1, delay_s=0.2, at=7.2)
    assert plan.exited(now=7.5).attempt == 2  # dead again without a start in between: not a stable run


@pytest.mark.parametrize(
    ("returncode", "reason"),
    [
        (0, "exit code 0"),
        (3, "exit code 3"),
        (-signal.SIGKILL, "signal SIGKILL"),
        (-signal.SIGTERM, "signal SIGTERM"),
        (-200, "signal 200"),
    ],
)
def test_exit_reason(returncode: int, reason: str) -> None:
    assert exit_reason(returncode) == reason
