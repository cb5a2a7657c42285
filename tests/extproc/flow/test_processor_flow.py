"""Flow control inside the stream state machine, in memory: a real Router over a real Fleet, a real
FlowControl, a fixed clock. A request with no room is held (Envoy's message timeout extended), then
routed with fresh state by ``resume`` or answered by ``shed``; the headers it reads are checked."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import orjson
import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode

from contracts.events import EndpointId
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.errors import GatewayError
from extproc.flow.control import TTFT_DEADLINE_UPSTREAM, FlowControl, Room
from extproc.flow.policy import BandLimits, EnginePriority, FlowPolicy, Objective, Saturation
from extproc.models.registry import ModelAssets, ModelRegistry
from extproc.processor import ProcessorConfig, StreamProcessor, flow_room
from extproc.routing.router import Route, Router, RoutingPolicy
from extproc.scheduling.predict import CONFIDENT_AFTER
from tests.extproc.test_processor import (
    ACME,
    ACME_KEY,
    LIMIT,
    MODEL,
    MODEL_REWRITE,
    NOW,
    OTHER,
    body,
    chat,
    clock,
    error,
    headers,
    make_gate,
    make_router,
    reply,
    response_body,
    response_headers,
)

ONE_EACH = Saturation(max_in_flight=1)
INTERACTIVE = Objective("interactive", priority=1, ttft_ms=2000)
BATCH = Objective("batch", priority=0)
SCRAP = Objective("scrap", priority=-1)
POLICY = FlowPolicy(
    saturation=ONE_EACH,
    objectives={o.name: o for o in (INTERACTIVE, BATCH, SCRAP)},
    retry_after_s=3,
)


@pytest.fixture(scope="module")
def smol(model_dir: str) -> ModelAssets:
    return ModelAssets.load(MODEL, Path(model_dir), max_model_len=1 << 20)


@pytest.fixture
def router(smol: ModelAssets) -> Router:
    return make_router(smol)


def make(router: Router, control: FlowControl[StreamProcessor], gate: Any = None) -> StreamProcessor:
    config = ProcessorConfig(max_body_bytes=LIMIT, hold_timeout_s=600.0)
    return StreamProcessor(router, config, clock, gate, control)


_IDS = itertools.count()


def send(proc: StreamProcessor, extra: dict[str, str] | None = None, **kw: Any) -> list[Any]:
    """``proc``'s request, with an ``x-request-id`` of its own (as the bundled Envoy writes) unless
    ``extra`` names one."""
    assert proc.handle(headers(extra={"x-request-id": f"r{next(_IDS)}", **(extra or {})})) == []
    return proc.handle(body(chat(**kw)))


def fill(router: Router, control: FlowControl[StreamProcessor]) -> None:
    """Route one request to each of the model's three endpoints: each is then at its limit."""
    for _ in range(3):
        reply(send(make(router, control)))
    assert flow_room(control.policy, router, MODEL, NOW) is Room.FULL


def scrape_idle(router: Router) -> None:
    """A scrape finds every engine idle: the requests routed before it ended (their completions reach the
    router), the routed-since-scrape counts reset, room opens."""
    for request_id in list(router._open):
        router.completed(request_id, NOW)
    for state in router.fleet:
        router.fleet.record_scrape(state.id, EngineMetrics(0, 0, 0.1, NOW))


