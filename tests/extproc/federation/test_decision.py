"""The forward decision, egress budgets, peer health and trust of hop/tenant headers (all in memory)."""

from __future__ import annotations

from typing import Any

import pytest

from contracts.digest import Digest, block_digests, chain_seed
from contracts.epp import TENANT_HEADER
from contracts.federation import HOP_HEADER, PEER_HEADER, SALTED_HEADER, ModelSummary, Report
from extproc.federation.budget import EgressBudget, TokenBucket
from extproc.federation.decision import BUDGET, FORWARD, HOP, NO_GAIN, NO_PEER, SHORT, queue_wait
from extproc.federation.health import Outcome, PeerHealth, outcome_of
from extproc.federation.links import parse_federation
from extproc.federation.peers import Federation
from extproc.federation.summary import build_bits, sampled, sizing
from extproc.federation.trust import CLIENT, Inbound, inbound

BS = 16
SEED = chain_seed("m")


def link(name: str, rtt_ms: float = 20.0, **kw: Any) -> dict[str, Any]:
    return {
        "cluster": name,
        "ingress": "127.0.0.1:1",
        "service": "127.0.0.1:2",
        "identity": f"spiffe://kvgate.local/federation-{name}",
        "rtt_ms": rtt_ms,
        "egress_requests_per_s": kw.get("rps", 100),
        "egress_bytes_per_s": kw.get("bps", 1e9),
    }


def fed(*links: dict[str, Any], **kw: Any) -> Federation:
    # 1 ms of prefill per token: a 16-token block saves 16 ms
    return Federation(
        parse_federation(
            {"cluster": "a", "prefill_s_per_token": 0.001, "margin_s": 0.01, "links": list(links), **kw}
        )
    )


def chain(blocks: int, start: int = 0) -> list[Digest]:
    return block_digests(SEED, list(range(start, start + blocks * BS)), BS)


def report(
    cluster: str, held: list[Digest], wait_s: float = 0.0, block_size: int = BS, ttl_s: float = 3.0
) -> Report:
    size, k = sizing(len(held))
    s = ModelSummary("m", block_size, k, len(held), build_bits(sampled(held), size, k), wait_s, 2)
    return Report(cluster, 0.0, ttl_s, [s])


def test_long_prefix_held_by_a_peer_is_forwarded() -> None:
    f = fed(link("b"))
    c = chain(64)
    assert f.received(report("b", c), now=0.0)
    v = f.decide("m", c, local_lead=0, block_size=BS, body_bytes=1000, inbound=CLIENT, now=0.1)
    # saving 64 x 16 x 1 ms = 1.024 s > 20 ms rtt + 10 ms margin
    assert v.reason == FORWARD and v.peer is not None and v.peer.cluster == "b" and v.lead == 64
    assert v.net_s == pytest.approx(1.024 - 0.02 - 0.01)


@pytest.mark.parametrize(
    ("peer_blocks", "local_lead", "rtt_ms", "wait_s", "reason"),
    [
        (2, 0, 20, 0.0, SHORT),  # under min_blocks
        (64, 64, 20, 0.0, SHORT),  # local holds as much
        (8, 0, 200, 0.0, NO_GAIN),  # 128 ms saved < 200 ms rtt
        (8, 0, 20, 0.2, NO_GAIN),  # the peer's queue eats the gain
        (8, 0, 20, 0.0, FORWARD),  # 128 ms > 30 ms
        (64, 60, 20, 0.0, FORWARD),  # 4 blocks more: 64 ms > 30 ms
        (64, 63, 20, 0.0, NO_GAIN),  # 1 block more: 16 ms < 30 ms
        (63, 0, 20, 0.0, FORWARD),  # sampled: lead 32 (a lower bound), 512 ms
    ],
)
def test_the_inequality(peer_blocks: int, local_lead: int, rtt_ms: float, wait_s: float, reason: str) -> None:
    f = fed(link("b", rtt_ms))
    c = chain(64)
    f.received(report("b", c[:peer_blocks], wait_s), now=0.0)
    assert f.decide("m", c, local_lead, BS, 100, CLIENT, now=0.0).reason == reason


