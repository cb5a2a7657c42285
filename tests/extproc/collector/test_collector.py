"""extproc.collector: CPython's collections run after requests, start-up objects frozen; no timing."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from extproc.collector import SAFETY_FACTOR, Collector


@pytest.fixture
def collector() -> Iterator[Collector]:
    before = gc.get_threshold()
    made = Collector()
    yield made
    made.stop()
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_not_started_changes_nothing(collector: Collector) -> None:
    assert collector.after_request() is None
    assert gc.get_freeze_count() == 0


def test_start_freezes_and_raises_the_young_threshold(collector: Collector) -> None:
    t0, t1, t2 = gc.get_threshold()
    survivor = [object() for _ in range(10)]
    collector.start()
    collector.start()  # idempotent
    assert collector.started
    assert gc.get_threshold() == (t0 * SAFETY_FACTOR, t1, t2)
    assert gc.get_freeze_count() > 0 and gc.is_tracked(survivor)
    assert survivor not in gc.get_objects()  # frozen: in no generation


def test_after_request_collects_when_due_and_frees_cycles(collector: Collector) -> None:
    collector.start()
    t0 = gc.get_threshold()[0] // SAFETY_FACTOR
    assert collector.after_request() is None  # nothing allocated since the start's collection
    cycles: list[list[object]] = []
    for _ in range(t0):
        cycle: list[object] = []
        cycle.append(cycle)
        cycles.append(cycle)
    probe = cycles[0]
    probe_id = id(probe)
    del cycles, cycle, probe
    assert any(id(o) == probe_id for o in gc.get_objects(generation=0))
    assert collector.after_request() == 0  # one young collection: the cycles are freed
    assert not any(id(o) == probe_id for o in gc.get_objects())
    assert collector.collections[0] == 1
    assert collector.after_request() is None


def test_older_generations_follow_cpythons_counts(collector: Collector) -> None:
    collector.start()
    t0, t1, t2 = gc.get_threshold()
    t0 //= SAFETY_FACTOR
    seen: list[int] = []
    kept: list[list[list[object]]] = []
    for _ in range((t1 + 1) * (t2 + 1)):
        kept.append([[] for _ in range(2 * t0)])  # survivors: past the young threshold each time
        generation = collector.after_request()
        assert generation is not None
        seen.append(generation)
    kept.clear()
    assert seen[:t1] == [0] * t1 and seen[t1] == 1
    assert seen[-1] == 2 and seen.count(2) == 1  # after t2 collections of generation 1
