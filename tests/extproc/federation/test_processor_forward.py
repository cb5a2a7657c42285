"""The stream processor with federation, in memory: a long prompt whose prefix only a peer holds goes to
the peer's ingress first (the local pick as its fallback) with the hop header; a short one, one from a
linked peer, or one whose peer summary is missing stays local; a client's forged hop header and peer
identity change nothing; a request served here is noted for this cluster's summary."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from contracts.digest import Digest
from contracts.epp import EXTPROC_ATTRIBUTES, SUBSET_KEY, SUBSET_NS, UPSTREAM_HEADER
from contracts.events import EndpointId
from contracts.federation import FORWARD_STREAMED, HOP_HEADER, REFUSED_HEADER, ModelSummary, Report
from engines.endpoint import Endpoint
from extproc.federation.forwarding import PEER_ATTRIBUTE, Forwarder
from extproc.federation.links import parse_federation
from extproc.federation.peers import Federation
from extproc.federation.summary import SummaryBuilder, build_bits, lead, sampled, sizing
from extproc.fleet import Fleet
from extproc.index.approximate import ApproximateIndex
from extproc.models.registry import ModelRegistry
from extproc.processor import ProcessorConfig, StreamProcessor
from extproc.routing.router import Router, RoutingPolicy
from extproc.routing.timeouts import FIRST_BYTE_TIMEOUT_HEADER, REQUEST_TIMEOUT_HEADER
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile
from tests.extproc.test_processor import body, error, headers, metadata, reply, response_headers

MODEL = "m"
LOCAL = "10.0.0.1:8000"
INGRESS_B = "10.9.0.1:10443"
LONG = " ".join(f"w{i}" for i in range(3000))  # ~1,000 blocks of 16 bytes (byte fallback)
SHORT = "hello there"
B_ID = "spiffe://kvgate.local/federation-b"


def router() -> Router:
    return Router(
        Fleet([Endpoint(EndpointId("e1"), LOCAL, frozenset({MODEL}), "vllm")]),
        ModelRegistry([]),
        ApproximateIndex(),
        RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16),
        rng=random.Random(0),
    )


def forwarder(**kw: Any) -> Forwarder:
    link = {
        "cluster": "b",
        "ingress": INGRESS_B,
        "service": "10.9.0.1:9500",
        "identity": B_ID,
        "rtt_ms": 20,
        "egress_requests_per_s": 100,
        "egress_bytes_per_s": 1e9,
    }
    config = parse_federation({"cluster": "a", "links": [link], "prefill_s_per_token": 0.0002, **kw})
    return Forwarder(Federation(config), SummaryBuilder())


def request(prompt: str) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 5})


def chain_of(prompt: str) -> list[Digest]:
    """The prompt's whole chain as a gateway of the same policy computes it (routed once, recorded)."""
    proc = StreamProcessor(router(), ProcessorConfig(max_body_bytes=1 << 20), lambda: 1.0)
    proc.handle(headers("/v1/completions"))
    proc.handle(body(request(prompt)))
    proc.after_send()
    assert proc.decision is not None
    return list(proc.decision.digests)


def warm_in_b(fwd: Forwarder, digests: list[Digest], now: float = 1000.0) -> None:
    entries = sampled(digests)
    size, k = sizing(len(entries))
    summary = ModelSummary(MODEL, 16, k, len(entries), build_bits(entries, size, k), 0.0, 1)
    assert lead(summary, digests) > 0
    fwd.federation.received(Report("b", 0.0, 3.0, [summary]), now)


def send(
    fwd: Forwarder, prompt: str, *, peer_uri: str | None = None, extra: dict[str, str] | None = None
) -> tuple[StreamProcessor, Any]:
    proc = StreamProcessor(router(), ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0, federation=fwd)
    msg = headers("/v1/completions", extra=extra)
    if peer_uri is not None:
        msg.attributes[EXTPROC_ATTRIBUTES].fields[PEER_ATTRIBUTE].string_value = peer_uri
    assert proc.handle(msg) == []
    out = reply(proc.handle(body(request(prompt))))
    proc.after_send()
    return proc, out


@pytest.fixture(scope="module")
def long_chain() -> list[Digest]:
    return chain_of(LONG)


