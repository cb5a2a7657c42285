"""The stream state machine with a disaggregating route, in memory: the decision holds the replies while
the prefill half runs (:attr:`StreamProcessor.handoff`), then :meth:`handed_off` routes the decode half,
or the whole request on a failed prefill."""

from __future__ import annotations

import random
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from contracts.epp import CONFORMANCE_HEADER
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.disagg.errors import HandoffFailed
from extproc.disagg.pairing import Pairing
from extproc.disagg.plan import Disaggregator, PdPolicy, PdRoute
from extproc.disagg.policy import PdSpec
from extproc.fleet import Fleet
from extproc.flow.control import TTFT_DEADLINE_UPSTREAM, FlowControl
from extproc.flow.policy import FlowPolicy, ModelSaturation, Objective, Saturation
from extproc.index.approximate import ApproximateIndex
from extproc.models.registry import ModelAssets, ModelRegistry
from extproc.processor import ProcessorConfig, StreamProcessor, serving
from extproc.routing.router import LazyPrompt, Router, RoutingPolicy
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile
from tests.extproc.disagg.test_plan import endpoint as plan_endpoint
from tests.extproc.disagg.test_plan import make as plan_make
from tests.extproc.disagg.test_plan import request as plan_request
from tests.extproc.test_epp_conformance import refused
from tests.extproc.test_processor import SUBSET_KEY, SUBSET_NS, body, headers, metadata, reply

MODEL = "m"
PREFILL, DECODE, PREFILL2 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
LONG = " ".join(f"w{i}" for i in range(3000))  # ~4,000 tokens by the byte fallback


def make(
    spec: PdSpec,
    hold_timeout_s: float | None = 600.0,
    engine: str = "vllm",
    bootstrap: bool = True,
    conformance: bool = False,
    clock: Callable[[], float] = lambda: 1000.0,
    flow: FlowControl[StreamProcessor] | None = None,
    orders: tuple[str | None, str | None] = (None, None),
    decode_role: str = "decode",
) -> tuple[StreamProcessor, Router]:
    """``orders``: the prefill and the decode endpoint's declared priority orders; ``decode_role``: the
    decode endpoint's role (``both`` serves alone too)."""
    port = 8998 if engine == "sglang" and bootstrap else None
    endpoints = [
        Endpoint(
            EndpointId("p"),
            PREFILL,
            frozenset({MODEL}),
            engine,
            role="prefill",
            bootstrap_port=port,
            priority_order=orders[0],
        ),
        Endpoint(
            EndpointId("d"), DECODE, frozenset({MODEL}), engine, role=decode_role, priority_order=orders[1]
        ),
    ]
    if conformance:  # a second prefill endpoint, for the pin to choose between
        endpoints.append(Endpoint(EndpointId("p2"), PREFILL2, frozenset({MODEL}), engine, role="prefill"))
    router = Router(
        Fleet(endpoints),
        ModelRegistry([]),
        ApproximateIndex(),
        RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16),
        rng=random.Random(0),
    )
    route = PdRoute(spec, build_profile(DEFAULT_SCHEDULING))
    pd = Disaggregator(router, PdPolicy(types.MappingProxyType({MODEL: route})), random.Random(0))
    config = ProcessorConfig(max_body_bytes=1 << 20, hold_timeout_s=hold_timeout_s, conformance=conformance)
    return StreamProcessor(router, config, clock, flow=flow, disagg=pd), router


def request(prompt: str = LONG, **extra: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 20, "stream": True, **extra})


ANSWER = orjson.dumps(
    {
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "p-engine",
            "remote_block_ids": [1, 2],
            "remote_host": "10.0.0.1",
            "remote_port": 8000,
        },
    }
)


def start(proc: StreamProcessor, payload: bytes) -> list[Any]:
    assert proc.handle(headers("/v1/completions")) == []
    return proc.handle(body(payload))


def in_flight(router: Router) -> dict[str, int]:
    return {s.address: s.in_flight for s in router.fleet}


