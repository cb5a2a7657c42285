"""Flow control's decisions without IO: saturation, room, offer, next and the errors (``now`` passed in)."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest

from contracts.events import EndpointId
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.errors import TooManyRequests, Unavailable
from extproc.fleet import EndpointState
from extproc.flow.control import (
    KV_ROUTES_PER_READING,
    BodyPriority,
    FlowControl,
    FlowRequest,
    Room,
    body_priority,
    room,
    saturated,
)
from extproc.flow.policy import BandLimits, EnginePriority, FlowPolicy, ModelSaturation, Saturation
from extproc.flow.queue import NO_ENDPOINT, QUEUE_FULL, QUEUE_TIMEOUT, SLO_UNATTAINABLE

M = "m"


def state(
    i: int = 1,
    *,
    models: tuple[str, ...] = (M,),
    role: str = "both",
    healthy: bool = True,
    draining: bool = False,
    ejected_until: float = 0.0,
    in_flight: int = 0,
    routed: int = 0,
    running: float | None = None,
    waiting: float = 0.0,
    kv: float | None = None,
    order: str | None = None,
) -> EndpointState:
    """An endpoint's state; ``running`` ``None``: no metrics (never scraped, or stale)."""
    metrics = (
        None if running is None else EngineMetrics(waiting=waiting, running=running, kv_usage=kv, at=0.0)
    )
    ep = Endpoint(EndpointId(f"e{i}"), f"10.0.0.{i}:8000", frozenset(models), role=role, priority_order=order)
    return EndpointState(
        ep,
        healthy=healthy,
        draining=draining,
        ejected_until=ejected_until,
        in_flight=in_flight,
        routed_since_scrape=routed,
        metrics=metrics,
    )


def request(
    *, model: str = M, priority: int = 0, flow: str = "f", deadline: float | None = None
) -> FlowRequest:
    return FlowRequest(model=model, priority=priority, flow=flow, cost=1.0, size=10, deadline=deadline)


# --- saturated -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limits", "endpoint", "expected"),
    [
        # nothing checked: never saturated
        (Saturation(), state(in_flight=100, running=50, waiting=50, kv=1.0), False),
        # in flight, without metrics: the open streams (or the routed count, if higher)
        (Saturation(max_in_flight=4), state(in_flight=3), False),
        (Saturation(max_in_flight=4), state(in_flight=4), True),
        (Saturation(max_in_flight=4), state(in_flight=1, routed=4), True),
        # in flight, with metrics: running + waiting + routed since the scrape
        (Saturation(max_in_flight=4), state(running=2, waiting=1), False),
        (Saturation(max_in_flight=4), state(running=2, waiting=1, routed=1), True),
        # waiting: from the scrape; missing metrics never saturate
        (Saturation(max_waiting=8), state(in_flight=100), False),
        (Saturation(max_waiting=8), state(running=0, waiting=7), False),
        (Saturation(max_waiting=8), state(running=0, waiting=8), True),
        # KV use: from the scrape; an engine that reports none never saturates
        (Saturation(max_kv_usage=0.9), state(in_flight=100), False),
        (Saturation(max_kv_usage=0.9), state(running=0, kv=None), False),
        (Saturation(max_kv_usage=0.9), state(running=0, kv=0.89), False),
        (Saturation(max_kv_usage=0.9), state(running=0, kv=0.9), True),
        # any one signal is enough
        (Saturation(max_waiting=8, max_kv_usage=0.9), state(running=0, waiting=0, kv=0.95), True),
        (Saturation(max_waiting=8, max_in_flight=100), state(running=0, waiting=9), True),
    ],
)
def test_saturated(limits: Saturation, endpoint: EndpointState, expected: bool) -> None:
    assert saturated(limits, endpoint) is expected


