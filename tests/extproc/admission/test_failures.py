"""Failed-authentication buckets per client address (pure)."""

from __future__ import annotations

import pytest

from extproc.admission.failures import FailedAuth, FailedAuthLimit


def test_burst_then_refill_at_the_rate() -> None:
    f = FailedAuth(FailedAuthLimit(per_minute=60, burst=2))
    assert f.retry_after_s("a", 0.0) is None and len(f) == 0  # never failed: no bucket
    f.failed("a", 0.0)
    assert f.retry_after_s("a", 0.0) is None
    f.failed("a", 0.0)
    assert f.retry_after_s("a", 0.0) == 1
    assert f.retry_after_s("a", 0.5) == 1  # half an attempt back: round up
    assert f.retry_after_s("a", 1.0) is None
    assert f.retry_after_s("a", 100.0) is None
    f.failed("a", 100.0)
    f.failed("a", 100.0)
    assert f.retry_after_s("a", 100.0) == 1  # refilled to the burst, never beyond


def test_the_table_is_bounded_least_recently_failed_first() -> None:
    f = FailedAuth(FailedAuthLimit(per_minute=1, burst=1, max_addresses=3))
    for address in ("a", "b", "c"):
        f.failed(address, 0.0)
    f.failed("a", 0.0)  # a failed again: most recent now
    f.failed("d", 0.0)
    assert len(f) == 3
    assert f.retry_after_s("b", 0.0) is None  # evicted
    assert all(f.retry_after_s(x, 0.0) is not None for x in ("a", "c", "d"))


def test_unknown_addresses_are_not_tracked() -> None:
    f = FailedAuth(FailedAuthLimit(burst=1))
    f.failed(None, 0.0)
    assert len(f) == 0 and f.retry_after_s(None, 0.0) is None


@pytest.mark.parametrize("limit", [FailedAuthLimit(per_minute=0), FailedAuthLimit(burst=0)])
def test_bad_limits_are_refused(limit: FailedAuthLimit) -> None:
    with pytest.raises(ValueError):
        FailedAuth(limit)
