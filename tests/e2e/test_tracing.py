"""End to end, traced: client -> real Envoy (its OpenTelemetry tracer) -> ext_proc -> simulated vLLM, all
exporting to a real OTLP/gRPC receiver (:mod:`tests.otlp`) on 127.0.0.1. Checks span names, parentage
(Envoy's span -> the ext_proc's request span -> its phases), that a client's ``traceparent`` keeps its
trace id, and that no prompt, token id or credential is in any attribute."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM
from tests.otlp import Collector, ReceivedSpan

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
#: A marker that must never leave the request body: not in any span, attribute or resource.
PROMPT = "zebra-quartz-marker " * 40
API_KEY = "sk-kvgate-trace-secret-" + "x" * 16
PHASES = {"parse", "render", "tokenize", "digest", "lookup", "schedule"}


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    receiver = Collector().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def traced(collector: Collector, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        replicas=2,
        port=0,
        sim_args=FAST_SIM,
        workdir=tmp_path_factory.mktemp("traced"),
        overlay={"tracing": {"enabled": True, "endpoint": collector.endpoint, "flush_interval_s": 0.2}},
    )
    with Stack(options) as running:
        yield running


def send(stack: Stack, headers: dict[str, str]) -> str:
    """One chat request; its x-request-id."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    got = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {API_KEY}", **headers},
        timeout=30,
    )
    assert got.status_code == 200, got.text
    return got.headers["x-request-id"]


def request_span(spans: list[ReceivedSpan], request_id: str) -> ReceivedSpan | None:
    found = [
        s
        for s in spans
        if s.name == "extproc.request" and s.attributes.get("kvgate.request_id") == request_id
    ]
    return found[0] if found else None


def complete(request_id: str) -> Any:
    """A check that the request's trace arrived: its ext_proc span, its phases and Envoy's spans above it,
    up to the ingress (SERVER) span. Envoy exports each span as it ends (``min_flush_spans = 1``), in
    requests of their own: its ingress span in hand says nothing of the ext_proc call's span between it
    and the ext_proc's, which :func:`check_trace` walks."""

    def check(spans: list[ReceivedSpan]) -> bool:
        req = request_span(spans, request_id)
        if req is None:
            return False
        trace = [s for s in spans if s.trace_id == req.trace_id]
        children = {s.name for s in trace if s.parent == req.span_id}
        above = ancestors(req, {s.span_id: s for s in trace})
        return children >= PHASES and any(s.service == "kvgate-envoy" and s.kind == 2 for s in above)

    return check