@pytest.mark.parametrize(
    ("limits", "endpoint", "headroom", "expected"),
    [
        # a band with headroom h sees (1 - h) x each limit: 8 in flight, h 0.25 -> full at 6
        (Saturation(max_in_flight=8), state(in_flight=5), 0.25, False),
        (Saturation(max_in_flight=8), state(in_flight=6), 0.25, True),
        (Saturation(max_in_flight=8), state(in_flight=6), 0.0, False),
        (Saturation(max_waiting=4), state(running=0, waiting=2), 0.5, True),
        (Saturation(max_waiting=4), state(running=0, waiting=1), 0.5, False),
        (Saturation(max_kv_usage=0.8), state(running=0, kv=0.61), 0.25, True),
        (Saturation(max_kv_usage=0.8), state(running=0, kv=0.59), 0.25, False),
        # negative headroom goes past the limits (engines that preempt lower bands): 8 -> 12
        (Saturation(max_in_flight=8), state(in_flight=11), -0.5, False),
        (Saturation(max_in_flight=8), state(in_flight=12), -0.5, True),
        # no limit: headroom changes nothing
        (Saturation(), state(in_flight=100), 0.9, False),
    ],
)
def test_saturated_with_a_bands_headroom(
    limits: Saturation, endpoint: EndpointState, headroom: float, expected: bool
) -> None:
    assert saturated(limits, endpoint, headroom) is expected


@pytest.mark.parametrize(
    ("limits", "endpoint", "expected"),
    [
        # what was routed there since the reading may wait too: 6 waiting + 2 routed reach 8
        (Saturation(max_waiting=8), state(running=4, waiting=6, routed=1), False),
        (Saturation(max_waiting=8), state(running=4, waiting=6, routed=2), True),
        # KV cache use: at most KV_ROUTES_PER_READING routed on one reading below the limit
        (Saturation(max_kv_usage=0.8), state(running=4, kv=0.1, routed=KV_ROUTES_PER_READING - 1), False),
        (Saturation(max_kv_usage=0.8), state(running=4, kv=0.1, routed=KV_ROUTES_PER_READING), True),
        (Saturation(max_kv_usage=0.8), state(running=4, kv=None, routed=100), False),  # no metric: never
    ],
)
def test_routing_since_the_reading_counts_against_the_scraped_limits(
    limits: Saturation, endpoint: EndpointState, expected: bool
) -> None:
    assert saturated(limits, endpoint) is expected


@pytest.mark.parametrize(
    ("limits", "dispatched"),
    [(Saturation(max_waiting=8), 8), (Saturation(max_kv_usage=0.9), KV_ROUTES_PER_READING)],
)
def test_a_pass_on_one_reading_releases_only_what_the_limit_allows(
    limits: Saturation, dispatched: int
) -> None:
    """The dispatcher's loop on one reading (waiting 0, KV 10 %) with 100 queued: routing counts each
    request against the endpoint as Router.decide does, and the room closes (it released all 100)."""
    endpoint = state(running=4, waiting=0, kv=0.1)
    policy = FlowPolicy(saturation=limits)
    control = FlowControl[int](policy)
    for i in range(100):
        assert control.offer(request(), i, Room.FULL, now=0.0).held is not None
    n = 0
    while control.next(M, room(policy, M, [endpoint], 1.0, 0), 1.0) is not None:
        endpoint.in_flight += 1
        endpoint.routed_since_scrape += 1
        endpoint.outstanding += 1
        n += 1
    assert n == dispatched


# --- room ------------------------------------------------------------------------------------------------

LIMITED = FlowPolicy(saturation=Saturation(max_in_flight=2))
BY_ROLE = FlowPolicy(
    saturation=Saturation(max_in_flight=2),
    models=types.MappingProxyType(
        {
            M: ModelSaturation(
                limits=Saturation(max_in_flight=4),
                roles=types.MappingProxyType({"prefill": Saturation(max_in_flight=1)}),
            )
        }
    ),
)


