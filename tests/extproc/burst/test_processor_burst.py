"""Burst inside the stream state machine, in memory (a real Router, Fleet and FlowControl, a fixed
clock): what goes to the hosted endpoint, what it carries, and what stays local."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest

from extproc.burst.core import BURST_HEADER, Burster, parse_burst
from extproc.flow.control import FlowControl
from extproc.flow.policy import FlowPolicy
from extproc.models.registry import ModelAssets
from extproc.processor import ProcessorConfig, StreamProcessor
from extproc.routing.router import Router
from tests.extproc.flow.test_processor_flow import POLICY, fill, send, teach
from tests.extproc.test_processor import (
    DESTINATION,
    LIMIT,
    MODEL,
    clock,
    error,
    make_router,
    reply,
    set_headers,
)

HOSTED = "hosted-model"
CLIENT = {"authorization": "Bearer client", "x-api-key": "k", "cookie": "c=1"}


@pytest.fixture(scope="module")
def smol(model_dir: str) -> ModelAssets:
    return ModelAssets.load(MODEL, Path(model_dir), max_model_len=1 << 20)


@pytest.fixture
def router(smol: ModelAssets) -> Router:
    return make_router(smol)


def burster() -> Burster:
    raw = {"name": "hosted", "host": "localhost", "api_key_file": "/k", "models": {MODEL: HOSTED}}
    return Burster(parse_burst([raw]))


def make(router: Router, control: FlowControl[StreamProcessor], b: Burster) -> StreamProcessor:
    config = ProcessorConfig(max_body_bytes=LIMIT, hold_timeout_s=600.0, burst=b)
    return StreamProcessor(router, config, clock, None, control)


def burst_reply(out: list[Any]) -> tuple[dict[str, str], list[str], dict[str, Any]]:
    first, *rest = out
    assert first.WhichOneof("response") == "request_headers", out
    mutation = first.request_headers.response.header_mutation
    assert first.request_headers.response.clear_route_cache
    body = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in rest)
    return set_headers(mutation), list(mutation.remove_headers), orjson.loads(body)


def policy(per_minute: float) -> FlowPolicy:
    return dataclasses.replace(POLICY, burst_per_minute=per_minute)


def test_with_room_nothing_bursts(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(policy(10))
    b = burster()
    proc = make(router, control, b)
    routed = reply(send(proc, CLIENT))
    assert BURST_HEADER not in routed.set_headers and proc.decision is not None
    assert b.counts == {}


def test_a_request_that_would_wait_bursts_with_the_hosted_name_and_no_client_credential(
    router: Router,
) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(policy(2))
    b = burster()
    fill(router, control)
    load = [s.load for s in router.fleet]
    sent = []
    for _ in range(2):
        proc = make(router, control, b)
        hs, removed, doc = burst_reply(send(proc, CLIENT))
        assert hs[BURST_HEADER] == "hosted" and DESTINATION not in hs
        assert {"authorization", "x-api-key", "cookie", "proxy-authorization", "api-key"} <= set(removed)
        assert doc["model"] == HOSTED and int(hs["content-length"]) == len(orjson.dumps(doc))
        assert proc.held is None and proc.decision is None
        sent.append(proc)
    assert [s.load for s in router.fleet] == load  # no local engine was charged
    third = make(router, control, b)  # the budget is spent: queued as without burst
    send(third, CLIENT)
    assert third.held is not None and len(control.queues) == 1
    assert b.counts == {("hosted", "sent"): 2, ("hosted", "no_budget"): 1}


def test_no_budget_in_policy_means_no_burst(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(policy(0))
    b = burster()
    fill(router, control)
    proc = make(router, control, b)
    send(proc)
    assert proc.held is not None and b.counts == {}


def test_a_deadline_bursts_only_when_the_local_fleet_is_predicted_to_miss_it(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(policy(10))
    b = burster()
    for state in router.fleet:
        if MODEL in state.endpoint.models:
            teach(router, state.id, seconds_per_token=0.01)
    fill(router, control)
    late = make(router, control, b)  # predicted late even routed now: burst, not 429 slo_unattainable
    hs, _, _ = burst_reply(send(late, {"x-kvgate-deadline-ms": "300"}, content="word " * 400))
    assert hs[BURST_HEADER] == "hosted" and late.refused is None
    waits = make(router, control, b)  # the fleet may make it: it waits locally
    send(waits, {"x-kvgate-deadline-ms": "60000"}, content="word " * 400)
    assert waits.held is not None
    assert b.counts == {("hosted", "sent"): 1}


def test_a_model_without_a_burst_endpoint_is_refused_as_before(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(policy(10))
    raw = {"name": "other", "host": "localhost", "api_key_file": "/k", "models": {"elsewhere": "x"}}
    b = Burster(parse_burst([raw]))
    for state in router.fleet:
        if MODEL in state.endpoint.models:
            teach(router, state.id, seconds_per_token=0.01)
    fill(router, control)
    status, err, _ = error(
        send(make(router, control, b), {"x-kvgate-deadline-ms": "300"}, content="word " * 400)
    )
    assert (status, err["code"]) == (429, "slo_unattainable")


def test_only_chat_completions_and_embeddings_burst(router: Router) -> None:
    """A Responses request (its hosted id would be unknown to a later local previous_response_id) and
    vLLM's score / rerank (a hosted endpoint does not serve them) are answered as without burst."""
    from tests.extproc.test_processor import body, headers

    control: FlowControl[StreamProcessor] = FlowControl(policy(100))
    b = burster()
    fill(router, control)
    cases = (
        ("/v1/responses", {"input": "next", "previous_response_id": "resp_1"}, False),
        ("/v1/responses", {"input": "first"}, False),
        ("/v1/score", {"text_1": "a", "text_2": "b"}, False),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}, False),
        ("/v1/completions", {"prompt": "once"}, True),
        ("/v1/embeddings", {"input": "x"}, True),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, True),
    )
    for path, doc, bursts in cases:
        proc = make(router, control, b)
        assert proc.handle(headers(path)) == []
        out = proc.handle(body(orjson.dumps({"model": MODEL, **doc})))
        burst = bool(out) and out[0].WhichOneof("response") == "request_headers"
        assert burst is bursts, (path, out)
        if bursts:
            _, _, sent = burst_reply(out)
            assert sent["model"] == HOSTED and sent.get("prompt", "once") == "once"
    assert b.counts == {("hosted", "sent"): 3}


