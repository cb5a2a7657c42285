"""FlowQueues without IO: bands, fair share, EDF, bounds, expiry and bookkeeping (``now`` passed in)."""

from __future__ import annotations

import itertools
import types
from typing import Any

import pytest

from extproc.flow.policy import BandLimits, FlowPolicy
from extproc.flow.queue import (
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    SLO_UNATTAINABLE,
    Entry,
    FlowQueues,
    Pushed,
)

M = "m"


def policy(bands: dict[int, BandLimits] | None = None, *, sheddable_max_wait_s: float = 1.0) -> FlowPolicy:
    return FlowPolicy(
        band_limits=types.MappingProxyType(bands or {}), sheddable_max_wait_s=sheddable_max_wait_s
    )


def push(
    q: FlowQueues[str],
    name: str,
    *,
    priority: int = 0,
    flow: str = "f",
    cost: float = 1.0,
    size: int = 1,
    now: float = 0.0,
    deadline: float | None = None,
    model: str = M,
) -> Pushed[str]:
    return q.push(
        name, model=model, priority=priority, flow=flow, cost=cost, size=size, now=now, deadline=deadline
    )


def queued(q: FlowQueues[str], name: str, **kw: Any) -> Entry[str]:
    """Push ``name`` and return its entry (it must be queued)."""
    entry = push(q, name, **kw).entry
    assert entry is not None
    return entry


def drain(q: FlowQueues[str], model: str = M) -> list[str]:
    out: list[str] = []
    while (entry := q.pop(model)) is not None:
        out.append(entry.payload)
    return out


def pop_flow(q: FlowQueues[str]) -> str:
    entry = q.pop(M)
    assert entry is not None
    return entry.flow


def assert_empty(q: FlowQueues[str]) -> None:
    """Nothing queued and nothing kept: no model, band or flow left behind."""
    assert len(q) == 0
    assert q.models() == []
    assert q.depth() == {}
    assert q._models == {}
    assert q.next_expiry() is None
    assert q._expiry == []


# --- strict priority ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arrivals",
    [
        [0, 1, 0, 1, -1, 2, 0, -1, 2, 1],
        [-1, -1, 0, 0, 1, 1, 2, 2],
        [2, 2, 1, 1, 0, 0, -1, -1],
        [0] * 5 + [3],
    ],
)
def test_every_higher_band_entry_pops_before_any_lower_one(arrivals: list[int]) -> None:
    q = FlowQueues[str]()
    for i, priority in enumerate(arrivals):
        push(q, f"{priority}:{i}", priority=priority, flow=f"f{i % 3}")
    popped = [int(name.split(":")[0]) for name in drain(q)]
    assert popped == sorted(arrivals, reverse=True)
    assert_empty(q)


def test_depth_follows_the_bands() -> None:
    q = FlowQueues[str]()
    assert q.depth() == {} and q.queued(M) == 0
    push(q, "a", priority=0)
    push(q, "b", priority=2)
    push(q, "c", priority=2, model="other")
    assert max(p for m, p in q.depth() if m == M) == 2
    assert q.depth() == {(M, 0): 1, (M, 2): 1, ("other", 2): 1}
    assert q.queued(M) == 2 and len(q) == 3
    assert q.pop(M) is not None
    assert max(p for m, p in q.depth() if m == M) == 0


# --- fairness ------------------------------------------------------------------------------------------


def backlogged_pops(q: FlowQueues[str], flows: tuple[str, ...]) -> list[str]:
    """Pop while every flow in ``flows`` still has a request queued; the flows of the pops."""
    remaining = {f: 0 for f in flows}
    for bands in q._models.values():
        for band in bands.values():
            for name, fl in band.flows.items():
                remaining[name] = fl.count
    out: list[str] = []
    while all(remaining[f] for f in flows):
        entry = q.pop(M)
        assert entry is not None
        out.append(entry.flow)
        remaining[entry.flow] -= 1
    return out


def test_a_flow_sending_4x_gets_no_more_than_its_share_and_equal_costs_alternate() -> None:
    q = FlowQueues[str]()
    # interleaved arrivals: "heavy" sends 4 for each of "light"'s
    for i in range(40):
        for j in range(4):
            push(q, f"h{i}.{j}", flow="heavy", now=i)
        push(q, f"l{i}", flow="light", now=i)
    pops = backlogged_pops(q, ("heavy", "light"))
    assert len(pops) >= 79
    for flow in ("heavy", "light"):
        assert pops.count(flow) / len(pops) >= 0.45
    assert all(a != b for a, b in itertools.pairwise(pops)), pops