def test_the_prefill_half_runs_before_envoy_gets_the_decode_endpoint() -> None:
    proc, router = make(PdSpec("disaggregated", prefill_timeout_s=12.5))
    out = start(proc, request())
    assert len(out) == 1 and out[0].WhichOneof("response") is None
    assert out[0].override_message_timeout.seconds == 17  # the prefill's bound + 5 s
    sub = proc.handoff
    assert sub is not None
    assert (sub.address, sub.path, sub.timeout_s, sub.headers) == (
        PREFILL,
        "/v1/completions",
        12.5,
        {"x-request-id": "r1"},
    )
    sent = orjson.loads(sub.body)
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    assert (sent["stream"], sent["max_tokens"], sent["prompt"]) == (False, 1, LONG)
    assert in_flight(router) == {PREFILL: 1, DECODE: 1}
    assert proc.pd is not None and (proc.pd.mode, proc.pd.reason) == ("disaggregated", "disaggregated")

    decided = reply(proc.handed_off(ANSWER))
    assert decided.destination == [DECODE]
    doc = orjson.loads(decided.body)
    assert doc["kv_transfer_params"]["remote_engine_id"] == "p-engine"
    assert doc["kv_transfer_params"]["do_remote_prefill"] is True
    assert (doc["stream"], doc["max_tokens"]) == (True, 20)
    assert decided.set_headers["content-length"] == str(len(decided.body))
    assert proc.handoff is None and proc.handoff_outcome == "disaggregated"
    assert in_flight(router) == {PREFILL: 0, DECODE: 1}
    proc.close()
    assert in_flight(router) == {PREFILL: 0, DECODE: 0}


@pytest.mark.parametrize(
    ("answer", "failure", "outcome"),
    [
        (None, "timeout", "timeout"),
        (None, "status", "status"),
        (None, "unreachable", "unreachable"),
        (b'{"choices": []}', None, "bad_response"),
        (b"<html>", None, "bad_response"),
        (ANSWER.replace(b'"remote_block_ids":[1,2]', b'"remote_block_ids":"1,2"'), None, "bad_response"),
        # nested past what orjson re-encodes (255 levels): a 500 and a stack trace before
        (
            ANSWER.replace(
                b'"remote_block_ids"', b'"nest":' + b"[" * 300 + b"]" * 300 + b',"remote_block_ids"'
            ),
            None,
            "bad_response",
        ),
    ],
)
def test_a_failed_prefill_is_served_aggregated_on_the_decode_endpoint(
    answer: bytes | None, failure: str | None, outcome: str
) -> None:
    proc, router = make(PdSpec("disaggregated"))
    payload = request()
    start(proc, payload)
    decided = reply(proc.handed_off(answer, failure))
    assert decided.destination == [DECODE]
    assert decided.body == payload, "the client's request, unchanged"
    assert proc.handoff_outcome == outcome
    assert in_flight(router)[PREFILL] == 0


def test_conditional_serves_a_short_prompt_at_once() -> None:
    proc, _ = make(PdSpec("conditional", 512))
    decided = reply(start(proc, request("short")))
    assert decided.destination == [DECODE]
    assert proc.handoff is None
    assert proc.pd is not None and (proc.pd.mode, proc.pd.reason) == ("aggregated", "cached")


def test_a_client_gone_during_the_prefill_frees_both_slots() -> None:
    proc, router = make(PdSpec("disaggregated"))
    start(proc, request())
    proc.close()
    assert in_flight(router) == {PREFILL: 0, DECODE: 0}
    assert proc.handoff is None


def test_without_a_message_timeout_extension() -> None:
    proc, _ = make(PdSpec("disaggregated"), hold_timeout_s=None)
    assert start(proc, request()) == []
    assert proc.handoff is not None


def test_flow_control_counts_no_prefill_endpoint_among_a_models_servers() -> None:
    _, router = make(PdSpec("disaggregated"))
    assert [s.address for s in serving(router, MODEL)] == [DECODE]


