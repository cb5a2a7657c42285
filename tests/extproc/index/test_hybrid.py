"""extproc.index.hybrid: each endpoint in the precise or the approximate index, and moves between them."""

from __future__ import annotations

from contracts.events import EndpointId, Removed, Stored
from extproc.index.hybrid import HybridIndex
from extproc.index.precise import SPECULATIVE
from tests.extproc.index.test_precise import CHAIN, OTHER, A, B, C


def test_hybrid_routes_records_and_events() -> None:
    hybrid = HybridIndex()
    hybrid.set_precise(A, True)
    hybrid.record(A, CHAIN, 0.0)
    hybrid.record(B, CHAIN[:3], 0.0)
    assert hybrid.precise.match(CHAIN, 0.0) == {A: 6}
    assert hybrid.approximate.match(CHAIN, 0.0) == {B: 3}
    assert hybrid.match(CHAIN, 0.0) == {A: 6, B: 3}
    hybrid.apply([Removed(A, CHAIN[2:3]), Stored(B, OTHER)], 1.0)  # B has no event feed: ignored
    assert hybrid.ignored_events == 1
    assert hybrid.match(CHAIN, 1.0) == {A: 2, B: 3}
    assert hybrid.match(OTHER, 1.0) == {}
    assert hybrid.match_tiers(CHAIN, 1.0) == {A: {SPECULATIVE: 2}, B: {"gpu": 3}}
    assert hybrid.occupancy() == {A: 5, B: 3}
    assert hybrid.is_precise(A) and not hybrid.is_precise(B)


def test_hybrid_moves_drop_old_entries() -> None:
    hybrid = HybridIndex()
    hybrid.record(A, CHAIN, 0.0)
    hybrid.set_precise(A, True)  # what the approximate index learned is gone
    hybrid.set_precise(A, True)
    assert hybrid.match(CHAIN, 0.0) == {}
    hybrid.apply([Stored(A, CHAIN)], 0.0)
    assert hybrid.match(CHAIN, 0.0) == {A: 6}
    hybrid.clear_endpoint(A)
    assert hybrid.match(CHAIN, 0.0) == {}
    hybrid.apply([Stored(A, CHAIN)], 0.0)
    hybrid.set_precise(A, False)
    assert hybrid.match(CHAIN, 0.0) == {}
    hybrid.record(A, CHAIN, 0.0)
    hybrid.clear_endpoint(A)  # a feed reset says nothing of what routing taught the approximate index
    assert hybrid.match(CHAIN, 0.0) == {A: 6}
    hybrid.set_precise(B, True)
    hybrid.apply([Stored(B, CHAIN)], 0.0)
    hybrid.record(C, CHAIN, 0.0)
    hybrid.drop_endpoint(A)
    hybrid.drop_endpoint(B)
    hybrid.drop_endpoint(C)
    assert not hybrid.is_precise(B)
    assert hybrid.match(CHAIN, 0.0) == {} == hybrid.occupancy()


def test_without_events_every_endpoint_stays_approximate() -> None:
    """``index.mode = "approximate"``: nothing becomes precise, every event is ignored, no node tier leads."""
    hybrid = HybridIndex(events=False)
    store = EndpointId("kvcached:n1")
    hybrid.set_precise(A, True)
    hybrid.set_precise(store, True)
    assert not hybrid.is_precise(A) and not hybrid.is_precise(store)
    hybrid.apply([Stored(A, CHAIN), Stored(store, CHAIN, tier="ram")], 0.0)
    assert hybrid.ignored_events == 2 and hybrid.match(CHAIN, 0.0) == {}
    assert hybrid.node_leads([store], CHAIN) == {}
    hybrid.record(A, CHAIN[:3], 0.0)
    assert hybrid.match(CHAIN, 0.0) == {A: 3} == hybrid.approximate.match(CHAIN, 0.0)
