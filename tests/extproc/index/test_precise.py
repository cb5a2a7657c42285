from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.digest import Digest, block_digests, chain_seed
from contracts.errors import ConfigError
from contracts.events import ENGINE_TIERS, TIERS, Cleared, EndpointId, EventError, IndexEvent, Removed, Stored
from extproc.index.approximate import ApproximateIndex
from extproc.index.hybrid import HybridIndex
from extproc.index.interface import PrefixIndex
from extproc.index.precise import SPECULATIVE, SWEEP_ENTRIES, PreciseIndex

TTL = 10.0


A, B, C = (EndpointId(x) for x in ("a", "b", "c"))


CHAIN = block_digests(chain_seed("m"), list(range(6 * 4)), 4)  # 6 blocks


OTHER = block_digests(chain_seed("other"), list(range(2 * 4)), 4)


UNIVERSE = CHAIN + OTHER


WARM = block_digests(chain_seed("warm"), list(range(4)), 4)[0]  # in no query


PLACES = ("gpu", "cpu", "disk", SPECULATIVE, "ram", "ssd")


@dataclass
class Reference:
    """The definition, by brute force: sets of (endpoint, tier) holdings and speculative expiries."""

    max_match: int
    ttl: float = TTL
    exact: dict[tuple[str, str], set[bytes]] = field(default_factory=lambda: defaultdict(set))
    spec: dict[str, dict[bytes, float]] = field(default_factory=lambda: defaultdict(dict))

    def apply(self, event: IndexEvent) -> None:
        if isinstance(event, Stored | Removed):
            held = self.exact[(event.endpoint, event.tier)]
            if isinstance(event, Stored):
                held.update(event.digests)
            else:
                held.difference_update(event.digests)
            if event.tier in ENGINE_TIERS:
                for digest in event.digests:
                    self.spec[event.endpoint].pop(digest, None)
        else:
            self.clear(event.endpoint, event.tier)

    def clear(self, endpoint: str, tier: str | None) -> None:
        for t in TIERS if tier is None else (tier,):
            self.exact[(endpoint, t)].clear()
        if tier is None or tier in ENGINE_TIERS:
            self.spec[endpoint].clear()

    def record(self, endpoint: str, digests: Sequence[bytes], now: float) -> None:
        for digest in digests[: self.max_match]:
            self.spec[endpoint][digest] = now + self.ttl

    def place(self, endpoint: str, digest: bytes, now: float) -> str | None:
        """The fastest place ``endpoint`` holds ``digest`` (None: nowhere)."""
        for place in PLACES:
            if place == SPECULATIVE:
                if self.spec[endpoint].get(digest, -math.inf) > now:
                    return place
            elif digest in self.exact[(endpoint, place)]:
                return place
        return None

    def endpoints(self) -> set[str]:
        return {ep for ep, _ in self.exact} | set(self.spec)

    def match(self, digests: Sequence[bytes], now: float) -> dict[str, int]:
        result = {}
        for endpoint in self.endpoints():
            n = 0
            for digest in digests[: self.max_match]:
                if self.place(endpoint, digest, now) not in ("gpu", "cpu", "disk", SPECULATIVE):
                    break
                n += 1
            if n:
                result[endpoint] = n
        return result

    def match_tiers(self, digests: Sequence[bytes], now: float) -> dict[str, dict[str, int]]:
        result: dict[str, dict[str, int]] = {}
        for endpoint in self.endpoints():
            counts: dict[str, int] = {}
            for digest in digests[: self.max_match]:
                place = self.place(endpoint, digest, now)
                if place is None:
                    break
                counts[place] = counts.get(place, 0) + 1
            if counts:
                result[endpoint] = counts
        return result


def queries() -> list[list[Digest]]:
    return [CHAIN, CHAIN[:3], [CHAIN[0], OTHER[0], *CHAIN[2:]], CHAIN[1:], OTHER]


endpoints = st.sampled_from(["a", "b", "c"])