def test_sglang_sends_both_halves_at_once_with_the_bootstrap_fields() -> None:
    proc, router = make(PdSpec("disaggregated", prefill_timeout_s=7.0), engine="sglang")
    payload = request()
    decided = reply(start(proc, payload))  # routed at once: no message-timeout extension first
    assert decided.destination == [DECODE]
    sub = proc.handoff
    assert sub is not None and not sub.wait and (sub.address, sub.timeout_s) == (PREFILL, 7.0)
    decode, prefill = orjson.loads(decided.body), orjson.loads(sub.body)
    room = decode["bootstrap_room"]
    assert (decode["bootstrap_host"], decode["bootstrap_port"]) == ("10.0.0.1", 8998)
    assert (prefill["bootstrap_host"], prefill["bootstrap_port"], prefill["bootstrap_room"]) == (
        "10.0.0.1",
        8998,
        room,
    )
    assert (decode["stream"], prefill["stream"], prefill["max_tokens"]) == (True, False, 20)
    assert "kv_transfer_params" not in decode
    proc.handoff = None  # the shell takes it and sends it beside the request (server._send_beside)
    proc.close()  # the stream may end first: the prefill's slot stays taken until it ends
    assert in_flight(router)[PREFILL] == 1
    proc.prefill_done(None)
    assert in_flight(router)[PREFILL] == 0 and proc.handoff_outcome == "disaggregated"
    proc.prefill_done("timeout")  # once only
    assert proc.handoff_outcome == "disaggregated"


def test_an_sglang_decode_endpoint_with_no_prefill_partner_is_a_503() -> None:
    """It would refuse the request without a bootstrap room (400); the gateway answers 503 instead and
    keeps no slot taken."""
    proc, router = make(PdSpec("conditional", 512), engine="sglang", bootstrap=False)
    status, error, _ = refused(start(proc, request("short")))
    assert (status, error["code"]) == (503, "no_prefill_endpoint")
    assert proc.decision is None and proc.pd is None and proc.handoff is None
    proc.close()
    assert in_flight(router) == {PREFILL: 0, DECODE: 0}
    decode = router.fleet.by_address(DECODE)
    assert decode is not None and decode.outstanding == 0  # no completion log comes for a local 503
    assert decode.load == 0


def test_a_pairing_of_a_body_that_is_no_object_releases_its_slot() -> None:
    router, pd = plan_make(
        [plan_endpoint("p0", "prefill"), plan_endpoint("d0", "decode")], PdSpec("disaggregated")
    )
    verdict = pd.plan(router.decide(plan_request("x"), request_id="r", now=1.0), 1.0)
    assert verdict is not None and verdict.handoff is not None
    assert verdict.handoff.prefill.in_flight == 1
    with pytest.raises(HandoffFailed) as caught:
        Pairing(pd, verdict.handoff, b"[1, 2]", "/v1/completions", None, "r")
    assert caught.value.reason == "bad_request" and verdict.handoff.prefill.in_flight == 0


@pytest.mark.parametrize(
    ("allowed", "prefilled"),
    [([PREFILL, DECODE], True), ([DECODE], False)],
)
def test_the_subset_metadata_binds_the_prefill_pick(allowed: list[str], prefilled: bool) -> None:
    """The EPP subset hint (Envoy's metadata, as the conformance tests send it) holds for both halves: a
    prefill endpoint outside it is never sent the prefill; then the request is served aggregated."""
    proc, router = make(PdSpec("disaggregated"))
    hint = metadata(**{SUBSET_NS: {SUBSET_KEY: allowed}})
    assert proc.handle(headers("/v1/completions", meta=hint)) == []
    out = proc.handle(body(request()))
    assert proc.pd is not None
    if prefilled:
        assert proc.handoff is not None and proc.handoff.address == PREFILL
        out = proc.handed_off(ANSWER)
    else:
        assert proc.handoff is None and (proc.pd.mode, proc.pd.reason) == ("aggregated", "no_prefill")
        assert in_flight(router)[PREFILL] == 0
    assert reply(out).destination == [DECODE]


@pytest.mark.parametrize(
    ("pin", "prefills"),
    [
        (f"{PREFILL2}, {DECODE}", {PREFILL2}),  # it names a prefill endpoint: the prefill pick is it
        ("10.0.0.3,10.0.0.2", {PREFILL2}),  # ip entries
        (DECODE, {PREFILL, PREFILL2}),  # it names none: the prefill profile picks (least loaded)
    ],
)
def test_the_conformance_pin_header_binds_the_pair(pin: str, prefills: set[str]) -> None:
    """``test-epp-endpoint-selection`` (conformance mode) binds the decode pick, and the prefill pick when
    it names a prefill endpoint (extproc/disagg/README.md)."""
    seen = set()
    for i in range(4):  # the prefill slots stay held (no answer yet): the least loaded alternates
        proc, router = make(PdSpec("disaggregated"), conformance=True)
        for s in router.fleet:
            s.in_flight = {PREFILL: i % 2, PREFILL2: 1 - i % 2}.get(s.address, 0)
        assert proc.handle(headers("/v1/completions", extra={CONFORMANCE_HEADER: pin})) == []
        proc.handle(body(request()))
        assert proc.handoff is not None
        seen.add(proc.handoff.address)
        assert reply(proc.handed_off(ANSWER)).destination == [DECODE]
    assert seen == prefills


