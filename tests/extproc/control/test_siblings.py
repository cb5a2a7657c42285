"""Sibling workers (extproc/control/siblings.py): the codec and merge rules in memory, then two real
buses on a directory sharing decisions and in-flight counts."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import orjson
import pytest

from contracts.digest import Digest
from contracts.errors import ConfigError
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.config import parse_config
from extproc.control.siblings import (
    Learned,
    Loads,
    MessageError,
    Prefill,
    SiblingBus,
    SiblingLoads,
    decode,
    encode_learned,
    encode_loads,
    encode_prefill,
    local_loads,
)
from extproc.disagg.plan import Disaggregator, Handoff
from extproc.disagg.policy import PdSpec
from extproc.fleet import Fleet
from extproc.index.approximate import ApproximateIndex
from extproc.index.working_set import WorkingSet
from extproc.models.registry import ModelRegistry
from extproc.routing.request import Kind, parse_body
from extproc.routing.router import Router, RoutingPolicy
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile
from tests.extproc.disagg.test_plan import endpoint as pd_endpoint
from tests.extproc.disagg.test_plan import make as make_pd
from tests.polling import until

MODEL = "m"
E0, E1 = EndpointId("e0"), EndpointId("e1")


def digests(n: int, tag: int = 0) -> list[Digest]:
    return [Digest(bytes([tag, i % 256]) * 8) for i in range(n)]


def fleet() -> Fleet:
    return Fleet([Endpoint(EndpointId(f"e{i}"), f"127.0.0.{i + 1}:1", frozenset({MODEL})) for i in range(2)])


def router() -> Router:
    """A router routing on request-byte digests (no tokenizer) over two endpoints."""
    return Router(
        fleet(),
        ModelRegistry([]),
        ApproximateIndex(),
        RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16),
        rng=random.Random(0),
        working_set=WorkingSet(20.0, 256),
    )


# --- config -----------------------------------------------------------------------------------------------


def test_workers_and_siblings_dir_are_extproc_keys() -> None:
    assert parse_config({}).extproc.workers == 1 and parse_config({}).extproc.siblings_dir is None
    parsed = parse_config({"extproc": {"workers": 4, "siblings_dir": "/run/kvgate/siblings"}}).extproc
    assert (parsed.workers, parsed.siblings_dir) == (4, "/run/kvgate/siblings")


@pytest.mark.parametrize(
    ("extproc", "message"),
    [
        ({"workers": 0}, "extproc.workers: must be >= 1"),
        ({"workers": "2"}, "extproc.workers: expected int"),
        ({"workers": True}, "extproc.workers: expected int"),
        ({"workers": 1.5}, "extproc.workers: expected int"),
        ({"siblings_dir": ""}, "extproc.siblings_dir"),
        ({"siblings_dir": 3}, "extproc.siblings_dir: expected str"),
    ],
)
def test_bad_workers_settings_are_refused_naming_the_key(extproc: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"extproc": extproc})


# --- codec ------------------------------------------------------------------------------------------------


def test_learned_records_round_trip_and_split_at_the_datagram_limit() -> None:
    records = [(E0, digests(10, 1)), (E1, digests(3, 2)), (E0, digests(40, 3))]
    (one,) = encode_learned("w-0", records)
    assert decode(one) == Learned("w-0", records)
    small = encode_learned("w-0", records, limit=400)  # a 40-digest record cannot fit: its prefix is kept
    assert len(small) > 1 and all(len(d) <= 400 for d in small)
    got = [r for d in small for r in decode(d).records]  # type: ignore[union-attr]
    assert got[:2] == records[:2]
    assert got[2][0] == E0 and 0 < len(got[2][1]) < 40 and got[2][1] == records[2][1][: len(got[2][1])]


def test_loads_snapshots_replace_on_their_first_datagram_only() -> None:
    counts = {EndpointId(f"endpoint-{i}"): (i, 2 * i) for i in range(1, 50)}
    (whole,) = encode_loads("w-1", counts)
    assert decode(whole) == Loads("w-1", True, counts)
    parts = [decode(d) for d in encode_loads("w-1", counts, limit=200)]
    assert len(parts) > 1 and [p.replace for p in parts] == [True] + [False] * (len(parts) - 1)  # type: ignore[union-attr]
    merged: dict[EndpointId, tuple[int, int]] = {}
    for part in parts:
        merged.update(part.counts)  # type: ignore[union-attr]
    assert merged == counts
    assert [decode(d) for d in encode_loads("w-1", {})] == [Loads("w-1", True, {})]  # all zero


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"XXXX\x02\x01a\x01",
        encode_loads("w", {E0: (1, 1)})[0][:-1],  # an endpoint cut short
        encode_learned("w", [(E0, digests(2))])[0][:-3],  # a digest cut short
        b"KVS1\x09\x01a",  # unknown kind
        encode_prefill("w", {E0: 7})[0][:-1],  # a prefill entry cut short
    ],
)
def test_malformed_datagrams_are_message_errors(data: bytes) -> None:
    with pytest.raises(MessageError):
        decode(data)


# --- merge ------------------------------------------------------------------------------------------------


def test_sibling_loads_sum_per_endpoint_and_expire_silent_siblings() -> None:
    loads = SiblingLoads(expire_s=3.0)
    assert loads.apply(Loads("a", True, {E0: (2, 5), E1: (1, 1)}), now=0.0)
    assert not loads.apply(Loads("a", True, {E0: (1, 4)}), now=0.5)  # a snapshot: e1 is 0 now
    assert loads.apply(Loads("b", True, {E0: (3, 3)}), now=1.0)
    assert not loads.apply(Loads("b", False, {E1: (1, 0)}), now=1.0)  # a later datagram of b's snapshot
    assert loads.totals() == {E0: (4, 7), E1: (1, 0)}
    f = fleet()
    loads.write(f)
    e0, e1 = f.get(E0), f.get(E1)
    assert e0 is not None and e1 is not None
    assert (e0.sibling_in_flight, e0.sibling_routed, e1.sibling_in_flight) == (4, 7, 1)
    assert loads.expire(now=3.6) == ["a"] and loads.senders == ["b"]
    loads.write(f)
    assert (e0.sibling_in_flight, e0.sibling_routed) == (3, 3)
    assert loads.expire(now=4.1) == ["b"]
    loads.write(f)
    assert (e0.sibling_in_flight, e0.sibling_routed, e1.sibling_in_flight) == (0, 0, 0)


def test_load_counts_the_siblings_with_and_without_metrics() -> None:
    state = fleet().get(E0)
    assert state is not None
    state.in_flight, state.routed_since_scrape = 1, 1
    state.sibling_in_flight, state.sibling_routed = 3, 2
    assert state.load == 4.0  # open streams here and at the siblings
    state.metrics = EngineMetrics(running=5, waiting=1, kv_usage=0.0, at=0.0)
    assert state.load == 5 + 1 + 1 + 2  # the engine's queue + what this worker and its siblings routed since


def test_local_loads_leave_idle_endpoints_out() -> None:
    f = fleet()
    state = f.get(E1)
    assert state is not None
    state.in_flight = 2
    assert local_loads(f) == {E1: (2, 0)}


def test_decisions_for_endpoints_this_worker_does_not_know_are_skipped(tmp_path: Path) -> None:
    r = router()
    bus = SiblingBus(tmp_path / "s", "w", r)
    bus.learn(Learned("v", [(EndpointId("elsewhere"), digests(4)), (E1, digests(4))]), now=1.0)
    assert r.index.occupancy() == {E1: 4}


def test_worker_names_and_socket_paths_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="worker name"):
        SiblingBus(tmp_path, "../x", router())
    with pytest.raises(ConfigError, match=r"extproc\.siblings_dir"):
        SiblingBus(tmp_path / ("d" * 120), "w", router())


# --- two real buses ---------------------------------------------------------------------------------------


async def test_two_workers_share_decisions_and_in_flight_counts(tmp_path: Path) -> None:
    directory = tmp_path / "sib"
    directory.mkdir(mode=0o700)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # a sibling that went away: its file stays
    dead.bind(str(directory / "dead.sock"))
    dead.close()
    sender, receiver = router(), router()
    buses = [
        SiblingBus(directory, name, r, heartbeat_s=0.05, expire_s=0.3)
        for name, r in (("w-0", sender), ("w-1", receiver))
    ]
    for bus in buses:
        bus.start()
    try:
        await until(lambda: buses[0].loads.senders == ["w-1"] and buses[1].loads.senders == ["w-0"], 5.0)
        request = parse_body(Kind.COMPLETION, orjson.dumps({"model": MODEL, "prompt": "hello " * 200}))
        decision = sender.decide(request, request_id="r", now=1.0)
        sender.commit(decision, 1.0)
        pick = decision.endpoints[0].id
        mirrored = receiver.fleet.get(pick)
        assert mirrored is not None and len(decision.digests) > 4

        def learned() -> bool:
            return receiver.index.match(decision.digests, 1.0).get(pick) == len(decision.digests)

        await until(lambda: learned() and mirrored.sibling_in_flight == 1, 5.0)
        assert mirrored.load == 1.0 and mirrored.in_flight == 0  # the sibling's, not this worker's own
        assert receiver.working_set is not None and receiver.working_set.sizes(1.0) == {
            pick: len(decision.digests)
        }
        sender.finish(decision)
        await until(lambda: mirrored.sibling_in_flight == 0, 5.0)
        assert mirrored.sibling_routed == 1  # routed since the sender's last scrape (it has none)
        await buses[0].aclose()  # the sender stops: its counts expire
        await until(lambda: mirrored.sibling_routed == 0 and buses[1].loads.senders == [], 5.0)
        assert not (directory / "w-0.sock").exists()
        assert sender.listener is None
    finally:
        for bus in buses:
            await bus.aclose()


def test_loads_carry_the_net_routed_count_negative_too() -> None:
    """A worker shares routed minus completed since its scrape: more of its requests ended than it sent
    since is a negative count, which survives the wire (clamped to 32 bits) and lowers the load."""
    f = fleet()
    e0, e1 = f.get(E0), f.get(E1)
    assert e0 is not None and e1 is not None
    e0.routed_since_scrape, e0.completed_since_scrape = 1, 3
    e1.routed_since_scrape, e1.completed_since_scrape = 2, 2  # net 0, nothing open: left out
    assert local_loads(f) == {E0: (0, -2)}
    (data,) = encode_loads("w", local_loads(f))
    assert decode(data) == Loads("w", True, {E0: (0, -2)})
    (data,) = encode_loads("w", {E0: (0, -(2**40)), E1: (0, 2**40)})
    assert decode(data) == Loads("w", True, {E0: (0, -(2**31)), E1: (0, 2**31 - 1)})
    loads = SiblingLoads()
    loads.apply(Loads("a", True, {E0: (0, -2)}), now=0.0)
    loads.apply(Loads("b", True, {E0: (1, 1)}), now=0.0)
    g = fleet()
    loads.write(g)
    mirrored = g.get(E0)
    assert mirrored is not None and (mirrored.sibling_in_flight, mirrored.sibling_routed) == (1, -1)
    mirrored.metrics = EngineMetrics(running=3, waiting=0, kv_usage=0.0, at=0.0)
    assert mirrored.load == 2.0


# --- P/D prefill work -------------------------------------------------------------------------------------


def test_prefill_snapshots_round_trip_split_and_replace_on_their_first_datagram() -> None:
    tokens = {EndpointId(f"prefill-{i}"): 1000 * i for i in range(1, 40)}
    (whole,) = encode_prefill("w-1", tokens)
    assert decode(whole) == Prefill("w-1", True, tokens)
    parts = [decode(d) for d in encode_prefill("w-1", tokens, limit=120)]
    assert len(parts) > 1 and all(isinstance(p, Prefill) for p in parts)
    assert [p.replace for p in parts] == [True] + [False] * (len(parts) - 1)  # type: ignore[union-attr]
    assert [decode(d) for d in encode_prefill("w-1", {})] == [Prefill("w-1", True, {})]  # none queued
    (clamped,) = encode_prefill("w", {E0: 2**40, E1: -5})
    assert decode(clamped) == Prefill("w", True, {E0: 2**32 - 1, E1: 0})
    loads = SiblingLoads(expire_s=3.0)
    loads.apply(Loads("a", True, {}), now=0.0)
    loads.apply_prefill(Prefill("a", True, {E0: 500, E1: 20}), now=0.0)
    loads.apply_prefill(Prefill("a", True, {E0: 300}), now=0.5)  # a snapshot: e1 has none now
    loads.apply(Loads("b", True, {}), now=1.0)
    loads.apply_prefill(Prefill("b", True, {E0: 100}), now=1.0)
    loads.apply_prefill(Prefill("b", False, {E1: 40}), now=1.0)  # a later datagram of b's snapshot
    assert loads.prefill_totals() == {E0: 400, E1: 40}
    assert loads.expire(now=3.6) == ["a"] and loads.prefill_totals() == {E0: 100, E1: 40}
    assert loads.expire(now=4.1) == ["b"] and loads.prefill_totals() == {}


def pd_worker() -> tuple[Router, Disaggregator]:
    """One ext_proc worker's router and P/D planner over two prefill endpoints and one decode endpoint,
    with no ``prefill_profile``: the least-work prefill pick (extproc/disagg/README.md, "The pair")."""
    roles = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))
    return make_pd([pd_endpoint(name, role) for name, role in roles], PdSpec("disaggregated"))


async def test_two_workers_least_work_prefill_picks_count_each_others_queued_prefills(tmp_path: Path) -> None:
    """Worker b has two short prefills running on p1 (more requests in flight there), worker a one long
    prefill on p0 (fewer requests, far more tokens). b's next long prompt goes to p1, the endpoint with
    less prefill work host-wide; without a's report it would have gone to p0, idle as far as b knew."""
    directory = tmp_path / "sib"
    (ra, pa), (rb, pb) = pd_worker(), pd_worker()
    buses = [
        SiblingBus(directory, name, r, prefill=pd, heartbeat_s=0.05, expire_s=0.5)
        for name, r, pd in (("w-a", ra, pa), ("w-b", rb, pb))
    ]
    for bus in buses:
        bus.start()
    try:
        await until(lambda: buses[0].loads.senders == ["w-b"] and buses[1].loads.senders == ["w-a"], 5.0)

        def plan(r: Router, pd: Disaggregator, prompt: str, rid: str, only: str | None = None) -> Handoff:
            req = parse_body(
                Kind.COMPLETION, orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8})
            )
            subset = None if only is None else frozenset({only})
            verdict = pd.plan(r.decide(req, request_id=rid, now=1.0), 1.0, subset=subset)
            assert verdict is not None and verdict.handoff is not None
            return verdict.handoff

        p0, p1 = (pd_endpoint(name, "prefill").address for name in ("p0", "p1"))
        shorts = [plan(rb, pb, f"short question {i} " * 60, f"b{i}", only=p1) for i in range(2)]
        long_a = plan(ra, pa, "".join(f"word{i} " for i in range(1000)), "a0", only=p0)
        queued_b = sum(h.prefill_tokens for h in shorts)
        queued_a = long_a.prefill_tokens
        assert queued_a > queued_b > 0
        await until(lambda: pb.sibling_queued == {EndpointId("p0"): queued_a}, 5.0)
        assert pa.sibling_queued == {EndpointId("p1"): queued_b}  # and a hears b's
        mirrored = rb.fleet.get(EndpointId("p0"))
        assert mirrored is not None
        await until(lambda: mirrored.sibling_in_flight == 1, 5.0)
        cold = plan(rb, pb, "another long document " * 400, "b2")
        assert cold.prefill.id == "p1"
        pb.release(cold)
        # The same pick with a's report left out: p0 looks idle.
        saved, pb.sibling_queued = pb.sibling_queued, {}
        assert plan(rb, pb, "yet another long document " * 400, "b3").prefill.id == "p0"
        pb.sibling_queued = saved
        pa.release(long_a)
        await until(lambda: pb.sibling_queued == {}, 5.0)
        await buses[1].aclose()  # b stops: a forgets b's queued prefills with its loads
        await until(lambda: pa.sibling_queued == {}, 5.0)
    finally:
        for bus in buses:
            await bus.aclose()