digest_lists = st.lists(st.sampled_from(UNIVERSE), max_size=8)


operations = st.one_of(
    st.tuples(st.just("stored"), endpoints, st.sampled_from(TIERS), digest_lists),
    st.tuples(st.just("removed"), endpoints, st.sampled_from(TIERS), digest_lists),
    st.tuples(st.just("cleared"), endpoints, st.one_of(st.none(), st.sampled_from(TIERS))),
    st.tuples(st.just("record"), endpoints, st.integers(0, 6)),
    st.tuples(st.just("record_any"), endpoints, digest_lists),
    st.tuples(st.just("drop"), endpoints),
    st.tuples(st.just("clear"), endpoints),
    st.tuples(st.just("wait"), st.sampled_from([0.5, 3.0, 9.5, 10.0, 11.0])),
    st.tuples(st.just("ttl"), st.sampled_from([2.0, TTL])),
)


def run(index: PreciseIndex, ref: Reference, ops: Sequence[tuple[Any, ...]], check: bool) -> float:
    now = 0.0
    for op in ops:
        kind = op[0]
        ep = EndpointId(str(op[1]))
        if kind in ("stored", "removed"):
            cls = Stored if kind == "stored" else Removed
            event = cls(ep, list(op[3]), tier=str(op[2]))
            index.apply([event], now)
            ref.apply(event)
        elif kind == "cleared":
            cleared = Cleared(ep, tier=op[2])
            index.apply([cleared], now)
            ref.apply(cleared)
        elif kind == "record":
            index.record(ep, CHAIN[: int(op[2])], now)
            ref.record(ep, CHAIN[: int(op[2])], now)
        elif kind == "record_any":
            index.record(ep, list(op[2]), now)
            ref.record(ep, list(op[2]), now)
        elif kind == "ttl":
            index.speculative_ttl_s = ref.ttl = float(op[1])
        elif kind in ("drop", "clear"):
            getattr(index, f"{kind}_endpoint")(ep)
            ref.clear(ep, None)
        else:
            now += float(op[1])
        if check:
            for query in queries():
                assert index.match(query, now) == ref.match(query, now), (op, query)
    return now


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(operations, max_size=30), max_match=st.sampled_from([4, 6, 256]))
def test_match_equals_reference_model(ops: list[tuple[Any, ...]], max_match: int) -> None:
    index = PreciseIndex(speculative_ttl_s=TTL, max_match_blocks=max_match)
    ref = Reference(max_match)
    now = run(index, ref, ops, check=True)
    for query in queries():
        assert index.match_tiers(query, now) == ref.match_tiers(query, now)
    for later in (now + 5, now + 10, now + 20):  # expiry (time never goes back: sweeps are final)
        for query in queries():
            assert index.match(query, later) == ref.match(query, later)


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(operations, max_size=30), warmup=st.lists(endpoints, max_size=3))
def test_instances_fed_the_same_events_agree(ops: list[tuple[Any, ...]], warmup: list[str]) -> None:
    first, second = PreciseIndex(), PreciseIndex()
    for i, name in enumerate(warmup):  # another slot layout: endpoints that stay, and a freed slot
        second.apply([Stored(f"z{i}{name}", [WARM])], 0.0)
    if warmup:
        second.drop_endpoint(EndpointId(f"z0{warmup[0]}"))
    now = run(first, Reference(256), ops, check=False)
    run(second, Reference(256), ops, check=False)
    for query in queries():
        assert first.match(query, now) == second.match(query, now)
        assert first.match_tiers(query, now) == second.match_tiers(query, now)
    occupancy = {ep: n for ep, n in second.occupancy().items() if not ep.startswith("z")}
    assert first.occupancy() == occupancy


