"""``load.bench.migration``'s figures (the benchmark itself runs two stacks: not run here)."""

from __future__ import annotations

from load.bench import migration


def test_percentiles_are_not_one_rank_high() -> None:
    """p90 of ten values is not the largest, p50 of an even count is the middle two's mean."""
    values = [float(v) for v in range(1, 11)]
    assert migration._pct(values, 0.9) < 10.0
    assert migration._pct(values, 0.5) == 5.5
    assert migration._pct([3.0], 0.9) == 3.0