#: A client's own handoff fields: an engine given them would fetch KV from a host the client chose.
EVIL_VLLM = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "evil",
    "remote_block_ids": [1],
    "remote_host": "203.0.113.9",
    "remote_port": 5555,
}
EVIL = {
    "kv_transfer_params": EVIL_VLLM,
    "bootstrap_host": "203.0.113.9",
    "bootstrap_port": 5555,
    "bootstrap_room": 7,
}


def no_client_handoff(sent: bytes) -> bool:
    doc = orjson.loads(sent)
    return "203.0.113.9" not in sent.decode() and not any(k in doc for k in EVIL)


@pytest.mark.parametrize(
    ("spec", "prompt", "reason"),
    [
        (PdSpec("aggregated"), LONG, None),  # the route never disaggregates: no verdict
        (PdSpec("conditional", 512), "short", "cached"),  # under the threshold: served aggregated
    ],
)
def test_a_clients_handoff_fields_never_reach_an_aggregated_engine(
    spec: PdSpec, prompt: str, reason: str | None
) -> None:
    proc, _ = make(spec)
    decided = reply(start(proc, request(prompt, **EVIL)))
    assert decided.destination == [DECODE] and proc.handoff is None
    assert (None if proc.pd is None else proc.pd.reason) == reason
    assert no_client_handoff(decided.body)
    assert orjson.loads(decided.body) == orjson.loads(request(prompt))  # the rest as the client sent it


@pytest.mark.parametrize(("answer", "failure"), [(None, "timeout"), (b"<html>", None)])
def test_a_clients_handoff_fields_never_reach_the_decode_engine_after_a_failed_prefill(
    answer: bytes | None, failure: str | None
) -> None:
    proc, _ = make(PdSpec("disaggregated"))
    start(proc, request(**EVIL))
    assert proc.handoff is not None and b"203.0.113.9" not in proc.handoff.body  # the gateway's own only
    decided = reply(proc.handed_off(answer, failure))
    assert no_client_handoff(decided.body)
    assert decided.body == request(), "the client's request, without its handoff fields"


def test_a_real_handoff_sets_the_gateways_own_fields_over_the_clients() -> None:
    proc, _ = make(PdSpec("disaggregated"))
    start(proc, request(**EVIL))
    assert proc.handoff is not None
    prefill = orjson.loads(proc.handoff.body)
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill["kv_transfer_params"]["remote_host"] is None
    assert not any(k in prefill for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
    decode = orjson.loads(reply(proc.handed_off(ANSWER)).body)
    assert decode["kv_transfer_params"] == {**orjson.loads(ANSWER)["kv_transfer_params"]}
    assert not any(k in decode for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))


def test_sglang_sets_its_own_bootstrap_fields_over_the_clients() -> None:
    proc, _ = make(PdSpec("disaggregated"), engine="sglang")
    decided = reply(start(proc, request(**EVIL)))
    assert proc.handoff is not None
    for sent in (orjson.loads(decided.body), orjson.loads(proc.handoff.body)):
        assert (sent["bootstrap_host"], sent["bootstrap_port"]) == ("10.0.0.1", 8998)
        assert sent["bootstrap_room"] != 7 and "kv_transfer_params" not in sent


@pytest.mark.parametrize("orders", [(None, "low_first"), ("low_first", None), ("high_first", "high_first")])
@pytest.mark.parametrize(("answer", "failure"), [(ANSWER, None), (None, "timeout")])
def test_a_clients_priority_reaches_neither_half(
    answer: bytes | None, failure: str | None, orders: tuple[str | None, str | None]
) -> None:
    """The priority rewrite (a client's own priority never reaches an engine that schedules by it) holds
    for both halves, whichever of them schedules by priority."""
    proc, _ = make(PdSpec("disaggregated"), orders=orders)
    start(proc, request(priority=-100))
    assert proc.handoff is not None and "priority" not in orjson.loads(proc.handoff.body)
    assert "priority" not in orjson.loads(reply(proc.handed_off(answer, failure)).body)