@pytest.mark.parametrize(
    ("policy", "states", "expected"),
    [
        (LIMITED, [], Room.NONE),
        (LIMITED, [state(in_flight=0)], Room.OPEN),
        (LIMITED, [state(in_flight=2)], Room.FULL),
        (LIMITED, [state(1, in_flight=2), state(2, in_flight=1)], Room.OPEN),
        # not routable: unhealthy, draining, ejected, or serving another model
        (LIMITED, [state(healthy=False)], Room.NONE),
        (LIMITED, [state(draining=True)], Room.NONE),
        (LIMITED, [state(ejected_until=10.1)], Room.NONE),
        (LIMITED, [state(ejected_until=10.0)], Room.OPEN),  # the ejection is over at now = 10
        (LIMITED, [state(models=("other",))], Room.NONE),
        # an unroutable free endpoint does not open a saturated model
        (LIMITED, [state(1, in_flight=2), state(2, healthy=False)], Room.FULL),
        (LIMITED, [state(1, in_flight=2), state(2, draining=True), state(3, ejected_until=11.0)], Room.FULL),
        # no limits at all: never full
        (FlowPolicy(), [state(in_flight=1000)], Room.OPEN),
        # per (model, role): the role's limits, else the model's, else the default
        (BY_ROLE, [state(role="prefill", in_flight=1)], Room.FULL),
        (BY_ROLE, [state(role="decode", in_flight=3)], Room.OPEN),
        (BY_ROLE, [state(role="decode", in_flight=4)], Room.FULL),
        (BY_ROLE, [state(role="prefill", in_flight=1), state(2, role="both", in_flight=3)], Room.OPEN),
    ],
)
def test_room(policy: FlowPolicy, states: list[EndpointState], expected: Room) -> None:
    assert room(policy, M, states, now=10.0) is expected


HEADROOM = FlowPolicy(
    saturation=Saturation(max_in_flight=8),
    band_limits=types.MappingProxyType({0: BandLimits(headroom=0.25), -1: BandLimits(headroom=0.5)}),
)


@pytest.mark.parametrize(
    ("in_flight", "priority", "expected"),
    [
        (5, 0, Room.OPEN),
        (6, 0, Room.FULL),  # batch leaves 2 of 8 slots free
        (6, 1, Room.OPEN),  # a band without headroom of its own sees the full limit
        (7, None, Room.OPEN),
        (8, 1, Room.FULL),
        (3, -1, Room.OPEN),
        (4, -1, Room.FULL),
    ],
)
def test_room_per_band(in_flight: int, priority: int | None, expected: Room) -> None:
    assert room(HEADROOM, M, [state(in_flight=in_flight)], now=0.0, priority=priority) is expected


# --- engines that schedule by priority --------------------------------------------------------------------

#: Batch (0) fills every slot; interactive (1) may go to 1.5x the limit, where the engine is told its band.
PAST = FlowPolicy(
    saturation=Saturation(max_in_flight=8),
    band_limits=types.MappingProxyType({1: BandLimits(headroom=-0.5)}),
    engine_priority=EnginePriority(),
)


@pytest.mark.parametrize(
    ("policy", "order", "in_flight", "priority", "expected"),
    [
        (PAST, "low_first", 11, 1, Room.OPEN),  # 11 < 1.5 x 8 at an engine that orders by priority
        (PAST, "low_first", 12, 1, Room.FULL),  # bounded: 1.5 x 8
        (PAST, "high_first", 11, 1, Room.OPEN),
        (PAST, "low_first", 8, 0, Room.FULL),  # batch: the limit itself
        (PAST, None, 8, 1, Room.FULL),  # an engine that does not say: no going past the limit
        (PAST, None, 7, 1, Room.OPEN),
        # flow/engine_priority off: the engine is never told the band, so nobody goes past the limit
        (replace(PAST, engine_priority=None), "low_first", 8, 1, Room.FULL),
        # an order assumed for every endpoint (the operator's word for engines that declare none)
        (replace(PAST, engine_priority=EnginePriority("low_first")), None, 11, 1, Room.OPEN),
    ],
)
def test_a_band_goes_past_the_limits_only_where_the_engine_is_told_it(
    policy: FlowPolicy, order: str | None, in_flight: int, priority: int, expected: Room
) -> None:
    assert room(policy, M, [state(in_flight=in_flight, order=order)], now=0.0, priority=priority) is expected


