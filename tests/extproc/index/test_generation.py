"""``PrefixIndex.generation`` (issue 27.1): it never decreases, and while it reads the same every digest
that ``held`` said was held still is (the history memo skips re-checking a remembered chain by it).

Random operations on a hybrid index (approximate and precise endpoints, a node store) over a small set
of digests, with small capacities and TTLs so that every path that removes something is taken: LRU
eviction, sweeps of expired entries, ``Removed``, ``Cleared`` (every tier or one), clearing and dropping
an endpoint, moving one between the two indexes, speculative entries expiring.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.digest import Digest
from contracts.events import Cleared, EndpointId, IndexEvent, Removed, Stored, node_store_endpoint
from extproc.index.approximate import ApproximateIndex
from extproc.index.hybrid import HybridIndex
from extproc.index.precise import PreciseIndex

DIGESTS = [Digest(bytes([i]) * 16) for i in range(12)]
ENDPOINTS = [EndpointId(f"e{i}") for i in range(3)]
STORE = EndpointId(node_store_endpoint("n1"))
TIERS = ["gpu", "cpu", "disk", "ram", "ssd"]

digest_lists = st.lists(st.sampled_from(range(len(DIGESTS))), min_size=1, max_size=6)
operations = st.one_of(
    st.tuples(st.just("record"), st.sampled_from(ENDPOINTS), digest_lists),
    st.tuples(st.just("stored"), st.sampled_from([*ENDPOINTS, STORE]), digest_lists, st.sampled_from(TIERS)),
    st.tuples(st.just("removed"), st.sampled_from([*ENDPOINTS, STORE]), digest_lists, st.sampled_from(TIERS)),
    st.tuples(st.just("cleared"), st.sampled_from([*ENDPOINTS, STORE]), st.sampled_from([None, *TIERS])),
    st.tuples(st.just("clear"), st.sampled_from([*ENDPOINTS, STORE])),
    st.tuples(st.just("drop"), st.sampled_from([*ENDPOINTS, STORE])),
    st.tuples(st.just("precise"), st.sampled_from(ENDPOINTS), st.booleans()),
    st.tuples(st.just("wait"), st.floats(0.0, 3.0)),
    st.tuples(st.just("sweep")),
)


def held(index: HybridIndex) -> set[Digest]:
    return {d for d in DIGESTS if index.held(d)}


def apply(index: HybridIndex, op: tuple[object, ...], now: float) -> None:
    kind = op[0]
    if kind == "record":
        index.record(op[1], [DIGESTS[i] for i in op[2]], now)  # type: ignore[arg-type, attr-defined]
        return
    if kind in ("stored", "removed", "cleared"):
        endpoint = str(op[1])
        event: IndexEvent
        if kind == "stored":
            event = Stored(endpoint, [DIGESTS[i] for i in op[2]], str(op[3]))  # type: ignore[attr-defined]
        elif kind == "removed":
            event = Removed(endpoint, [DIGESTS[i] for i in op[2]], str(op[3]))  # type: ignore[attr-defined]
        else:
            event = Cleared(endpoint, op[2])  # type: ignore[arg-type]
        index.apply([event], now)
    elif kind == "clear":
        index.clear_endpoint(op[1])  # type: ignore[arg-type]
    elif kind == "drop":
        index.drop_endpoint(op[1])  # type: ignore[arg-type]
    elif kind == "precise":
        index.set_precise(op[1], bool(op[2]))  # type: ignore[arg-type]
    elif kind == "sweep":
        index.approximate.sweep(now, 3)
        index.precise.sweep(now, 2)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(operations, max_size=40))
def test_an_unchanged_generation_means_nothing_held_was_lost(ops: list[tuple[object, ...]]) -> None:
    index = HybridIndex(
        PreciseIndex(speculative_ttl_s=2.0),
        ApproximateIndex(capacity_blocks_per_endpoint=5, ttl_s=2.0),
    )
    index.set_precise(STORE, True)
    now = 0.0
    for op in ops:
        before, generation = held(index), index.generation
        if op[0] == "wait":
            now += float(op[1])  # type: ignore[arg-type]
            continue
        apply(index, op, now)
        index.match(DIGESTS, now)  # a match may sweep expired speculative entries too
        assert index.generation >= generation
        if index.generation == generation:
            assert before <= held(index), op


def test_each_removal_path_moves_it_and_records_do_not() -> None:
    approx = ApproximateIndex(capacity_blocks_per_endpoint=3, ttl_s=1.0)
    a, b = ENDPOINTS[0], ENDPOINTS[1]
    approx.record(a, DIGESTS[:3], 0.0)
    approx.record(b, DIGESTS[:2], 0.0)
    approx.record(a, DIGESTS[:3], 0.5)  # a refresh
    assert approx.generation == 0
    approx.record(a, DIGESTS[3:4], 0.5)  # evicts a's oldest, DIGESTS[2], held by a alone
    assert approx.generation == 1 and not approx.held(DIGESTS[2])
    approx.drop_endpoint(b)  # b's digests are a's too: nothing unheld
    assert approx.generation == 1
    approx.sweep(10.0, 100)  # everything expired
    assert approx.generation == 4 and not any(approx.held(d) for d in DIGESTS)

    precise = PreciseIndex(speculative_ttl_s=1.0)
    precise.apply([Stored(a, DIGESTS[:4])], 0.0)
    precise.apply([Stored(b, DIGESTS[:2], "cpu"), Stored(a, DIGESTS[4:6], "ram")], 0.0)
    precise.record(b, DIGESTS[6:8], 0.0)
    assert precise.generation == 0
    precise.apply([Removed(a, DIGESTS[:1])], 0.0)  # b still holds it in cpu
    assert precise.generation == 0
    precise.apply([Removed(a, DIGESTS[3:4])], 0.0)
    assert precise.generation == 1
    precise.apply([Cleared(a, "ram")], 0.0)
    assert precise.generation == 3
    precise.sweep(5.0)  # b's speculative entries expire
    assert precise.generation == 5
    precise.drop_endpoint(b)
    assert precise.generation == 6 and not precise.held(DIGESTS[0])

    hybrid = HybridIndex(PreciseIndex(), ApproximateIndex())
    hybrid.record(a, DIGESTS[:2], 0.0)
    hybrid.set_precise(a, True)  # moved: what the approximate index learned of it is gone
    assert hybrid.generation == 2