def test_a_long_prefix_warm_only_in_the_peer_is_forwarded(long_chain: list[Digest]) -> None:
    fwd = forwarder()
    warm_in_b(fwd, long_chain)
    proc, out = send(fwd, LONG)
    assert out.destination == [INGRESS_B, LOCAL]  # the peer first, the local pick as the fallback
    assert out.lb["x-gateway-destination-endpoint"] == f"{INGRESS_B},{LOCAL}"
    assert out.lb["x-kvgate-destination-primary"] == LOCAL  # plain ORIGINAL_DST configs stay local
    assert out.set_headers[HOP_HEADER] == "a"
    assert proc.forward is not None and proc.forward.peer == "b"
    assert fwd.decisions["forward"] == 1 and fwd.forwards["b"] == 1
    assert len(fwd.builder) == 0  # not noted: this cluster computes nothing of it
    # not streamed: each try bounded (a hung peer falls back to the local pick after forward_first_byte_s,
    # 60 s, not request_s), the whole request_s more, so the local pick keeps a full try
    assert out.set_headers[FIRST_BYTE_TIMEOUT_HEADER] == "60000"
    assert out.set_headers[REQUEST_TIMEOUT_HEADER] == "1860000"
    assert FORWARD_STREAMED not in out.decision  # its first byte is its last: never judged slow
    proc.close()


@pytest.mark.parametrize(("bound", "per_try", "whole"), [(5, "5000", "1805000"), (0, "1800000", "3600000")])
def test_a_hung_peer_holds_a_non_streamed_forward_at_most_forward_first_byte_s(
    long_chain: list[Digest], bound: float, per_try: str, whole: str
) -> None:
    """A peer that accepts the connection and never answers: the forwarded try ends at the federation's
    ``forward_first_byte_s`` (``0``: ``request_s``, 30 minutes) and the local pick serves the request."""
    fwd = forwarder(forward_first_byte_s=bound)
    warm_in_b(fwd, long_chain)
    proc, out = send(fwd, LONG)
    assert out.destination == [INGRESS_B, LOCAL]
    assert out.set_headers[FIRST_BYTE_TIMEOUT_HEADER] == per_try
    assert out.set_headers[REQUEST_TIMEOUT_HEADER] == whole
    proc.close()


def test_a_local_request_keeps_request_s_alone() -> None:
    fwd = forwarder(forward_first_byte_s=5)
    proc, out = send(fwd, SHORT)
    assert out.destination == [LOCAL]
    assert FIRST_BYTE_TIMEOUT_HEADER not in out.set_headers
    assert out.set_headers[REQUEST_TIMEOUT_HEADER] == "1800000"
    proc.close()


def test_a_streamed_forward_is_marked_for_the_peers_health(long_chain: list[Digest]) -> None:
    fwd = forwarder()
    warm_in_b(fwd, long_chain)
    proc = StreamProcessor(router(), ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0, federation=fwd)
    proc.handle(headers("/v1/completions"))
    payload = orjson.dumps({"model": MODEL, "prompt": LONG, "max_tokens": 5, "stream": True})
    out = reply(proc.handle(body(payload)))
    assert out.destination == [INGRESS_B, LOCAL]
    assert out.decision[FORWARD_STREAMED] == "1"
    proc.close()


def test_a_forward_served_by_the_peer_is_no_unknown_address(
    long_chain: list[Digest], caplog: pytest.LogCaptureFixture
) -> None:
    """Envoy reads back the peer's ingress as the served host: not a fleet endpoint, no bookkeeping
    moves and nothing is logged as an unknown address."""
    fwd = forwarder()
    warm_in_b(fwd, long_chain)
    proc, _ = send(fwd, LONG)
    assert proc.decision is not None
    before = proc.decision.served
    with caplog.at_level("WARNING"):
        proc.handle(response_headers(extra={UPSTREAM_HEADER: INGRESS_B}))
    assert proc.decision.served is before
    assert "unknown address" not in caplog.text
    proc.close()


def test_a_short_request_stays_local_and_is_noted() -> None:
    fwd = forwarder()
    warm_in_b(fwd, chain_of(LONG))
    _, out = send(fwd, SHORT)
    assert out.destination == [LOCAL] and HOP_HEADER not in out.set_headers
    assert fwd.decisions["short"] == 1


def test_an_unshared_long_request_stays_local_and_is_noted(long_chain: list[Digest]) -> None:
    fwd = forwarder()
    warm_in_b(fwd, long_chain)
    other = " ".join(f"z{i}" for i in range(3000))
    _, out = send(fwd, other)
    assert out.destination == [LOCAL]
    assert fwd.decisions["short"] == 1  # the peer's lead is 0
    assert len(fwd.builder) > 0  # this cluster now holds it: in the next summary


def test_a_stream_closed_before_after_send_is_still_noted() -> None:
    """Envoy may end the stream once the answer is out, before the shell resumes to call after_send:
    close does that bookkeeping (a flake of the federation benchmark's warm-up under load)."""
    fwd = forwarder()
    proc = StreamProcessor(router(), ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0, federation=fwd)
    proc.handle(headers("/v1/completions"))
    reply(proc.handle(body(request(" ".join(f"y{i}" for i in range(300))))))
    proc.close()
    assert proc.decision is not None and proc.decision.recorded
    assert len(fwd.builder) > 0