def test_room_mixes_endpoints_by_their_own_order() -> None:
    fcfs, ordered = state(1, in_flight=9), state(2, in_flight=9, order="low_first")
    assert room(PAST, M, [fcfs], now=0.0, priority=1) is Room.FULL
    assert room(PAST, M, [fcfs, ordered], now=0.0, priority=1) is Room.OPEN


@pytest.mark.parametrize(
    ("to_engine", "band", "declared", "client_sent", "expected"),
    [
        # vLLM's order: lower first, so the band is negated; SGLang's default: the band itself x scale
        (EnginePriority(), 1, ["low_first"], False, BodyPriority(-1)),
        (EnginePriority(scale=10), 1, ["high_first"], True, BodyPriority(10)),  # the client's replaced
        (EnginePriority(), 0, ["low_first", "low_first"], True, BodyPriority(0)),
        (EnginePriority(), -1, ["low_first"], False, BodyPriority(1)),  # sheddable: after batch
        # one body goes to whichever of pick and fallbacks Envoy reaches: all must read it alike
        (EnginePriority(), 1, ["low_first", "high_first"], True, BodyPriority(None, drop=True)),
        (EnginePriority(), 1, ["low_first", None], False, BodyPriority(None)),
        (EnginePriority(), 1, ["low_first", None], True, BodyPriority(None, drop=True)),
        # an endpoint that declares nothing is told only under an assumed order
        (EnginePriority(), 1, [None], True, BodyPriority(None)),  # left as it came (nothing acts on it there)
        (EnginePriority("high_first", 10), 1, [None], True, BodyPriority(10)),
        (EnginePriority("high_first", 10), 1, ["low_first"], False, BodyPriority(-10)),  # declared wins
        # flow/engine_priority off, or no band: a client never jumps a priority engine's queue itself
        (None, 1, ["low_first"], True, BodyPriority(None, drop=True)),
        (None, None, ["high_first"], True, BodyPriority(None, drop=True)),
        (None, None, ["high_first"], False, BodyPriority(None)),
        (None, None, [None], True, BodyPriority(None)),
        (EnginePriority(), None, ["low_first"], True, BodyPriority(None, drop=True)),
    ],
)
def test_body_priority(
    to_engine: EnginePriority | None,
    band: int | None,
    declared: list[str | None],
    client_sent: bool,
    expected: BodyPriority,
) -> None:
    assert body_priority(to_engine, band, declared, client_sent) == expected


def test_room_of_a_model_without_its_own_limits_uses_the_default() -> None:
    other = state(models=("other",), role="prefill", in_flight=2)
    assert room(BY_ROLE, "other", [other], now=0.0) is Room.FULL
    other = state(models=("other",), role="prefill", in_flight=1)
    assert room(BY_ROLE, "other", [other], now=0.0) is Room.OPEN


# --- offer -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("space", "waiting_room_s", "queued_before", "held", "expires", "reason"),
    [
        (Room.OPEN, 0.0, False, False, None, None),
        (Room.OPEN, 5.0, True, True, 160.0, QUEUE_TIMEOUT),  # no overtaking a queued request
        (Room.FULL, 0.0, False, True, 160.0, QUEUE_TIMEOUT),
        (Room.FULL, 5.0, False, True, 160.0, QUEUE_TIMEOUT),  # the waiting room is for no endpoint only
        (Room.NONE, 0.0, False, False, None, None),  # no waiting room: the router answers
        (Room.NONE, 0.0, True, False, None, None),  # at once, even with something queued (no 429 later)
        (Room.NONE, 5.0, False, True, 105.0, NO_ENDPOINT),
        (Room.NONE, 5.0, True, True, 105.0, NO_ENDPOINT),
    ],
)
def test_offer(
    space: Room,
    waiting_room_s: float,
    queued_before: bool,
    held: bool,
    expires: float | None,
    reason: str | None,
) -> None:
    control = FlowControl[str](FlowPolicy(waiting_room_s=waiting_room_s))
    if queued_before:
        assert control.offer(request(flow="earlier"), "earlier", Room.FULL, now=90.0).held is not None
    before = len(control.queues)
    offer = control.offer(request(), "r", space, now=100.0)
    assert (offer.held is not None) is held
    assert len(control.queues) == before + held
    if offer.held is not None:
        assert offer.held.payload == "r"
        assert (offer.held.expires, offer.held.reason) == (expires, reason)
    assert offer.evicted == ()