def test_fields_that_bill_or_reach_the_gateways_account_are_dropped(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(policy(10))
    b = burster()
    fill(router, control)
    proc = make(router, control, b)
    _, _, doc = burst_reply(
        send(
            proc,
            CLIENT,
            service_tier="priority",
            store=True,
            priority=-100,
            cache_salt="mine",
            conversation="conv_other",
            metadata={"k": "v"},
            user="u",
            safety_identifier="s",
            prompt_cache_key="p",
            temperature=0.5,
        )
    )
    assert doc["store"] is False and doc["temperature"] == 0.5 and doc["model"] == HOSTED
    for dropped in (
        "service_tier",
        "priority",
        "cache_salt",
        "conversation",
        "metadata",
        "user",
        "safety_identifier",
        "prompt_cache_key",
    ):
        assert dropped not in doc, dropped


def test_a_tenants_burst_carries_its_tenant_for_envoys_rate_limit_and_access_log(router: Router) -> None:
    """Envoy's per-tenant rate limit is keyed on x-kvgate-tenant: a burst request sets it like a local one
    (the burst route removes it before the hosted endpoint); the access log's tenant is the decision's."""
    from tests.extproc.test_processor import ACME_KEY, make_gate

    control: FlowControl[StreamProcessor] = FlowControl(policy(10))
    b = burster()
    gate = make_gate()
    config = ProcessorConfig(max_body_bytes=LIMIT, hold_timeout_s=600.0, burst=b)
    for _ in range(3):  # the model's three endpoints at their limit, by the tenant's requests
        local = reply(send(StreamProcessor(router, config, clock, gate, control), ACME_KEY))
        assert local.set_headers["x-kvgate-tenant"] == "acme"
    proc = StreamProcessor(router, config, clock, gate, control)
    out = send(proc, ACME_KEY)
    hs, removed, _ = burst_reply(out)
    assert hs[BURST_HEADER] == "hosted" and hs["x-kvgate-tenant"] == "acme" and "authorization" in removed
    decision = out[0].dynamic_metadata.fields["kvgate.decision"].struct_value.fields
    assert decision["tenant"].string_value == "acme"