def test_precise_index_satisfies_protocol() -> None:
    index: PrefixIndex = PreciseIndex()
    hybrid: PrefixIndex = HybridIndex()
    assert index.match([], 0.0) == hybrid.match(CHAIN, 0.0) == {}


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([Stored(A, CHAIN)], {A: 6}),
        ([Stored(A, CHAIN[:4]), Stored(B, CHAIN[:2])], {A: 4, B: 2}),
        ([Stored(A, CHAIN[1:])], {}),  # head evicted, tail kept: worth nothing
        ([Stored(A, CHAIN), Removed(A, CHAIN[2:3])], {A: 2}),  # a hole stops the count
        ([Stored(A, CHAIN[:3], tier="cpu"), Stored(A, CHAIN[3:], tier="disk")], {A: 6}),
        ([Stored(A, CHAIN, tier="ram"), Stored(B, CHAIN, tier="ssd")], {}),  # kvcached tiers need a fetch
        ([Stored(A, CHAIN), Stored(A, CHAIN, tier="cpu"), Removed(A, CHAIN)], {A: 6}),  # still in cpu
        ([Stored(A, CHAIN), Stored(A, CHAIN, tier="cpu"), Cleared(A, "cpu")], {A: 6}),
        ([Stored(A, CHAIN), Stored(A, CHAIN, tier="cpu"), Cleared(A)], {}),
        ([Stored(A, CHAIN), Removed(A, CHAIN, tier="cpu")], {A: 6}),  # not held there
        ([Stored(A, CHAIN), Cleared(A, "cpu")], {A: 6}),
        ([Stored(A, CHAIN), Stored(A, CHAIN, tier="ram"), Removed(A, CHAIN, tier="ram")], {A: 6}),
        ([Stored(A, CHAIN), Stored(B, CHAIN), Cleared(A, "gpu")], {B: 6}),
        ([Removed(C, CHAIN), Cleared(C)], {}),  # an endpoint never seen
    ],
)
def test_match_table(events: list[IndexEvent], expected: dict[EndpointId, int]) -> None:
    index = PreciseIndex()
    index.apply(events, 0.0)
    assert index.match(CHAIN, 0.0) == expected


def test_eviction_stops_the_preference_at_once() -> None:
    index = PreciseIndex()
    index.apply([Stored(A, CHAIN), Stored(B, CHAIN[:3])], 0.0)
    assert index.match(CHAIN, 1.0) == {A: 6, B: 3}
    index.apply([Removed(A, CHAIN[:1])], 1.0)  # the head goes: nothing of the chain is usable on A
    assert index.match(CHAIN, 1.0) == {B: 3}
    index.record(A, CHAIN, 2.0)  # routed there again: speculative until the engine reports
    index.apply([Removed(A, CHAIN[4:5])], 2.5)  # an eviction also drops the speculative entry
    assert index.match(CHAIN, 3.0) == {A: 4, B: 3}


def test_speculative_entries_confirm_and_expire() -> None:
    index = PreciseIndex(speculative_ttl_s=TTL)
    index.record(A, CHAIN, 0.0)
    assert index.match(CHAIN, 0.0) == {A: 6}
    assert index.occupancy() == {A: 6}
    index.apply([Stored(A, CHAIN[:4])], 1.0)  # the engine computed 4 blocks: confirmed
    assert index.occupancy() == {A: 6}
    assert index.match(CHAIN, TTL - 0.1) == {A: 6}
    assert index.match(CHAIN, TTL) == {A: 4}  # the unconfirmed 2 expired
    assert index.occupancy() == {A: 4}
    assert index.match(CHAIN, 100.0) == {A: 4}  # confirmed entries never expire


def test_record_refreshes_and_a_stored_tier_confirms() -> None:
    index = PreciseIndex(speculative_ttl_s=TTL)
    index.record(A, CHAIN, 0.0)
    index.record(A, CHAIN[:2], 5.0)
    assert index.match(CHAIN, 12.0) == {A: 2}
    assert index.match(CHAIN, 15.0) == {}
    index.record(B, CHAIN, 20.0)
    index.apply([Stored(B, CHAIN, tier="ram")], 20.0)  # kvcached holding it does not confirm the engine
    assert index.match_tiers(CHAIN, 20.0) == {B: {SPECULATIVE: 6}}
    assert index.match(CHAIN, 31.0) == {}
    assert index.match_tiers(CHAIN, 31.0) == {B: {"ram": 6}}