@pytest.mark.parametrize(
    ("space", "held"),
    [
        (Room.NONE, False),  # a name nothing declares: the router's 404 at once, no queue for it
        (Room.FULL, True),  # endpoints serve it (known whatever the shell says): it waits for room
    ],
)
@pytest.mark.parametrize("queued_before", [False, True])
def test_the_waiting_room_holds_no_unknown_model(space: Room, held: bool, queued_before: bool) -> None:
    control = FlowControl[str](FlowPolicy(waiting_room_s=5.0))
    if queued_before:
        assert control.offer(request(flow="earlier"), "earlier", Room.FULL, now=90.0).held is not None
    before = len(control.queues)
    offer = control.offer(request(), "r", space, now=100.0, known=False)
    assert (offer.held is not None) is held
    assert len(control.queues) == before + held


@pytest.mark.parametrize(
    ("priority", "waiting_room_s", "expires"),
    [
        (-1, 30.0, 101.0),  # a sheddable band waits at most sheddable_max_wait_s (1 s), there too
        (0, 120.0, 160.0),  # and any band at most its max_wait_s (60 s)
        (0, 5.0, 105.0),
    ],
)
def test_the_waiting_room_keeps_the_bands_own_bound(
    priority: int, waiting_room_s: float, expires: float
) -> None:
    control = FlowControl[str](FlowPolicy(waiting_room_s=waiting_room_s))
    held = control.offer(request(priority=priority), "r", Room.NONE, now=100.0).held
    assert held is not None and (held.expires, held.reason) == (expires, NO_ENDPOINT)


def test_a_higher_band_goes_past_queued_lower_ones_but_not_past_its_own() -> None:
    control = FlowControl[str]()
    assert control.offer(request(priority=0), "batch", Room.FULL, now=0.0).held is not None
    # room for priority 1 (batch sees none, its headroom kept free): it goes at once
    assert control.offer(request(priority=1), "interactive", Room.OPEN, now=1.0).held is None
    assert control.offer(request(priority=1), "late", Room.FULL, now=2.0).held is not None
    # a request of a queued band waits behind it, even with room
    assert control.offer(request(priority=1), "next", Room.OPEN, now=3.0).held is not None
    assert control.offer(request(priority=0), "batch2", Room.OPEN, now=3.0).held is not None
    assert len(control.queues) == 4


def test_offer_goes_when_only_another_model_has_requests_queued() -> None:
    control = FlowControl[str]()
    assert control.offer(request(model="other"), "o", Room.FULL, now=0.0).held is not None
    assert control.offer(request(), "r", Room.OPEN, now=0.0).held is None


def test_a_request_with_a_deadline_expires_with_slo_unattainable_at_its_deadline() -> None:
    control = FlowControl[str]()
    held = control.offer(request(deadline=102.5), "r", Room.FULL, now=100.0).held
    assert held is not None
    assert (held.expires, held.reason) == (102.5, SLO_UNATTAINABLE)


@pytest.mark.parametrize("deadline", [99.0, 100.0])
def test_a_past_deadline_is_refused_as_unattainable(deadline: float) -> None:
    control = FlowControl[str](FlowPolicy(retry_after_s=3))
    with pytest.raises(TooManyRequests) as info:
        control.offer(request(deadline=deadline), "r", Room.FULL, now=100.0)
    assert (info.value.status, info.value.code, info.value.retry_after_s) == (429, SLO_UNATTAINABLE, 3)
    assert len(control.queues) == 0