def test_a_saturated_model_holds_the_request_and_resume_routes_it_with_fresh_state(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    fill(router, control)
    proc = make(router, control)
    out = send(proc)
    assert proc.held is not None and proc.decision is None
    assert [r.WhichOneof("response") for r in out] == [None]  # only the timeout extension
    assert out[0].HasField("override_message_timeout")
    assert 60 <= out[0].override_message_timeout.seconds <= 600  # past the band's 60 s wait
    scrape_idle(router)
    entry = control.next(MODEL, flow_room(control.policy, router, MODEL, NOW), NOW)
    assert entry is proc.held
    routed = reply(entry.payload.resume())
    assert proc.held is None and proc.decision is not None
    assert routed.set_headers  # the destination and the rest of the decision reply


def test_behind_a_gateway_the_responses_end_frees_the_endpoints(router: Router) -> None:
    """A third-party gateway writes no kvgate completion log: the responses' ends on the picker's streams
    are the completions. Each endpoint at its limit of one, every response over and every engine idle at
    the next scrape: the next request goes at once (the outstanding counts fell), not held 15 minutes."""
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    procs = []
    for i in range(3):
        proc = make(router, control)
        msg = headers(extra={"x-request-id": f"g{i}"})
        msg.protocol_config.response_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
        assert proc.handle(msg) == []
        reply(proc.handle(body(chat(f"question {i}"))))
        procs.append(proc)
    assert flow_room(control.policy, router, MODEL, NOW) is Room.FULL
    for proc in procs:
        proc.handle(response_headers())
        proc.handle(response_body(b'{"id": "x"}', True))
        proc.close()
    scrape_idle(router)
    assert flow_room(control.policy, router, MODEL, NOW) is Room.OPEN
    proc = make(router, control)
    reply(send(proc))
    assert proc.held is None


def test_an_open_model_with_nobody_waiting_routes_at_once(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    proc = make(router, control)
    reply(send(proc))
    assert proc.held is None


def test_a_full_band_refuses_with_429_queue_full_and_retry_after(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(
        FlowPolicy(saturation=ONE_EACH, bands=BandLimits(max_requests=1), retry_after_s=3)
    )
    fill(router, control)
    first = make(router, control)
    send(first)
    assert first.held is not None
    second = make(router, control)
    status, err, hs = error(send(second))
    assert (status, err["code"], err["type"], hs["retry-after"]) == (
        429,
        "queue_full",
        "rate_limit_error",
        "3",
    )
    assert second.refused == "queue_full"


def test_a_held_request_shed_gets_the_flow_error(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    fill(router, control)
    proc = make(router, control)
    send(proc)
    entry = proc.held
    assert entry is not None
    [expired] = control.queues.expire(entry.expires)
    status, err, hs = error(proc.shed(control.error(expired, Room.FULL)))
    assert (status, err["code"], hs["retry-after"]) == (429, "queue_timeout", "3")
    assert proc.held is None


def test_an_objective_sets_the_band_and_its_ttft_the_deadline(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    fill(router, control)
    proc = make(router, control)
    send(proc, {"x-llm-d-inference-objective": "interactive"})
    entry = proc.held
    assert entry is not None and entry.priority == 1
    assert entry.deadline == pytest.approx(NOW + 2.0)
    assert entry.reason == "slo_unattainable" and entry.expires == entry.deadline
    scrape_idle(router)
    routed = reply(entry.payload.resume())
    assert 1 <= int(routed.set_headers[TTFT_DEADLINE_UPSTREAM]) <= 2000


def test_priority_beats_arrival_order_when_capacity_frees(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    fill(router, control)
    procs = []
    for objective in ("batch", "scrap", "interactive", "batch", "interactive"):
        proc = make(router, control)
        send(proc, {"x-gateway-inference-objective": objective})
        procs.append(proc)
    order = []
    while (entry := control.queues.pop(MODEL)) is not None:
        order.append(entry.priority)
    assert order == [1, 1, 0, 0, -1]


def test_the_fairness_header_names_the_flow_and_the_tenant_wins_under_auth(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    fill(router, control)
    proc = make(router, control)
    send(proc, {"x-llm-d-inference-fairness-id": "team-a"})
    assert proc.held is not None and proc.held.flow == "team-a"
    other = make(router, control)
    send(other)
    assert other.held is not None and other.held.flow == "default"


@pytest.mark.parametrize(
    ("extra", "status", "code"),
    [
        ({"x-llm-d-inference-objective": "nope"}, 400, "unknown_objective"),
        ({"x-kvgate-deadline-ms": "soon"}, 400, "invalid_header"),
        ({"x-llm-d-slo-ttft-ms": "-5"}, 400, "invalid_header"),
        ({"x-llm-d-slo-ttft-ms": "inf"}, 400, "invalid_header"),
    ],
)
def test_bad_flow_headers_are_refused(router: Router, extra: dict[str, str], status: int, code: str) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    got, err, _ = error(send(make(router, control), extra))
    assert (got, err["code"]) == (status, code)
    assert control.queues.queued(MODEL) == 0


def test_a_deadline_already_past_is_shed_before_any_engine(router: Router) -> None:
    ticking = iter([NOW, NOW, NOW + 10.0])
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    fill(router, control)

    def later() -> float:
        return next(ticking, NOW + 10.0)

    proc = StreamProcessor(router, ProcessorConfig(max_body_bytes=LIMIT), later, None, control)
    assert proc.handle(headers(extra={"x-kvgate-deadline-ms": "100"})) == []
    status, err, _ = error(proc.handle(body(chat())))
    assert (status, err["code"]) == (429, "slo_unattainable")
    assert proc.decision is None


def test_no_endpoint_waits_in_the_waiting_room_then_503(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(FlowPolicy(waiting_room_s=5.0))
    for state in router.fleet:
        router.fleet.set_state(state.id, healthy=False)
    proc = make(router, control)
    send(proc)
    entry = proc.held
    assert entry is not None and entry.expires == NOW + 5.0 and entry.reason == "no_endpoint"
    [gone] = control.queues.expire(NOW + 5.0)
    status, err, _ = error(proc.shed(control.error(gone, Room.NONE)))
    assert (status, err["code"]) == (503, "no_endpoint")


def test_a_model_nothing_declares_is_404_at_once_whatever_the_waiting_room(router: Router) -> None:
    """A typo or made-up name is not held for ``waiting_room_s`` then 503: the router's 404 at once, and
    nothing is queued (a client naming a new model each time leaves no queue per name)."""
    control: FlowControl[StreamProcessor] = FlowControl(FlowPolicy(waiting_room_s=5.0))
    for i in range(3):
        proc = make(router, control)
        status, err, _ = error(send(proc, model=f"gpt-{i}"))
        assert (status, err["type"], err["code"]) == (404, "invalid_request_error", "model_not_found")
        assert proc.held is None
    assert control.queues.tops() == {} and len(control.queues) == 0


@pytest.mark.parametrize("declared", ["route", "config"])
def test_a_declared_model_no_endpoint_serves_yet_waits_in_the_waiting_room(
    router: Router, smol: ModelAssets, declared: str
) -> None:
    """Scale-from-zero: a model a route (etcd ``models/<name>``) or the config's ``[[models]]`` declares,
    with no endpoint record yet, waits for one; it is routed when one comes."""
    if declared == "route":
        profile = router.policy.profile
        router.apply(RoutingPolicy(profile, routes={"zero": Route((), profile)}, block_size=16))
    else:
        router.models = ModelRegistry({MODEL: smol, "zero": smol})
    control: FlowControl[StreamProcessor] = FlowControl(FlowPolicy(waiting_room_s=5.0))
    proc = make(router, control)
    send(proc, model="zero")
    entry = proc.held
    assert entry is not None and entry.reason == "no_endpoint"
    router.fleet.upsert(Endpoint(EndpointId("z"), "10.0.0.9:8000", frozenset({"zero"})))
    assert flow_room(control.policy, router, "zero", NOW) is Room.OPEN
    assert control.next("zero", Room.OPEN, NOW) is entry
    assert reply(proc.resume()).destination == ["10.0.0.9:8000"]


def test_shed_answers_without_routing(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    fill(router, control)
    proc = make(router, control)
    send(proc)
    before = sum(s.routed_since_scrape for s in router.fleet)
    out = proc.shed(GatewayError("x"))
    assert out and proc.decision is None
    assert sum(s.routed_since_scrape for s in router.fleet) == before


def teach(router: Router, endpoint: str, seconds_per_token: float, base_s: float = 0.05) -> None:
    """Windows of the engine's TTFT histogram, each with one request of this router's alone at
    ``endpoint`` (sizes vary): the predictor learns its line."""
    state = next(s for s in router.fleet if s.id == endpoint)
    total = count = 0.0
    for i in range(CONFIDENT_AFTER + 1):
        at = NOW - 1000.0 + i * 50
        state.metrics = EngineMetrics(0, 0, 0.1, at, ttft_sum=total, ttft_count=count)
        tokens = 500 * (i % 4 + 1)
        router.predictor.routed(f"{endpoint}-{i}", state, tokens, at)
        router.predictor.forget(f"{endpoint}-{i}")
        total, count = total + base_s + seconds_per_token * tokens, count + 1
    state.metrics = None
    assert router.predictor.confident(endpoint)


def test_a_deadline_every_endpoint_is_predicted_to_miss_is_shed_before_any_engine(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    for state in router.fleet:
        if MODEL in state.endpoint.models:
            teach(router, state.id, seconds_per_token=0.01)  # 100 tokens/s: a long prompt takes seconds
    before = [(s.routed_since_scrape, s.outstanding) for s in router.fleet]
    proc = make(router, control)
    status, err, hs = error(send(proc, {"x-kvgate-deadline-ms": "300"}, content="word " * 400))
    assert (status, err["code"], err["type"], hs["retry-after"]) == (
        429,
        "slo_unattainable",
        "rate_limit_error",
        "3",
    )
    assert "predicted" in err["message"]
    assert proc.refused == "slo_unattainable" and proc.decision is None
    assert [(s.routed_since_scrape, s.outstanding) for s in router.fleet] == before
    assert len(router.predictor) == 0  # nothing remembered of it
    reply(send(make(router, control), content="word " * 400))  # without a deadline it goes


def test_the_slo_filter_sends_a_deadline_to_the_endpoint_predicted_in_time(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    fast = "e2"
    for state in router.fleet:
        if MODEL in state.endpoint.models:
            teach(router, state.id, seconds_per_token=0.0001 if state.id == fast else 0.01)
    for _ in range(3):
        proc = make(router, control)
        reply(send(proc, {"x-kvgate-deadline-ms": "1000"}, content="word " * 400))
        assert proc.decision is not None and proc.decision.endpoints[0].id == fast
        router.finish(proc.decision)
        router.completed(proc.request_id, NOW)


def test_predictions_without_confidence_never_shed(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    proc = make(router, control)  # nothing learned: the prior alone
    reply(send(proc, {"x-kvgate-deadline-ms": "1"}, content="word " * 4000))
    assert proc.decision is not None


def test_a_bands_headroom_holds_batch_while_interactive_goes_at_once(router: Router) -> None:
    """Batch (priority 0, headroom 0.5) sees half of each engine's 2 slots: one batch request per engine
    fills them for batch, the next is held; an interactive request still goes at once, into the slot
    batch left free, and the held batch request is routed only when an engine is back under its half."""
    policy = FlowPolicy(
        saturation=Saturation(max_in_flight=2),
        band_limits={0: BandLimits(headroom=0.5)},
        objectives={o.name: o for o in (INTERACTIVE, BATCH)},
    )
    control: FlowControl[StreamProcessor] = FlowControl(policy)
    batch = {"x-llm-d-inference-objective": "batch"}
    for _ in range(3):
        reply(send(make(router, control), batch))
    assert flow_room(policy, router, MODEL, NOW, 0) is Room.FULL
    assert flow_room(policy, router, MODEL, NOW, 1) is Room.OPEN
    held = make(router, control)
    send(held, batch)
    assert held.held is not None
    urgent = make(router, control)
    reply(send(urgent, {"x-llm-d-inference-objective": "interactive"}))
    assert urgent.held is None and urgent.decision is not None
    assert max(s.load for s in router.fleet) == 2  # the interactive request took a kept slot
    assert control.next(MODEL, flow_room(policy, router, MODEL, NOW, 0), NOW) is None
    scrape_idle(router)
    entry = control.next(MODEL, flow_room(policy, router, MODEL, NOW, 0), NOW)
    assert entry is held.held
    reply(entry.payload.resume())
    assert held.decision is not None


def test_a_request_that_would_wait_is_shed_at_arrival_when_even_routing_now_would_miss(
    router: Router,
) -> None:
    """The fleet is saturated, so a request with a deadline would be queued; every engine is confidently
    predicted to miss its deadline even if it were routed now (a lower bound of what waiting gives), so
    it gets 429 slo_unattainable at arrival instead of waiting out its deadline in the queue. One whose
    deadline the engines can meet is queued as usual."""
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    for state in router.fleet:
        if MODEL in state.endpoint.models:
            teach(router, state.id, seconds_per_token=0.01)
    fill(router, control)
    proc = make(router, control)
    status, err, _ = error(send(proc, {"x-kvgate-deadline-ms": "300"}, content="word " * 400))
    assert (status, err["code"]) == (429, "slo_unattainable")
    assert proc.held is None and len(control.queues) == 0 and proc.refused == "slo_unattainable"
    waits = make(router, control)
    send(waits, {"x-kvgate-deadline-ms": "60000"}, content="word " * 400)
    assert waits.held is not None and len(control.queues) == 1


@pytest.mark.parametrize(
    ("order", "expected"), [("low_first", {1: -10, 0: 0}), ("high_first", {1: 10, 0: 0})]
)
def test_engine_priority_writes_the_band_into_the_body_and_replaces_the_clients(
    router: Router, order: str, expected: dict[int, int]
) -> None:
    """With flow/engine_priority the routed body carries the request's band as the engine's priority
    field (the client's own replaced); batch fills every slot of the engines (headroom 0) while
    interactive may go past them (headroom -0.5: engines that preempt make room)."""
    policy = FlowPolicy(
        saturation=Saturation(max_in_flight=2),
        band_limits={1: BandLimits(headroom=-0.5)},
        engine_priority=EnginePriority(order, 10),
        objectives={o.name: o for o in (INTERACTIVE, BATCH)},
    )
    control: FlowControl[StreamProcessor] = FlowControl(policy)
    sent: dict[int, int] = {}
    for _ in range(6):
        r = reply(send(make(router, control), {"x-llm-d-inference-objective": "batch"}, priority=-99))
        sent[0] = orjson.loads(b"".join(c for c, _ in r.chunks))["priority"]
    assert flow_room(policy, router, MODEL, NOW, 0) is Room.FULL
    assert flow_room(policy, router, MODEL, NOW, 1) is Room.OPEN
    urgent = make(router, control)
    r = reply(send(urgent, {"x-llm-d-inference-objective": "interactive"}, priority=-99))
    assert urgent.held is None
    sent[1] = orjson.loads(b"".join(c for c, _ in r.chunks))["priority"]
    assert sent == expected


def test_without_engine_priority_the_body_is_left_alone(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    r = reply(send(make(router, control), {"x-llm-d-inference-objective": "interactive"}))
    assert "priority" not in orjson.loads(b"".join(c for c, _ in r.chunks))


def test_the_router_forgets_what_it_learned_of_an_endpoint_that_leaves(router: Router) -> None:
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    proc = make(router, control)
    reply(send(proc))
    assert proc.decision is not None and len(router.predictor) == 1
    router.fleet.remove(proc.decision.endpoints[0].id)
    assert len(router.predictor) == 0


def ticking() -> Any:
    """A nanosecond clock for a timeline: each reading 1,000 ns after the last."""
    now = [0]

    def read() -> int:
        now[0] += 1000
        return now[0]

    return read


def test_a_traced_request_records_its_phases_and_its_queue_wait(router: Router) -> None:
    """Tracing (contracts.tracing.Timeline): the processor and the router mark each phase of a sampled
    request, flow control's hold included; an untraced one has no timeline."""
    from contracts.tracing import Timeline

    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    fill(router, control)  # untraced: none of them got a timeline
    proc = make(router, control)
    assert proc.timeline is None
    proc.timeline = Timeline(ticking())
    send(proc)
    assert proc.held is not None
    scrape_idle(router)
    entry = control.next(MODEL, flow_room(control.policy, router, MODEL, NOW), NOW)
    assert entry is not None
    reply(entry.payload.resume())
    spans = proc.timeline.spans
    names = [name for name, _, _ in spans]
    assert names[:3] == ["parse", "render", "tokenize"]
    assert {"queue_wait", "digest", "lookup", "schedule"} <= set(names)
    assert names.index("queue_wait") < names.index("schedule")
    assert all(end > start for _, start, end in spans)


def test_engine_priority_keeps_a_model_rewrite(router: Router) -> None:
    """The priority goes into the body as sent: a rewritten model (EPP x-gateway-model-name-rewrite)
    stays rewritten."""
    objectives = {"interactive": INTERACTIVE}
    policy = FlowPolicy(engine_priority=EnginePriority("low_first", 1), objectives=objectives)
    control: FlowControl[StreamProcessor] = FlowControl(policy)
    extra = {"x-llm-d-inference-objective": "interactive", MODEL_REWRITE: OTHER}
    r = reply(send(make(router, control), extra, model=MODEL))
    sent = orjson.loads(b"".join(c for c, _ in r.chunks))
    assert (sent["model"], sent["priority"]) == (OTHER, -1)


def declare(router: Router, order: str | None, model: str = MODEL) -> None:
    """Every endpoint of ``model`` registers again, declaring it schedules by priority in ``order``."""
    import dataclasses

    for state in list(router.fleet):
        if model in state.endpoint.models:
            router.fleet.upsert(dataclasses.replace(state.endpoint, priority_order=order))


def routed_body(r: Any) -> dict[str, Any]:
    parsed: dict[str, Any] = orjson.loads(b"".join(c for c, _ in r.chunks))
    return parsed


@pytest.mark.parametrize(("order", "expected"), [("low_first", -1), ("high_first", 1)])
def test_an_endpoint_that_declares_priority_scheduling_is_told_the_band_in_its_own_order(
    router: Router, order: str, expected: int
) -> None:
    """flow/engine_priority without an assumed order: only endpoints whose record declares a
    priority_order get the field, each in the order it declared; the client's own is replaced."""
    policy = FlowPolicy(engine_priority=EnginePriority(), objectives={"interactive": INTERACTIVE})
    control: FlowControl[StreamProcessor] = FlowControl(policy)
    extra = {"x-llm-d-inference-objective": "interactive"}
    assert "priority" not in routed_body(reply(send(make(router, control), extra)))  # none declared
    declare(router, order)
    assert routed_body(reply(send(make(router, control), extra, priority=-99)))["priority"] == expected


def test_a_clients_priority_never_reaches_an_engine_that_schedules_by_it(router: Router) -> None:
    """Without flow control (or with flow/engine_priority off) nothing is written, and a client's own
    priority is removed where the engine would act on it: no client jumps an engine's queue itself. To
    an engine that ignores the field it goes as it came."""
    config = ProcessorConfig(max_body_bytes=LIMIT, hold_timeout_s=600.0)
    assert routed_body(reply(send(StreamProcessor(router, config, clock), priority=-99)))["priority"] == -99
    declare(router, "low_first")
    r = reply(send(StreamProcessor(router, config, clock), priority=-99))
    assert "priority" not in routed_body(r)
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)  # flow control on, engine_priority off
    r = reply(send(make(router, control), {"x-llm-d-inference-objective": "interactive"}, priority=-99))
    assert "priority" not in routed_body(r)


def test_a_band_goes_past_the_limits_only_at_engines_told_its_band(router: Router) -> None:
    """Interactive's negative headroom lets it past a full fleet only where the engine schedules by
    priority (declared); at engines that do not say, it waits for a slot like any band."""
    policy = FlowPolicy(
        saturation=Saturation(max_in_flight=1),
        band_limits={1: BandLimits(headroom=-1)},
        engine_priority=EnginePriority(),
        objectives={o.name: o for o in (INTERACTIVE, BATCH)},
    )
    control: FlowControl[StreamProcessor] = FlowControl(policy)
    for _ in range(3):
        reply(send(make(router, control), {"x-llm-d-inference-objective": "batch"}))
    held = make(router, control)
    send(held, {"x-llm-d-inference-objective": "interactive"})
    assert held.held is not None  # no endpoint declares priority scheduling: it waits
    declare(router, "low_first")  # the engines register again, now scheduling by priority
    space = flow_room(policy, router, MODEL, NOW, 1)
    assert space is Room.OPEN
    entry = control.next(MODEL, space, NOW)
    assert entry is not None and entry.payload is held
    assert routed_body(reply(held.resume()))["priority"] == -1
    urgent = make(router, control)  # and so does the next one, at once
    r = reply(send(urgent, {"x-llm-d-inference-objective": "interactive"}))
    assert urgent.held is None and routed_body(r)["priority"] == -1


@pytest.mark.parametrize("taken", [False, True])
def test_a_request_routed_from_the_queue_whose_replies_never_go_releases_its_pick_and_records_nothing(
    router: Router, taken: bool
) -> None:
    """The dispatcher routed a held request, but its client left before the shell took the replies: no
    engine sees it (no completion log comes), so close gives back what decide counted and the index keeps
    no record of a prompt nobody sent. Replies the shell took are the usual case: recorded, counted."""
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    fill(router, control)
    proc = make(router, control)
    send(proc, extra={"x-request-id": "held-1"})
    scrape_idle(router)

    def counts() -> dict[str, tuple[int, int, int]]:
        return {
            s.id: (s.outstanding, s.routed_since_scrape - s.completed_since_scrape, s.in_flight)
            for s in router.fleet
        }

    before = counts()
    entry = control.next(MODEL, flow_room(control.policy, router, MODEL, NOW), NOW)
    assert entry is proc.held
    reply(entry.payload.resume())
    decision = proc.decision
    assert decision is not None and decision.served is not None
    if taken:
        proc.undelivered = False  # what the shell does once it has the replies
    proc.close()
    after = counts()
    pick = decision.served.id
    if taken:
        assert decision.recorded
        o, r, f = before[pick]
        assert after == {**before, pick: (o + 1, r + 1, f)}  # counted until its completion log
    else:
        assert not decision.recorded
        assert after == before


@pytest.mark.parametrize("how", ["left_while_held", "routed_never_sent", "routed_and_sent"])
def test_a_held_request_no_engine_got_is_refunded_at_close(router: Router, how: str) -> None:
    """A request held by flow control whose client left (the shell cancels its queue entry; it stays
    :attr:`held`), or one routed from the queue whose replies the shell never took, reached no engine:
    close refunds its reservation. One whose replies went out is charged (no usage read: the reservation)."""
    control: FlowControl[StreamProcessor] = FlowControl(POLICY)
    fill(router, control)
    gate = make_gate()
    proc = make(router, control, gate)
    send(proc, extra=ACME_KEY, max_tokens=50)
    ticket = proc.ticket
    assert proc.held is not None and ticket is not None
    assert gate.budgets.level(ACME, NOW) == 1000 - ticket.reserved
    if how == "left_while_held":
        control.queues.remove(proc.held)  # what dispatcher.cancel does: proc.held stays set
    else:
        scrape_idle(router)
        entry = control.next(MODEL, flow_room(control.policy, router, MODEL, NOW), NOW)
        assert entry is proc.held
        reply(entry.payload.resume())
        if how == "routed_and_sent":
            proc.undelivered = False  # the shell took the replies
    proc.close()
    expected = ticket.reserved if how == "routed_and_sent" else 0
    assert ticket.settled and ticket.charged == expected
    assert gate.budgets.level(ACME, NOW) == 1000 - expected
    assert gate.budgets.charged == {"acme": expected}