def test_speculative_ttl_can_change() -> None:
    """A policy change applies to later records; earlier ones keep their expiry."""
    index = PreciseIndex(speculative_ttl_s=TTL)
    index.record(A, CHAIN[:2], 0.0)
    index.speculative_ttl_s = 2
    assert index.speculative_ttl_s == 2.0
    index.record(B, CHAIN, 0.0)
    assert index.match(CHAIN, 1.0) == {A: 2, B: 6}
    assert index.match(CHAIN, 2.0) == {A: 2}
    assert index.match(CHAIN, TTL) == {}


def test_expiry_backlog_stays_exact() -> None:
    """More expired records than one call sweeps: match takes the slow path and is still exact."""
    index = PreciseIndex(speculative_ttl_s=TTL)
    for i in range(SWEEP_ENTRIES * 3):
        index.record(A, CHAIN, i * 0.01)
    index.record(B, CHAIN[:2], 5.0)
    index.apply([Stored(C, CHAIN)], 5.0)
    assert index.match(CHAIN, 11.0) == {B: 2, C: 6}
    assert not index.sweep(11.0, max_records=1)
    assert index.sweep(11.0, max_records=100)
    assert index.match(CHAIN, 11.0) == {B: 2, C: 6}
    assert index.occupancy() == {A: 0, B: 2, C: 6}
    assert index.holders(CHAIN[0], 11.0) == [B, C]


def test_match_tiers_reports_fastest_place_per_block() -> None:
    index = PreciseIndex()
    index.apply(
        [
            Stored(A, CHAIN[:2]),
            Stored(A, CHAIN[1:3], tier="cpu"),
            Stored(A, CHAIN[3:4], tier="disk"),
            Stored(A, CHAIN[4:], tier="ssd"),
            Stored(B, CHAIN[:1], tier="ram"),
            Stored(C, CHAIN, tier="ram"),
            Removed(C, CHAIN[1:2], tier="ram"),
        ],
        0.0,
    )
    index.record(B, CHAIN[:3], 0.0)
    assert index.match(CHAIN, 0.0) == {A: 4, B: 3}
    assert index.match_tiers(CHAIN, 0.0) == {
        A: {"gpu": 2, "cpu": 1, "disk": 1, "ssd": 2},
        B: {SPECULATIVE: 3},
        C: {"ram": 1},
    }


def test_drop_endpoint_frees_its_slot() -> None:
    index = PreciseIndex()
    index.apply([Stored(A, CHAIN), Stored(B, CHAIN[:2], tier="cpu"), Stored(B, CHAIN, tier="ram")], 0.0)
    index.record(B, CHAIN, 0.0)
    index.drop_endpoint(B)
    index.drop_endpoint(B)  # twice: nothing to do
    assert index.match(CHAIN, 0.0) == {A: 6}
    assert index.match_tiers(CHAIN, 0.0) == {A: {"gpu": 6}}
    assert index.occupancy() == {A: 6}
    assert index.endpoints() == [A]
    index.apply([Stored(C, CHAIN[:1])], 0.0)  # takes B's slot
    assert index.match(CHAIN, 20.0) == {A: 6, C: 1}
    assert len(index) == 6


def test_clear_endpoint_keeps_the_endpoint() -> None:
    index = PreciseIndex()
    index.apply([Stored(A, CHAIN)], 0.0)
    index.record(A, OTHER, 0.0)
    index.clear_endpoint(A)
    index.clear_endpoint(B)
    assert index.match(CHAIN, 0.0) == {} == index.match(OTHER, 0.0)
    assert index.occupancy() == {A: 0}
    assert len(index) == 0