def test_overflow_raises_queue_full_with_retry_after() -> None:
    policy = FlowPolicy(band_limits=types.MappingProxyType({0: BandLimits(max_requests=2)}), retry_after_s=7)
    control = FlowControl[str](policy)
    for i in range(2):
        assert control.offer(request(), f"r{i}", Room.FULL, now=0.0).held is not None
    with pytest.raises(TooManyRequests) as info:
        control.offer(request(), "r2", Room.FULL, now=0.0)
    exc = info.value
    assert (exc.status, exc.error_type, exc.code) == (429, "rate_limit_error", QUEUE_FULL)
    assert exc.retry_after_s == 7
    assert b'"code":"queue_full"' in exc.body()
    assert len(control.queues) == 2


# --- next ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("space", "pops"), [(Room.OPEN, True), (Room.FULL, False), (Room.NONE, False)])
def test_next_pops_only_while_open(space: Room, pops: bool) -> None:
    control = FlowControl[str]()
    control.offer(request(), "r", Room.FULL, now=0.0)
    entry = control.next(M, space, 0.0)
    assert (entry is not None) is pops
    assert len(control.queues) == (0 if pops else 1)


def test_next_answers_none_for_a_model_with_nothing_queued() -> None:
    control = FlowControl[str]()
    assert control.next(M, Room.OPEN, 0.0) is None


def test_next_follows_the_queues_order() -> None:
    control = FlowControl[str]()
    control.offer(request(priority=0), "low", Room.FULL, now=0.0)
    control.offer(request(priority=1), "high", Room.FULL, now=1.0)
    assert [control.next(M, Room.OPEN, 0.0).payload for _ in range(2)] == ["high", "low"]  # type: ignore[union-attr]


# --- error -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "space", "status", "code"),
    [
        (QUEUE_FULL, Room.FULL, 429, QUEUE_FULL),
        (QUEUE_TIMEOUT, Room.FULL, 429, QUEUE_TIMEOUT),
        (QUEUE_TIMEOUT, Room.NONE, 429, QUEUE_TIMEOUT),
        (SLO_UNATTAINABLE, Room.FULL, 429, SLO_UNATTAINABLE),
        (NO_ENDPOINT, Room.NONE, 503, NO_ENDPOINT),
        # endpoints appeared but are saturated: the wait ended for want of room, not of endpoints
        (NO_ENDPOINT, Room.FULL, 429, QUEUE_TIMEOUT),
        (NO_ENDPOINT, Room.OPEN, 429, QUEUE_TIMEOUT),
    ],
)
def test_error(reason: str, space: Room, status: int, code: str) -> None:
    control = FlowControl[str](FlowPolicy(waiting_room_s=5.0, retry_after_s=4))
    held = control.offer(request(), "r", Room.NONE if reason == NO_ENDPOINT else Room.FULL, now=0.0).held
    assert held is not None
    held.reason = reason
    error = control.error(held, space)
    assert (error.status, error.code) == (status, code)
    if status == 429:
        assert isinstance(error, TooManyRequests)
        assert error.retry_after_s == 4
    else:
        assert isinstance(error, Unavailable)
    assert f"`{M}`" in error.message
    assert b"Traceback" not in error.body()


def test_apply_puts_new_bounds_in_force_for_new_arrivals() -> None:
    control = FlowControl[str]()
    for i in range(2):
        control.offer(request(flow=f"f{i}"), f"r{i}", Room.FULL, now=0.0)
    control.apply(FlowPolicy(band_limits=types.MappingProxyType({0: BandLimits(max_requests=2)})))
    assert control.policy.limits(0).max_requests == 2
    with pytest.raises(TooManyRequests):
        control.offer(request(), "r2", Room.FULL, now=0.0)
    assert len(control.queues) == 2
