"""The server-wide byte budget (sans-IO) and its metrics."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from kvcached.budget import ByteBudget
from kvcached.metrics import KvcachedMetrics


def test_a_charge_that_does_not_fit_is_refused_and_charges_nothing() -> None:
    budget = ByteBudget(100)
    assert budget.take(60) and budget.take(40)
    assert not budget.take(1)
    assert (budget.held_bytes, budget.peak_bytes, budget.refused) == (100, 100, 1)
    budget.give(60)
    assert budget.take(50) and not budget.take(11)
    assert (budget.held_bytes, budget.peak_bytes, budget.refused) == (90, 100, 2)
    budget.give(90)
    assert budget.held_bytes == 0


def test_misuse_is_an_error() -> None:
    with pytest.raises(ValueError):
        ByteBudget(0)
    budget = ByteBudget(10)
    with pytest.raises(ValueError):
        budget.take(-1)
    budget.take(5)
    with pytest.raises(ValueError):
        budget.give(6)  # more than was charged: a bug, never silently absorbed
    assert budget.held_bytes == 5


def test_the_peer_servers_budget_is_exported_at_each_scrape() -> None:
    stats = {"busy": 3, "buffer_bytes": 1024, "buffer_capacity_bytes": 4096, "requests": 9}
    metrics = KvcachedMetrics()
    metrics.watch_peer_server(lambda: stats)
    text = generate_latest(metrics.registry).decode()
    assert "kvcached_peer_buffer_bytes 1024.0" in text
    assert "kvcached_peer_buffer_capacity_bytes 4096.0" in text
    assert "kvcached_peer_busy_total 3.0" in text
    stats["buffer_bytes"] = 0
    metrics.watch_peer_server(lambda: stats)  # a second server replaces the first, no duplicate
    assert "kvcached_peer_buffer_bytes 0.0" in generate_latest(metrics.registry).decode()