def test_sglangs_halves_get_no_client_priority() -> None:
    proc, _ = make(PdSpec("disaggregated"), engine="sglang", orders=(None, "low_first"))
    decided = reply(start(proc, request(priority=-100)))
    assert proc.handoff is not None
    assert "priority" not in orjson.loads(decided.body) and "priority" not in orjson.loads(proc.handoff.body)


def test_an_sglang_no_prefill_refusal_keeps_its_verdict_for_the_count() -> None:
    proc, _ = make(PdSpec("conditional", 512), engine="sglang", bootstrap=False)
    status, _, _ = refused(start(proc, request("short")))
    assert status == 503 and proc.pd is None
    assert proc.pd_refused is not None and (proc.pd_refused.mode, proc.pd_refused.reason) == (
        "aggregated",
        "no_prefill",
    )


def test_the_decode_engine_is_told_the_ttft_deadline_left_after_the_prefill() -> None:
    now = [1000.0]
    interactive = Objective("interactive", priority=1, ttft_ms=2000)
    flow: FlowControl[StreamProcessor] = FlowControl(FlowPolicy(objectives={"interactive": interactive}))
    proc, _ = make(PdSpec("disaggregated"), clock=lambda: now[0], flow=flow)
    assert proc.handle(headers("/v1/completions", extra={"x-llm-d-inference-objective": "interactive"})) == []
    proc.handle(body(request()))
    assert proc.handoff is not None
    now[0] += 1.5  # the prefill took 1.5 s of the 2 s
    decided = reply(proc.handed_off(ANSWER))
    assert decided.set_headers[TTFT_DEADLINE_UPSTREAM] == "500"


def test_an_sglang_pair_whose_client_left_before_its_prefill_was_sent_frees_the_prefill_slot() -> None:
    """Held by flow control, then dispatched (the pair planned, the prefill endpoint's slot and queued
    tokens taken) as the client goes away: the shell's stream is cancelled before it sends the prefill
    half beside the request, so no prefill_done will ever come; close() gives the slot back."""
    flow: FlowControl[StreamProcessor] = FlowControl(FlowPolicy(saturation=Saturation(max_in_flight=1)))
    proc, router = make(PdSpec("disaggregated"), engine="sglang", flow=flow)
    decode = router.fleet.by_address(DECODE)
    assert decode is not None
    decode.in_flight = 1  # saturated: the request is held
    start(proc, request())
    assert proc.held is not None
    decode.in_flight = 0
    proc.resume()  # the dispatcher routes it; the stream's task is cancelled before it runs again
    assert proc.handoff is not None and in_flight(router)[PREFILL] == 1
    proc.undelivered = True  # what the shell's finally sets for a decision never handed to Envoy
    proc.close()
    assert in_flight(router) == {PREFILL: 0, DECODE: 0}
    assert proc.pd is not None and proc.pd.handoff is not None and proc.pd.handoff.released


@pytest.mark.parametrize("spec", [PdSpec("disaggregated"), PdSpec("aggregated")])
def test_a_clients_prefill_dp_rank_reaches_no_sglang_engine(spec: PdSpec) -> None:
    """SGLang's ``disagg_prefill_dp_rank`` tells the decode server which data-parallel rank of the prefill
    server holds the KV (its OpenAI protocol: "hint telling decode which prefill DP worker has the KV
    cache"); the gateway's pair leaves it to the room, so a client's own would send the decode to fetch
    from a rank the client chose (and wait out SGLang's transfer timeout there)."""
    # an aggregated route's SGLang endpoint serves alone: role both (a decode server is never picked)
    role = "decode" if spec.mode == "disaggregated" else "both"
    proc, _ = make(spec, engine="sglang", decode_role=role)
    decided = reply(start(proc, request(disagg_prefill_dp_rank=3)))
    sent = [decided.body] if proc.handoff is None else [decided.body, proc.handoff.body]
    assert len(sent) == (2 if spec.mode == "disaggregated" else 1)
    for body_sent in sent:
        assert "disagg_prefill_dp_rank" not in orjson.loads(body_sent)