def test_the_light_flow_also_gets_its_share_while_the_heavy_keeps_arriving() -> None:
    q = FlowQueues[str]()
    pops: list[str] = []
    for i in range(30):
        for j in range(4):
            push(q, f"h{i}.{j}", flow="heavy", now=i)
        push(q, f"l{i}", flow="light", now=i)
        for _ in range(2):  # the fleet serves 2 per arrival round: both flows stay backlogged
            entry = q.pop(M)
            assert entry is not None
            pops.append(entry.flow)
    assert pops.count("light") == pops.count("heavy") == 30


@pytest.mark.parametrize(
    ("cost_a", "cost_b", "ratio"), [(3.0, 1.0, 1 / 3), (2.0, 1.0, 1 / 2), (1.0, 1.0, 1.0)]
)
def test_fairness_by_cost_shares_the_cost_not_the_requests(
    cost_a: float, cost_b: float, ratio: float
) -> None:
    q = FlowQueues[str]()
    for i in range(120):
        push(q, f"a{i}", flow="a", cost=cost_a)
        push(q, f"b{i}", flow="b", cost=cost_b)
    pops = backlogged_pops(q, ("a", "b"))
    got = pops.count("a") / pops.count("b")
    assert got == pytest.approx(ratio, rel=0.05)
    # the cost served to each flow is equal, within one request's cost
    assert abs(pops.count("a") * cost_a - pops.count("b") * cost_b) <= max(cost_a, cost_b)


def test_a_cost_below_one_counts_as_one() -> None:
    q = FlowQueues[str]()
    assert queued(q, "a", cost=0.0).cost == 1.0


def test_an_idle_flow_banks_no_credit() -> None:
    q = FlowQueues[str]()
    push(q, "a0", flow="a")
    for i in range(30):
        push(q, f"b{i}", flow="b")
    # "a" is served once, then idles while "b" is served alone 11 times; then it comes back with a burst
    assert [pop_flow(q) for _ in range(12)] == ["a"] + ["b"] * 11
    for i in range(1, 6):
        push(q, f"a{i}", flow="a")
    # it returns at the band's virtual time (the finish tag of b's last dispatch, b's own start tag:
    # the tie goes to b's older head), not at its old tag: the two alternate, no burst of "a"
    assert backlogged_pops(q, ("a", "b")) == ["b", "a"] * 5


def test_a_flow_just_served_does_not_jump_ahead() -> None:
    q = FlowQueues[str]()
    push(q, "a0", flow="a", cost=5.0)
    for i in range(10):
        push(q, f"b{i}", flow="b")
    assert [pop_flow(q) for _ in range(2)] == ["a", "b"]
    # "a" was served a cost of 5 and comes back at once: "b" is owed its share first (FCFS on a tie)
    push(q, "a1", flow="a", cost=5.0)
    assert [pop_flow(q) for _ in range(6)] == ["b"] * 5 + ["a"]


def test_a_new_fairness_id_per_request_does_not_monopolise_the_band() -> None:
    """A client sending each request under a new fairness id (the header is the client's without auth)
    against a backlogged flow: each new flow starts at the band's virtual time, which advances with every
    dispatch, so the backlogged flow is not starved (it was: served once in 1,999 dispatches)."""
    q = FlowQueues[str]()
    for i in range(5):
        push(q, f"a{i}", flow="a", cost=100)
    push(q, "x0", flow="x0", cost=100)
    pops = []
    for i in range(1, 20):  # a new id arrives with every dispatch
        push(q, f"x{i}", flow=f"x{i}", cost=100)
        pops.append(pop_flow(q))
    assert pops.count("a") == 5  # its whole backlog within 19 dispatches
    q = FlowQueues[str]()
    for i in range(400):
        push(q, f"a{i}", flow="a", cost=100)
    pops = []
    for i in range(300):  # a new id every other dispatch: half the band's service asked for
        if i % 2 == 0:
            push(q, f"x{i}", flow=f"x{i}", cost=100)
        pops.append(pop_flow(q))
    assert pops.count("a") >= 0.45 * len(pops)  # its fair half