def test_unknown_tier_and_bad_config_are_errors() -> None:
    index = PreciseIndex()
    with pytest.raises(EventError, match="tier 'hbm'"):
        index.apply([Stored(A, CHAIN, tier="hbm")], 0.0)
    with pytest.raises(EventError, match="tier 'hbm'"):
        index.apply([Stored(A, CHAIN), Cleared(A, tier="hbm")], 0.0)
    for kwargs in (
        {"speculative_ttl_s": 0.0},
        {"speculative_ttl_s": math.inf},
        {"speculative_ttl_s": "10"},
        {"max_match_blocks": 0},
        {"max_match_blocks": True},
    ):
        with pytest.raises(ConfigError):
            PreciseIndex(**kwargs)
    with pytest.raises(ConfigError, match="speculative_ttl_s"):
        index.speculative_ttl_s = -1.0
    with pytest.raises(ConfigError, match="max_match_blocks differ"):
        HybridIndex(PreciseIndex(max_match_blocks=8), ApproximateIndex(max_match_blocks=16))


def test_many_endpoints_random_against_reference() -> None:
    """Masks wider than a machine word: 100 endpoints, random events, compared with the reference."""
    rng = random.Random(7)
    index, ref = PreciseIndex(speculative_ttl_s=TTL), Reference(256)
    names = [f"e{i}" for i in range(100)]
    chain = block_digests(chain_seed("wide"), list(range(40 * 4)), 4)
    now = 0.0
    for _ in range(600):
        name = rng.choice(names)
        start, end = sorted(rng.sample(range(len(chain) + 1), 2))
        roll = rng.random()
        if roll < 0.5:
            event: IndexEvent = Stored(name, chain[start:end], tier=rng.choice(("gpu", "gpu", "cpu")))
        elif roll < 0.8:
            event = Removed(name, chain[start:end], tier=rng.choice(("gpu", "cpu")))
        elif roll < 0.82:
            event = Cleared(name, rng.choice((None, "gpu")))
        else:
            index.record(EndpointId(name), chain[:end], now)
            ref.record(name, chain[:end], now)
            now += rng.choice((0.0, 0.5, 2.0))
            continue
        index.apply([event], now)
        ref.apply(event)
    for later in (now, now + 5, now + 11):
        assert index.match(chain, later) == ref.match(chain, later)


def test_node_leads_count_kvcached_tiers_only() -> None:
    index = PreciseIndex()
    chain = [Digest(bytes([i]) * 16) for i in range(10)]
    a, b, c = (EndpointId(f"kvcached:{n}") for n in "abc")
    index.apply(
        [
            Stored(a, chain[:6], "ram"),
            Stored(a, chain[6:8], "ssd"),  # the lead runs across both node tiers
            Stored(b, chain[1:5], "ssd"),  # no block 0: no lead
            Stored(EndpointId("engine"), chain, "gpu"),  # engine tiers are not node tiers
        ],
        0.0,
    )
    assert index.node_leads([a, b, c, EndpointId("engine")], chain) == {a: 8}
    assert index.match(chain, 0.0) == {EndpointId("engine"): 10}  # node tiers never count in match
    index.apply([Removed(a, [chain[3]], "ram")], 0.0)
    assert index.node_leads([a], chain) == {a: 3}


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(operations, max_size=30))
def test_node_occupancy_counts_every_node_tier_entry(ops: list[tuple[Any, ...]]) -> None:
    """``node_occupancy`` (kept with each change) equals a count over the node tiers' tables, through
    stores, removals, clears and drops (freed slots reused)."""
    index = PreciseIndex(speculative_ttl_s=TTL)
    run(index, Reference(256), ops, check=False)
    scanned: dict[str, dict[str, int]] = {}
    for endpoint in index.endpoints():
        bit = 1 << index._slots[endpoint]
        for tier, table in index._node.items():
            n = sum(1 for mask in table.values() if mask & bit)
            if n:
                scanned.setdefault(endpoint, {})[tier] = n
    assert index.node_occupancy() == scanned