def test_a_published_queue_wait_drains_with_the_summarys_age() -> None:
    """The peer's wait at ``now`` is ``max(0, published - (now - arrival))``: its backlog drains one second
    of wait per second (README.md, "The decision"). 8 blocks save 128 ms against 20 ms rtt, 10 ms margin
    and a published 200 ms wait: local on arrival, still at 100 ms of age (28 - 30 ms), forwarded at
    150 ms (net 48 ms); a new summary publishing the same wait starts again from it."""
    f = fed(link("b"))
    c = chain(8)
    f.received(report("b", c, wait_s=0.2), now=10.0)
    assert f.decide("m", c, 0, BS, 100, CLIENT, now=10.0).reason == NO_GAIN
    assert f.decide("m", c, 0, BS, 100, CLIENT, now=10.1).reason == NO_GAIN
    v = f.decide("m", c, 0, BS, 100, CLIENT, now=10.15)
    assert v.reason == FORWARD and v.net_s == pytest.approx(0.128 - 0.02 - 0.05 - 0.01)
    f.received(report("b", c, wait_s=0.2), now=10.2)
    assert f.decide("m", c, 0, BS, 100, CLIENT, now=10.2).reason == NO_GAIN
    # Never below 0: an old wait adds nothing, and the TTL (3 s) still ends the summary.
    assert f.decide("m", c, 0, BS, 100, CLIENT, now=12.0).net_s == pytest.approx(0.128 - 0.02 - 0.01)
    assert f.decide("m", c, 0, BS, 100, CLIENT, now=13.3).reason == NO_PEER
    assert queue_wait(report("b", c, wait_s=0.2).models[0], -1.0) == 0.2  # a clock step back: no growth


def test_the_best_net_gain_wins_and_budget_falls_to_the_next() -> None:
    f = fed(link("b", 20, rps=1), link("c", 60))
    c = chain(64)
    f.received(report("b", c), now=0.0)
    f.received(report("c", c), now=0.0)
    assert f.decide("m", c, 0, BS, 10, CLIENT, now=0.0).peer.cluster == "b"  # type: ignore[union-attr]
    # b's one request per second is spent: c next
    assert f.decide("m", c, 0, BS, 10, CLIENT, now=0.1).peer.cluster == "c"  # type: ignore[union-attr]
    assert f.decide("m", c, 0, BS, 10, CLIENT, now=1.2).peer.cluster == "b"  # type: ignore[union-attr]


def test_no_budget_stays_local() -> None:
    f = fed(link("b", rps=0))
    c = chain(64)
    f.received(report("b", c), now=0.0)
    assert f.decide("m", c, 0, BS, 10, CLIENT, now=0.0).reason == BUDGET


def test_stale_or_missing_or_mismatched_summaries_are_ignored() -> None:
    f = fed(link("b"), ttl_s=2.0)
    c = chain(64)
    assert f.decide("m", c, 0, BS, 10, CLIENT, now=0.0).reason == NO_PEER
    f.received(report("b", c), now=0.0)
    assert f.decide("m", c, 0, BS, 10, CLIENT, now=1.9).reason == FORWARD
    assert f.decide("m", c, 0, BS, 10, CLIENT, now=2.1).reason == NO_PEER  # older than our TTL
    f.received(report("b", c, ttl_s=0.5), now=3.0)
    assert f.decide("m", c, 0, BS, 10, CLIENT, now=3.6).reason == NO_PEER  # older than its TTL
    f.received(report("b", c, block_size=32), now=4.0)
    assert f.decide("m", c, 0, BS, 10, CLIENT, now=4.0).reason == NO_PEER
    assert not f.received(report("zz", c), now=4.0)  # not a linked cluster
    assert f.decide("other-model", c, 0, BS, 10, CLIENT, now=4.0).reason == NO_PEER


def test_a_failing_peer_is_skipped_then_tried_again() -> None:
    f = fed(link("b"), down_base_s=1.0, down_max_s=4.0)
    c = chain(64)
    f.received(report("b", c, ttl_s=100), now=0.0)
    f.observe("b", Outcome.STATUS, now=0.0)
    assert f.decide("m", c, 0, BS, 10, CLIENT, now=0.5).reason == NO_PEER
    assert f.decide("m", c, 0, BS, 10, CLIENT, now=1.0).reason == FORWARD
    f.observe("b", Outcome.UNREACHABLE, now=1.0)
    f.observe("b", Outcome.SLOW, now=1.0)  # third in a row: 4 s (capped)
    assert not f.up("b", 4.9) and f.up("b", 5.0)
    f.observe("b", Outcome.OK, now=5.0)
    f.observe("b", Outcome.STATUS, now=5.0)
    assert f.up("b", 6.0)  # the count restarted after the success


def test_a_forwarded_request_is_never_forwarded_again() -> None:
    f = fed(link("b"))
    c = chain(64)
    f.received(report("b", c), now=0.0)
    came = inbound({PEER_HEADER: "spiffe://kvgate.local/federation-b"}, f.links)
    assert came.forwarded and came.forwarded_by == "b"
    assert f.decide("m", c, 0, BS, 10, came, now=0.0).reason == HOP