def test_the_flow_table_keeps_only_backlogged_flows() -> None:
    """Flows that went idle are dropped (they hold no credit once served): 20,000 short flows through a
    band that stays backlogged leave no more flows than queued requests (it kept 20,010 for 10)."""
    q = FlowQueues[str]()
    for i in range(10):
        push(q, f"r{i}", flow=f"f{i}", cost=100)
    for i in range(10, 20_010):
        push(q, f"r{i}", flow=f"f{i}", cost=100)
        assert q.pop(M) is not None
        band = q._models[M][0]
        assert len(band.flows) <= band.count == 10


# --- within a flow ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arrivals", "order"),
    [
        # (name, deadline): FCFS without deadlines
        ([("a", None), ("b", None), ("c", None)], ["a", "b", "c"]),
        # earliest deadline first
        ([("a", 30.0), ("b", 10.0), ("c", 20.0)], ["b", "c", "a"]),
        # deadlines before no deadline, which stay FCFS among themselves
        ([("a", None), ("b", 50.0), ("c", None), ("d", 40.0)], ["d", "b", "a", "c"]),
        # equal deadlines: FCFS
        ([("a", 10.0), ("b", 10.0), ("c", 5.0)], ["c", "a", "b"]),
    ],
)
def test_within_a_flow_edf_then_fcfs(arrivals: list[tuple[str, float | None]], order: list[str]) -> None:
    q = FlowQueues[str]()
    for name, deadline in arrivals:
        push(q, name, deadline=deadline)
    assert drain(q) == order


# --- bounds ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limits", "sizes", "refused"),
    [
        (BandLimits(max_requests=2), [1, 1, 1], [False, False, True]),
        (BandLimits(max_bytes=10), [4, 6, 1], [False, False, True]),
        (BandLimits(max_bytes=10), [11], [True]),
        (BandLimits(max_requests=3, max_bytes=10), [5, 5, 0], [False, False, False]),
    ],
)
def test_a_full_band_refuses(limits: BandLimits, sizes: list[int], refused: list[bool]) -> None:
    q = FlowQueues[str](policy({0: limits}))
    pushed = [push(q, f"r{i}", size=size, flow=f"f{i}") for i, size in enumerate(sizes)]
    assert [p.entry is None for p in pushed] == refused
    assert all(p.evicted == () for p in pushed)
    assert q.queued(M) == refused.count(False)
    # another model's band and another band of the same model are bounded separately
    assert push(q, "x", size=1, model="other").entry is not None
    assert push(q, "y", size=1, priority=1).entry is not None


def test_a_full_band_drops_the_longest_flows_newest_so_a_light_flow_gets_in() -> None:
    q = FlowQueues[str](policy({0: BandLimits(max_requests=4)}))
    heavy = [queued(q, f"a{i}", flow="a") for i in range(4)]
    first = push(q, "b0", flow="b")
    assert first.entry is not None and first.evicted == (heavy[3],)
    assert not heavy[3].queued and heavy[3].reason == QUEUE_FULL
    second = push(q, "b1", flow="b")
    assert second.entry is not None and second.evicted == (heavy[2],)
    assert push(q, "b2", flow="b") == Pushed(None)  # 3 of b against 2 of a: b is the longer now
    assert push(q, "a4", flow="a") == Pushed(None)  # a is no lighter than b: refused, nothing dropped
    assert sorted(drain(q)) == ["a0", "a1", "b0", "b1"]


def test_a_fair_drop_that_frees_too_few_bytes_drops_nothing() -> None:
    q = FlowQueues[str](policy({0: BandLimits(max_bytes=10)}))
    heavy = [queued(q, f"a{i}", flow="a", size=s) for i, s in enumerate([6, 2, 2])]
    assert push(q, "big", flow="b", size=3) == Pushed(None)  # dropping a2 (2 bytes) leaves 10 + 3 - 2
    assert all(e.queued for e in heavy)
    fits = push(q, "small", flow="b", size=2)
    assert fits.entry is not None and fits.evicted == (heavy[2],)


def test_a_refused_push_into_a_new_band_leaves_nothing_behind() -> None:
    q = FlowQueues[str](policy({0: BandLimits(max_bytes=5)}))
    assert push(q, "big", size=6) == Pushed(None)
    assert_empty(q)


def test_a_full_band_evicts_no_non_sheddable_request_of_a_lower_band() -> None:
    q = FlowQueues[str](policy({1: BandLimits(max_requests=1)}))
    low = [queued(q, f"p0.{i}", priority=0) for i in range(3)]
    queued(q, "p1.0", priority=1)
    assert push(q, "p1.1", priority=1) == Pushed(None)
    assert all(e.queued for e in low)