def ancestors(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> list[ReceivedSpan]:
    chain = []
    while span.parent in by_id:
        span = by_id[span.parent]
        chain.append(span)
    return chain


def check_trace(collector: Collector, request_id: str) -> list[ReceivedSpan]:
    spans = collector.wait_for(complete(request_id), 30, f"the trace of request {request_id}")
    req = request_span(spans, request_id)
    assert req is not None and req.service == "kvgate-extproc" and req.kind == 2  # SERVER
    trace = [s for s in spans if s.trace_id == req.trace_id]
    by_id = {s.span_id: s for s in trace}
    # The ext_proc's request span hangs under Envoy's: its parent is the span Envoy's ext_proc filter
    # made for the gRPC call, itself under Envoy's ingress span of the request.
    above = ancestors(req, by_id)
    assert above and all(s.service == "kvgate-envoy" for s in above), above
    assert above[-1].kind == 2, above  # Envoy's ingress (SERVER) span
    phases = [s for s in trace if s.parent == req.span_id]
    assert {s.name for s in phases} >= PHASES
    assert req.attributes["kvgate.model"] == MODEL
    assert req.attributes["kvgate.endpoint"].startswith("sim-")
    assert req.attributes["kvgate.prompt_tokens"] > 100
    return trace


def test_envoy_starts_the_trace_and_the_extproc_joins_it(traced: Stack, collector: Collector) -> None:
    request_id = send(traced, {})
    trace = check_trace(collector, request_id)
    roots = [s for s in trace if not s.parent]
    assert len(roots) == 1 and roots[0].service == "kvgate-envoy"


def test_client_traceparent_keeps_its_trace_id(traced: Stack, collector: Collector) -> None:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    request_id = send(traced, {"traceparent": f"00-{trace_id}-{parent}-01"})
    trace = check_trace(collector, request_id)
    assert {s.trace_id for s in trace} == {trace_id}
    envoy_root = [s for s in trace if s.parent == parent]
    assert len(envoy_root) == 1 and envoy_root[0].service == "kvgate-envoy"


def test_a_client_trace_not_sampled_records_nothing(traced: Stack, collector: Collector) -> None:
    unsampled = secrets.token_hex(16)
    send(traced, {"traceparent": f"00-{unsampled}-{secrets.token_hex(8)}-00"})
    check_trace(collector, send(traced, {}))  # a later, sampled request's trace has arrived
    assert not [s for s in collector.snapshot() if s.trace_id == unsampled]


def test_no_prompt_tokens_or_credentials_in_any_attribute(traced: Stack, collector: Collector) -> None:
    request_id = send(traced, {})
    collector.wait_for(complete(request_id), 30, f"the trace of request {request_id}")
    spans = collector.snapshot()
    assert spans
    for span in spans:
        values = [span.name, *span.attributes.items(), *span.resource.items()]
        text = repr(values)
        assert "zebra-quartz" not in text, span
        assert API_KEY not in text and "Bearer" not in text, span
        for value in [*span.attributes.values(), *span.resource.values()]:
            # Token ids would be a list of integers; no attribute is a list of numbers.
            assert not (isinstance(value, list) and value and all(isinstance(v, int) for v in value)), span


@pytest.fixture(scope="module")
def traced_pd(collector: Collector, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A prefill/decode fleet of simulators, every request disaggregated, traced."""
    options = StackOptions(
        prefill=1,
        decode=1,
        port=0,
        sim_args=FAST_SIM,
        workdir=tmp_path_factory.mktemp("traced-pd"),
        disaggregation={"mode": "disaggregated"},
        overlay={"tracing": {"enabled": True, "endpoint": collector.endpoint, "flush_interval_s": 0.2}},
    )
    with Stack(options) as running:
        yield running


def test_the_prefill_handoff_is_a_span_of_the_request(traced_pd: Stack, collector: Collector) -> None:
    request_id = send(traced_pd, {})

    def handed_off(spans: list[ReceivedSpan]) -> bool:
        req = request_span(spans, request_id)
        return req is not None and any(s.name == "handoff.prefill" and s.parent == req.span_id for s in spans)

    spans = collector.wait_for(handed_off, 30, "the handoff span")
    req = request_span(spans, request_id)
    assert req is not None and req.attributes["kvgate.pd.mode"] == "disaggregated"
    assert req.attributes["kvgate.endpoint"].startswith("decode-")
    handoff = next(s for s in spans if s.name == "handoff.prefill" and s.parent == req.span_id)
    assert handoff.kind == 3 and handoff.attributes["kvgate.handoff.outcome"] == "ok"  # CLIENT


def test_kvgate_up_traces_its_agents_too(collector: Collector, tmp_path: Path) -> None:
    """``kvgate up --agents`` hands the overlay's ``[tracing]`` to each agent (its own service name)."""
    options = StackOptions(
        port=0,
        agents=1,
        workdir=tmp_path,
        overlay={"tracing": {"enabled": True, "endpoint": collector.endpoint, "flush_interval_s": 0.2}},
    )
    trace_id = secrets.token_hex(16)
    with Stack(options) as running:
        admin = running.agent_status[0]["admin_port"]
        headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
        assert httpx.post(f"http://127.0.0.1:{admin}/drain", headers=headers, timeout=30).status_code < 500
        spans = collector.wait_for(
            lambda spans: any(s.trace_id == trace_id for s in spans), 30, "the agent's span"
        )
    span = next(s for s in spans if s.trace_id == trace_id)
    assert (span.service, span.name) == ("kvgate-agent", "POST /drain")