@pytest.mark.parametrize(
    "headers",
    [
        {HOP_HEADER: "b", TENANT_HEADER: "acme"},  # a client forging both
        {PEER_HEADER: "spiffe://kvgate.local/client-x", HOP_HEADER: "b", TENANT_HEADER: "acme"},
        {PEER_HEADER: "", HOP_HEADER: "b"},
    ],
)
def test_forged_hop_and_tenant_headers_count_for_nothing(headers: dict[str, str]) -> None:
    """Nothing but this: a request with the hop header is never forwarded (again)."""
    f = fed(link("b"))
    came = inbound(headers, f.links)
    assert came == Inbound(hop=True) and not came.forwarded and came.tenant is None and not came.salted
    assert came.final and not came.federated


def test_a_federation_identity_no_link_names_is_unlinked_and_final() -> None:
    f = fed(link("b"))
    uri = "spiffe://kvgate.local/federation-c"
    came = inbound({PEER_HEADER: uri, TENANT_HEADER: "acme", SALTED_HEADER: "1"}, f.links)
    assert came == Inbound(unlinked=uri) and came.final and came.federated and not came.forwarded


def test_the_tenant_is_believed_only_from_a_linked_identity() -> None:
    f = fed(link("b"))
    came = inbound({PEER_HEADER: "spiffe://kvgate.local/federation-b", TENANT_HEADER: "acme"}, f.links)
    assert came.tenant == "acme"


def test_worth_hashing_prefilters_short_prompts() -> None:
    f = fed(link("b", 50), link("c", 20))
    assert not f.worth_hashing(prompt_blocks=1, local_lead=0, block_size=BS)  # under min_blocks
    assert not f.worth_hashing(prompt_blocks=4, local_lead=3, block_size=BS)  # 16 ms < 20 ms + 10 ms
    assert f.worth_hashing(prompt_blocks=4, local_lead=2, block_size=BS)  # 32 ms > 30 ms
    assert f.worth_hashing(prompt_blocks=64, local_lead=0, block_size=BS)
    assert not fed().worth_hashing(64, 0, BS)


def test_status_reports_age_size_and_egress() -> None:
    f = fed(link("b"))
    c = chain(64)
    f.received(report("b", c, wait_s=0.25), now=1.0, size_bytes=321)
    f.decide("m", c, 0, BS, 1000, CLIENT, now=1.5)
    (s,) = f.status(now=2.0)
    assert s.queue_wait_s == 0.25  # the wait its summary published
    assert (s.cluster, s.summary_age_s, s.summary_bytes, s.fresh, s.up) == ("b", 1.0, 321, True, True)
    assert s.summary_entries == 64  # as the report says
    assert (s.egress_requests, s.egress_bytes) == (1, 1000)


def test_token_bucket() -> None:
    b = TokenBucket(2.0, now=0.0)
    assert b.take(2, 0.0) and not b.take(1, 0.0) and b.take(1, 0.5)
    assert not TokenBucket(0.0, 0.0).take(0, 0.0)
    e = EgressBudget(10, 100, now=0.0)  # bytes bank at least 1 MiB
    assert e.take(2_000_000, 0.0) is False and e.take(1000, 0.0) and e.requests == 1 and e.bytes == 1000


@pytest.mark.parametrize(
    ("status", "first_byte_s", "outcome"),
    [
        (None, None, Outcome.UNREACHABLE),
        (503, 0.1, Outcome.STATUS),
        (200, 11.0, Outcome.SLOW),
        (200, 0.1, Outcome.OK),
        (429, 0.1, Outcome.OK),
    ],
)
def test_outcome_of(status: int | None, first_byte_s: float | None, outcome: Outcome) -> None:
    assert outcome_of(status, first_byte_s, slow_s=10.0) is outcome


def test_a_slow_whole_answer_or_a_client_that_left_says_nothing_bad_of_the_peer() -> None:
    """A non-streamed answer's first byte is its last (the whole generation): never ``slow``; status 0
    (the client left first): no outcome at all."""
    assert outcome_of(200, 60.0, slow_s=10.0, streamed=False) is Outcome.OK
    assert outcome_of(503, 60.0, slow_s=10.0, streamed=False) is Outcome.STATUS
    assert outcome_of(200, 60.0, slow_s=10.0, streamed=True) is Outcome.SLOW
    assert outcome_of(0, None, slow_s=10.0) is None
    assert outcome_of(0, 60.0, slow_s=10.0, streamed=True) is None


def test_peer_health_backoff_doubles_and_caps() -> None:
    h = PeerHealth(1.0, 3.0)
    for expected in (1.0, 2.0, 3.0, 3.0):
        h.observe(Outcome.STATUS, now=0.0)
        assert h.down_until == expected