def test_a_full_sheddable_band_evicts_none_of_its_own() -> None:
    q = FlowQueues[str](policy({-1: BandLimits(max_requests=2)}))
    own = [queued(q, f"s{i}", priority=-1) for i in range(2)]
    assert push(q, "s2", priority=-1) == Pushed(None)
    assert all(e.queued for e in own)


# --- expiry ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("priority", "band_wait", "sheddable_wait", "deadline", "expires", "reason"),
    [
        (0, 60.0, 1.0, None, 160.0, QUEUE_TIMEOUT),
        (0, 5.0, 1.0, None, 105.0, QUEUE_TIMEOUT),
        (-1, 60.0, 1.0, None, 101.0, QUEUE_TIMEOUT),  # sheddable: capped
        (-1, 0.5, 1.0, None, 100.5, QUEUE_TIMEOUT),  # its own band's wait is shorter
        (-2, 60.0, 3.0, None, 103.0, QUEUE_TIMEOUT),
        (0, 60.0, 1.0, 102.0, 102.0, SLO_UNATTAINABLE),  # the deadline comes first
        (0, 5.0, 1.0, 200.0, 105.0, QUEUE_TIMEOUT),  # the wait comes first
        (-1, 60.0, 1.0, 100.5, 100.5, SLO_UNATTAINABLE),
    ],
)
def test_expiry_time_and_reason(
    priority: int,
    band_wait: float,
    sheddable_wait: float,
    deadline: float | None,
    expires: float,
    reason: str,
) -> None:
    q = FlowQueues[str](
        policy({priority: BandLimits(max_wait_s=band_wait)}, sheddable_max_wait_s=sheddable_wait)
    )
    entry = queued(q, "r", priority=priority, now=100.0, deadline=deadline)
    assert entry.expires == pytest.approx(expires)
    assert entry.reason == reason
    assert q.next_expiry() == pytest.approx(expires)
    assert q.expire(expires - 0.01) == []
    assert q.expire(expires) == [entry]
    assert not entry.queued
    assert_empty(q)


def test_an_explicit_wait_and_reason_override_the_band() -> None:
    q = FlowQueues[str]()
    entry = q.push(
        "r", model=M, priority=0, flow="f", cost=1, size=1, now=10.0, max_wait_s=2.0, reason="no_endpoint"
    ).entry
    assert entry is not None
    assert (entry.expires, entry.reason) == (12.0, "no_endpoint")


def test_expire_takes_every_due_entry_in_expiry_order_and_leaves_the_rest() -> None:
    q = FlowQueues[str](policy({0: BandLimits(max_wait_s=10.0)}))
    late = queued(q, "late", now=5.0)  # expires 15
    early = queued(q, "early", now=0.0, flow="g")  # 10
    slo = queued(q, "slo", now=5.0, deadline=12.0)  # 12, slo_unattainable
    keep = queued(q, "keep", now=20.0)  # 30
    assert q.expire(15.0) == [early, slo, late]
    assert [e.reason for e in (early, slo, late)] == [QUEUE_TIMEOUT, SLO_UNATTAINABLE, QUEUE_TIMEOUT]
    assert keep.queued and len(q) == 1
    assert q.next_expiry() == 30.0


def test_next_expiry_skips_removed_and_popped_entries() -> None:
    q = FlowQueues[str](policy({0: BandLimits(max_wait_s=10.0)}))
    first = queued(q, "first", now=0.0)
    queued(q, "second", now=1.0)
    queued(q, "third", now=2.0, flow="g")
    assert q.next_expiry() == 10.0
    assert q.remove(first)
    assert q.next_expiry() == 11.0
    popped = q.pop(M)
    assert popped is not None and popped.payload == "second"
    assert q.next_expiry() == 12.0
    assert q.expire(11.5) == []  # neither the removed nor the popped one comes out again


def test_remove_frees_the_band_once() -> None:
    q = FlowQueues[str](policy({0: BandLimits(max_requests=2, max_bytes=10)}))
    a = queued(q, "a", size=6)
    queued(q, "b", size=4, flow="g")
    assert push(q, "c", size=1) == Pushed(None)
    assert q.remove(a) is True
    assert q.remove(a) is False
    assert q.queued(M) == 1 and not a.queued
    assert queued(q, "c", size=6).queued  # the count and bytes of "a" are free again
    assert drain(q) == ["b", "c"]
    assert q.remove(a) is False