def test_a_request_from_the_linked_peer_is_never_forwarded_again(long_chain: list[Digest]) -> None:
    fwd = forwarder()
    warm_in_b(fwd, long_chain)
    _, out = send(fwd, LONG, peer_uri=B_ID, extra={HOP_HEADER: "b"})
    assert out.destination == [LOCAL]
    assert fwd.decisions == {"hop": 1}


def test_a_forged_identity_header_has_no_effect(long_chain: list[Digest]) -> None:
    fwd = forwarder()
    warm_in_b(fwd, long_chain)
    extra = {"x-kvgate-federation-peer": B_ID}
    _, out = send(fwd, LONG, peer_uri="spiffe://kvgate.local/client-mallory", extra=extra)
    assert out.destination == [INGRESS_B, LOCAL] and out.set_headers[HOP_HEADER] == "a"


@pytest.mark.parametrize("peer_uri", [None, "spiffe://kvgate.local/client-mallory"])
def test_a_request_with_the_hop_header_is_never_forwarded(
    long_chain: list[Digest], peer_uri: str | None
) -> None:
    """Only a federation listener lets the hop header through (the public one strips it): whoever sent
    it, the request stays here (its tenant and salted flag still count for nothing)."""
    fwd = forwarder()
    warm_in_b(fwd, long_chain)
    _, out = send(fwd, LONG, peer_uri=peer_uri, extra={HOP_HEADER: "b", "x-kvgate-federation-peer": B_ID})
    assert out.destination == [LOCAL] and HOP_HEADER not in out.set_headers
    assert fwd.decisions == {"hop": 1}


def test_a_federation_identity_no_link_names_is_refused_never_forwarded(long_chain: list[Digest]) -> None:
    """Without [auth] too: a cluster whose link was removed gets 401 ``federation_untrusted`` with the
    refusal header (its Envoy falls back to its local pick), never a forward on to a third cluster."""
    fwd = forwarder()
    warm_in_b(fwd, long_chain)
    proc = StreamProcessor(router(), ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0, federation=fwd)
    msg = headers("/v1/completions", extra={HOP_HEADER: "c"})
    msg.attributes[EXTPROC_ATTRIBUTES].fields[
        PEER_ATTRIBUTE
    ].string_value = "spiffe://kvgate.local/federation-c"
    status, err, hs = error(proc.handle(msg))
    assert (status, err["code"]) == (401, "federation_untrusted")
    assert hs[REFUSED_HEADER] == "federation_untrusted"
    assert fwd.forwards == {}


def test_a_stale_summary_keeps_the_request_local(long_chain: list[Digest]) -> None:
    fwd = forwarder()
    warm_in_b(fwd, long_chain, now=990.0)  # 10 s before the processor's clock: older than the 3 s TTL
    _, out = send(fwd, LONG)
    assert out.destination == [LOCAL] and fwd.decisions["no_peer"] == 1


def test_without_federation_nothing_changes() -> None:
    proc = StreamProcessor(router(), ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0)
    proc.handle(headers("/v1/completions", extra={HOP_HEADER: "b"}))
    out = reply(proc.handle(body(request(LONG))))
    assert out.destination == [LOCAL] and HOP_HEADER not in out.set_headers


@pytest.mark.parametrize("subset", [[LOCAL], ["10.0.0.99:8000"]])
def test_a_subset_hint_without_the_peer_keeps_the_request_local(
    long_chain: list[Digest], subset: list[str]
) -> None:
    """The Endpoint Picker Protocol's subset hint: every endpoint picked comes from its list. A peer's
    ingress the data plane did not list is never put first (the request stays local, or is refused 503
    when nothing local is in the hint either)."""
    fwd = forwarder()
    warm_in_b(fwd, long_chain)
    proc = StreamProcessor(router(), ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0, federation=fwd)
    meta = metadata(**{SUBSET_NS: {SUBSET_KEY: subset}})
    assert proc.handle(headers("/v1/completions", meta=meta)) == []
    replies = proc.handle(body(request(LONG)))
    if subset == [LOCAL]:
        out = reply(replies)
        assert out.destination == [LOCAL] and HOP_HEADER not in out.set_headers
        assert proc.forward is None and fwd.decisions == {"no_peer": 1}
    else:
        assert error(replies)[0] == 503
    proc.close()


def test_a_subset_hint_naming_the_peer_allows_the_forward(long_chain: list[Digest]) -> None:
    fwd = forwarder()
    warm_in_b(fwd, long_chain)
    proc = StreamProcessor(router(), ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0, federation=fwd)
    meta = metadata(**{SUBSET_NS: {SUBSET_KEY: [INGRESS_B, LOCAL]}})
    assert proc.handle(headers("/v1/completions", meta=meta)) == []
    out = reply(proc.handle(body(request(LONG))))
    assert out.destination == [INGRESS_B, LOCAL]
    proc.close()