@pytest.mark.parametrize("spec", [PdSpec("aggregated"), None])
def test_an_sglang_decode_server_is_no_candidate_where_nothing_pairs_its_requests(
    spec: PdSpec | None,
) -> None:
    """A model whose serving spec is aggregated, or that has none (a policy reload dropped it), is never
    paired: an SGLang decode server would answer 400 (no bootstrap room), so it is not picked. With no
    other endpoint the client gets the gateway's 503; with one, that one serves."""
    proc, router = make(spec or PdSpec("disaggregated"), engine="sglang")
    if spec is None:
        proc._disagg.apply(PdPolicy())  # type: ignore[union-attr]
    status, error, _ = refused(start(proc, request("short")))
    assert (status, error["code"]) == (503, "no_endpoint")
    proc.close()
    assert in_flight(router) == {PREFILL: 0, DECODE: 0}
    router.fleet.upsert(Endpoint(EndpointId("b"), "10.0.0.9:8000", frozenset({MODEL}), "sglang", role="both"))
    proc = StreamProcessor(router, proc._config, lambda: 1000.0, disagg=proc._disagg)
    decided = reply(start(proc, request("short")))
    assert decided.destination[0] == "10.0.0.9:8000" and DECODE not in decided.destination


def prefill_limited(max_in_flight: int) -> FlowControl[StreamProcessor]:
    """Flow control with a limit for the model's prefill role only (the flow policy's own example)."""
    prefill = Saturation(max_in_flight=max_in_flight)
    limits = ModelSaturation(roles=types.MappingProxyType({"prefill": prefill}))
    return FlowControl(FlowPolicy(models=types.MappingProxyType({MODEL: limits})))


def second(proc: StreamProcessor, router: Router, flow: FlowControl[StreamProcessor]) -> StreamProcessor:
    """Another stream of the same ext_proc (its router, disaggregator and flow control)."""
    return StreamProcessor(router, proc._config, lambda: 1000.0, flow=flow, disagg=proc._disagg)


def test_a_prefill_endpoint_at_its_roles_limit_is_not_picked() -> None:
    """``roles.prefill`` limits hold for the prefill pick: a prefill endpoint saturated under them takes
    no more prefills (served aggregated, ``no_prefill``) until its running one ends."""
    flow = prefill_limited(1)
    proc, router = make(PdSpec("disaggregated"), flow=flow)
    start(proc, request())
    assert proc.handoff is not None and proc.handoff.address == PREFILL
    other = second(proc, router, flow)
    assert other.handle(headers("/v1/completions", extra={"x-request-id": "r2"})) == []
    decided = reply(other.handle(body(request())))
    assert decided.destination == [DECODE] and other.handoff is None
    assert other.pd is not None and (other.pd.mode, other.pd.reason) == ("aggregated", "no_prefill")
    assert in_flight(router)[PREFILL] == 1
    proc.handed_off(ANSWER)  # the first prefill ended: its slot is free again
    third = second(proc, router, flow)
    assert third.handle(headers("/v1/completions", extra={"x-request-id": "r3"})) == []
    third.handle(body(request()))
    assert third.handoff is not None and third.handoff.address == PREFILL


def test_an_sglang_decode_pick_whose_prefill_endpoints_are_saturated_is_a_503() -> None:
    flow = prefill_limited(1)
    proc, router = make(PdSpec("conditional", 512), engine="sglang", flow=flow)
    reply(start(proc, request("short")))
    assert proc.handoff is not None and proc.handoff.address == PREFILL
    other = second(proc, router, flow)
    assert other.handle(headers("/v1/completions", extra={"x-request-id": "r2"})) == []
    status, error, _ = refused(other.handle(body(request("short"))))
    assert (status, error["code"]) == (503, "no_prefill_endpoint")
    assert in_flight(router) == {PREFILL: 1, DECODE: 1}


def held_blocks(router: Router) -> dict[str, int]:
    """Blocks the prefix index credits each endpoint with."""
    occupancy = router.index.occupancy()
    return {s.address: occupancy.get(s.id, 0) for s in router.fleet}


@pytest.mark.parametrize(
    ("answer", "failure"),
    [(None, "timeout"), (None, "status"), (None, "unreachable"), (b'{"choices": []}', None)],
)
def test_a_failed_prefill_leaves_no_cache_record_at_its_endpoint(
    answer: bytes | None, failure: str | None
) -> None:
    """The prefill endpoint computed nothing usable: the index does not credit it with the prompt (the
    decode endpoint, which served it whole, is recorded as ever)."""
    proc, router = make(PdSpec("disaggregated"))
    start(proc, request())
    reply(proc.handed_off(answer, failure))
    proc.close()
    held = held_blocks(router)
    assert held[PREFILL] == 0 and held[DECODE] > 0