def test_an_emptied_flow_removed_before_service_keeps_nothing() -> None:
    q = FlowQueues[str]()
    entries = [queued(q, f"r{i}", flow=f"f{i}") for i in range(5)]
    for entry in entries:
        assert q.remove(entry)
    assert_empty(q)


# --- no leak ---------------------------------------------------------------------------------------------


def test_nothing_is_kept_after_everything_leaves_by_every_way() -> None:
    q = FlowQueues[str](policy({0: BandLimits(max_wait_s=10.0)}))
    for i in range(6):
        for model in ("a", "b"):
            for priority in (-1, 0, 1):
                push(q, f"{model}{priority}{i}", model=model, priority=priority, flow=f"f{i % 3}", now=i)
    # some leave by pop, some by remove, the rest by expiry
    for model in ("a", "b"):
        for _ in range(4):
            assert q.pop(model) is not None
    for bands in list(q._models.values()):
        for band in list(bands.values()):
            for fl in list(band.flows.values()):
                victims = [e for _, _, e in fl.heap if e.queued][:1]
                for entry in victims:
                    assert q.remove(entry)
    q.expire(1000.0)
    assert_empty(q)


def test_a_drained_queue_keeps_no_flow_and_pop_answers_none() -> None:
    q = FlowQueues[str]()
    for i in range(3):
        push(q, f"r{i}", flow=f"f{i}")
    assert len(drain(q)) == 3
    assert_empty(q)
    assert q.pop(M) is None
    assert q.depth() == {}


def test_ten_thousand_distinct_flows_leave_no_flow_behind() -> None:
    q = FlowQueues[str]()
    batch = 50
    for start in range(0, 10_000, batch):
        for i in range(start, start + batch):
            push(q, f"r{i}", flow=f"flow-{i}", priority=i % 2, now=start)
        assert len(drain(q)) == batch
        assert q._models == {}, f"flows kept after {start + batch} pushes"
    assert_empty(q)


def test_a_full_model_queue_evicts_the_newest_of_the_lowest_sheddable_band_then_refuses() -> None:
    q: FlowQueues[str] = FlowQueues(FlowPolicy(max_queued=4))
    for name, priority in (("s2a", -2), ("s1a", -1), ("s2b", -2), ("b", 0)):
        queued(q, name, priority=priority)
    first = push(q, "i1", priority=1)
    assert first.entry is not None and [e.payload for e in first.evicted] == ["s2b"]
    assert first.evicted[0].reason == "queue_full" and not first.evicted[0].queued
    second = push(q, "i2", priority=1)
    assert [e.payload for e in second.evicted] == ["s2a"]
    third = push(q, "i3", priority=1)
    assert [e.payload for e in third.evicted] == ["s1a"]
    assert push(q, "i4", priority=1) == Pushed(None)  # only non-sheddable requests left
    assert push(q, "s", priority=-1) == Pushed(None)  # a sheddable one never evicts its equals
    assert drain(q) == ["i1", "i2", "i3", "b"]
    assert_empty(q)


def test_the_model_byte_bound_evicts_as_many_as_it_takes() -> None:
    q: FlowQueues[str] = FlowQueues(FlowPolicy(max_queued_bytes=100))
    for name in ("a", "b", "c"):
        queued(q, name, priority=-1, size=30)
    pushed = push(q, "big", priority=0, size=70)
    assert pushed.entry is not None and [e.payload for e in pushed.evicted] == ["c", "b"]
    assert push(q, "huge", priority=0, size=101) == Pushed(None)
    assert drain(q) == ["big", "a"]


def test_a_flow_never_dispatched_from_keeps_no_departed_entries() -> None:
    """A flow that stays backlogged while nothing is dispatched (an outage with a waiting room, every
    engine saturated) sheds its requests by expiry and by clients leaving: they must not pile up behind
    its head (each holds its stream, body and all)."""
    q = FlowQueues[str](policy({0: BandLimits(max_wait_s=1.0)}))
    entries: list[Entry[str]] = []
    for i in range(2_000):
        now = i * 0.1
        entry = queued(q, f"r{i}", now=now)
        entries.append(entry)
        if i % 3 == 0:
            assert q.remove(entry)  # its client went away
        q.expire(now)
    live = q.queued(M)
    assert 0 < live <= 10
    heap = q._models[M][0].flows["f"].heap
    assert len(heap) <= 2 * live + 16, f"{len(heap)} heap items for {live} queued requests"
    expected = [e.payload for e in entries if e.queued]
    assert len(expected) == live and drain(q) == expected