def test_a_prefill_that_succeeded_is_recorded_at_its_endpoint() -> None:
    proc, router = make(PdSpec("disaggregated"))
    start(proc, request())
    reply(proc.handed_off(ANSWER))
    proc.close()
    held = held_blocks(router)
    assert held[PREFILL] > 0 and held[DECODE] > 0


@pytest.mark.parametrize("failure", ["status", "timeout", None])
def test_an_sglang_prefill_half_is_recorded_when_the_pair_is_sent(failure: str | None) -> None:
    """SGLang's prefill half runs beside the decode; its end may reach the gateway after the client has
    its answer, and a repeat sent then must find the prefix at the prefill endpoint already (the e2e
    ``test_a_repeated_long_prefix_goes_to_the_prefill_replica_that_holds_it`` under load). Its end changes
    nothing: a failed SGLang prefill fails the request anyway."""
    proc, router = make(PdSpec("disaggregated"), engine="sglang")
    reply(start(proc, request()))
    assert held_blocks(router)[PREFILL] > 0  # before the prefill half ends
    proc.prefill_done(failure)
    proc.close()
    held = held_blocks(router)
    assert held[PREFILL] > 0 and held[DECODE] > 0


def test_a_paired_prompt_prepared_off_the_loop_is_planned_without_tokenizing_on_it(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large body is parsed, rendered and tokenized in a worker thread (:meth:`StreamProcessor.prepare`);
    the plan needs the window's exact uncached count, so a paired model's window is tokenized there too:
    the event loop's half (:meth:`StreamProcessor.handle`) hashes no block of it (it tokenized ~4,000
    tokens, 60-90 ms on this machine, while every other stream of the worker waited). The verdict and the
    prefill pick's digests are those of the loop's own tokenizing, and the commit remembers the prompt's
    state for the next turn as an unpaired one's does."""
    assets = ModelAssets.load(MODEL, Path(model_dir), max_model_len=1 << 20)
    prompt = " ".join(f"s{i} lorem ipsum" for i in range(2000))  # ~35 KiB: prepared in a worker thread

    def paired() -> StreamProcessor:
        assets.tokenizer.clear_cache()  # each processor tokenizes from the same empty segment cache
        router = Router(
            Fleet([plan_endpoint("p", "prefill"), plan_endpoint("d", "decode")]),
            ModelRegistry([assets]),
            ApproximateIndex(),
            RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16),
            rng=random.Random(0),
        )
        route = PdRoute(PdSpec("disaggregated"), build_profile(DEFAULT_SCHEDULING))
        pd = Disaggregator(router, PdPolicy(types.MappingProxyType({MODEL: route})), random.Random(0))
        return StreamProcessor(router, ProcessorConfig(max_body_bytes=1 << 22), lambda: 1000.0, disagg=pd)

    payload = request(prompt)
    on_loop = paired()  # the reference: everything on the loop (no prepare)
    start(on_loop, payload)
    proc = paired()
    assert proc.handle(headers("/v1/completions")) == []
    msg = body(payload)
    assert proc.preparable(msg)
    proc.prepare(msg)  # the worker thread's half
    steps: list[int] = []
    hash_step = LazyPrompt._hash_step

    def counted(self: LazyPrompt) -> None:
        steps.append(len(self.digests))
        hash_step(self)

    monkeypatch.setattr(LazyPrompt, "_hash_step", counted)
    proc.handle(msg)  # the event loop's half
    assert steps == [], "no block tokenized or hashed on the event loop"
    assert proc.handoff is not None
    assert proc.pd is not None and on_loop.pd is not None
    assert proc.pd.handoff is not None and on_loop.pd.handoff is not None
    assert proc.pd.handoff.uncached_tokens == on_loop.pd.handoff.uncached_tokens
    assert list(proc.pd.handoff.digests) == list(on_loop.pd.handoff.digests)
    assert len(proc.pd.handoff.digests) == 256  # the whole window
    remembered: list[int] = []
    monkeypatch.setattr(LazyPrompt, "remember", lambda self, held=None: remembered.append(len(self.digests)))
    proc.after_send()
    assert remembered == [256], "the commit remembers the prompt's state for the next turn"
