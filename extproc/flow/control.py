"""Flow control's decisions, sans IO: may a request go now, wait, or be shed (``now`` passed in).

:func:`room` reads a model's endpoints: ``NONE`` when none is routable (healthy, not draining, not
ejected), ``FULL`` when every routable one is saturated (:func:`saturated`, limits of its (model,
role) from :meth:`FlowPolicy.saturation_for`, less the request's band's headroom), else ``OPEN``.
:meth:`FlowControl.offer` lets a request go at once only when its model has ``OPEN`` room for its band
and nothing of its priority or higher is queued (so nobody overtakes a waiting request of its band or
above); otherwise it is queued (:class:`~extproc.flow.queue.FlowQueues`), or refused with 429
``queue_full``. With no endpoint at all it waits ``min(waiting_room_s, its band's max_wait_s)`` (then
503 ``no_endpoint``); with ``waiting_room_s = 0``, or for a model nothing declares (``known`` false), it
goes on at once, whatever is queued, and the router answers as it always has. The shell dispatches
queued requests while :func:`room` stays ``OPEN`` (:meth:`FlowControl.next`) and sheds expired ones
with :meth:`FlowControl.error`.

Sibling workers (the ext_procs of one host, :mod:`extproc.control.siblings`) each report the highest
priority they hold queued per model (:meth:`FlowControl.heard`). Strict priority then holds across them:
a request of priority ``p`` for model ``m`` neither goes at once nor leaves the queue while a sibling's
report still trusted reports a queued priority ``> p`` for ``m`` (:meth:`FlowControl.outranked`; equal
priorities both go). A report is trusted until the ``until`` it came with (heard + the siblings'
``EXPIRE_S``; a live sibling refreshes it every heartbeat), so a silent sibling holds nothing back for
longer; a live one holds back only while its higher request is queued, which its own ``max_wait_s`` or
deadline bounds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from contracts.epp import TTFT_DEADLINE_UPSTREAM as _TTFT_DEADLINE_UPSTREAM
from extproc.errors import GatewayError, TooManyRequests, Unavailable
from extproc.fleet import EndpointState
from extproc.flow.policy import EnginePriority, FlowPolicy, Saturation
from extproc.flow.queue import NO_ENDPOINT, QUEUE_FULL, QUEUE_TIMEOUT, SLO_UNATTAINABLE, Entry, FlowQueues

T = TypeVar("T")


class Room(Enum):
    OPEN = "open"
    FULL = "full"
    NONE = "none"


#: With ``max_kv_usage`` set, the most requests routed to an endpoint (by this worker and its siblings)
#: on one reading of its KV cache use: routing does not move the reading, so without a bound one
#: dispatch pass would send the whole queue on a reading below the limit.
KV_ROUTES_PER_READING = 4


def saturated(limits: Saturation, state: EndpointState, headroom: float = 0.0) -> bool:
    """Whether ``state`` can take no more under ``limits`` with ``1 - headroom`` of each (a band's
    headroom, :meth:`FlowPolicy.headroom`): ``max(load, outstanding) >= (1 - headroom) x max_in_flight``
    (the load estimates requests at the engine, the outstanding count is this gateway's own requests not
    yet completed: never fewer than those; one more would exceed it), or ``waiting + routed >= (1 -
    headroom) x max_waiting`` (the last reading's queue, plus what this worker and its siblings routed
    there since it: each may wait), or ``kv_usage >= (1 - headroom) x max_kv_usage`` at the last reading
    or :data:`KV_ROUTES_PER_READING` routed there since it; a missing metric never saturates."""
    share = 1.0 - headroom
    if (
        limits.max_in_flight is not None
        and max(state.load, state.outstanding) >= share * limits.max_in_flight
    ):
        return True
    metrics = state.metrics
    if metrics is None:
        return False
    routed = state.routed_since_scrape + state.sibling_routed
    if limits.max_waiting is not None and metrics.waiting + routed >= share * limits.max_waiting:
        return True
    return (
        limits.max_kv_usage is not None
        and metrics.kv_usage is not None
        and (metrics.kv_usage >= share * limits.max_kv_usage or routed >= KV_ROUTES_PER_READING)
    )


def room(
    policy: FlowPolicy,
    model: str,
    states: Iterable[EndpointState],
    now: float,
    priority: int | None = None,
) -> Room:
    """Whether ``model`` can take a request of band ``priority`` now among ``states`` (those the model's
    route admits), under the limits less the band's headroom at each (``None``: the full limits;
    :meth:`FlowPolicy.headroom_at`: a band past the limits only where the engine is told it)."""
    found = Room.NONE
    for state in states:
        if model not in state.endpoint.models or not state.healthy or state.draining or state.ejected(now):
            continue
        endpoint = state.endpoint
        headroom = policy.headroom_at(priority, endpoint.priority_order)
        if not saturated(policy.saturation_for(model, endpoint.role), state, headroom):
            return Room.OPEN
        found = Room.FULL
    return found


@dataclass(frozen=True, slots=True)
class BodyPriority:
    """What becomes of a routed body's ``priority`` field (:func:`body_priority`): ``value`` is written
    (``None``: nothing written); with ``drop`` the client's own field is removed."""

    value: int | None = None
    drop: bool = False


def body_priority(
    to_engine: EnginePriority | None, band: int | None, declared: Sequence[str | None], client_sent: bool
) -> BodyPriority:
    """The body's ``priority`` for a request of ``band`` (``None``: flow control gave it none) routed to
    endpoints (the pick, then Envoy's fallbacks) whose records declare ``declared`` priority orders,
    under ``flow/engine_priority`` ``to_engine``; ``client_sent``: the client's body has a ``priority``.

    The band is written when every one of them is told in the same order (:meth:`EnginePriority.order_for`;
    one body goes to whichever Envoy reaches). Otherwise nothing is written, and a client's own field is
    removed if any of them would schedule by it, so no client jumps an engine's queue on its own say; a
    client's field to engines that ignore it (or refuse it, as vLLM's V0 engine without priority
    scheduling did) is left as it came."""
    orders = {None if to_engine is None else to_engine.order_for(d) for d in declared}
    if to_engine is not None and band is not None and len(orders) == 1 and None not in orders:
        return BodyPriority(to_engine.value(band, next(iter(orders))))
    trusting = any(d is not None for d in declared) or any(o is not None for o in orders)
    return BodyPriority(None, drop=client_sent and trusting)


@dataclass(frozen=True, slots=True)
class FlowRequest:
    """What flow control knows of a request: its ``model``, band ``priority``, ``flow`` (fairness id),
    fair-share ``cost`` (tokens or 1), body ``size`` in bytes, and TTFT ``deadline`` (monotonic seconds;
    ``None``: none)."""

    model: str
    priority: int
    flow: str
    cost: float
    size: int
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class Offer(Generic[T]):
    """The answer to :meth:`FlowControl.offer`: ``held`` is the queued entry (``None``: go now);
    ``evicted``: sheddable entries pushed out to make room, for the shell to answer 429."""

    held: Entry[T] | None
    evicted: tuple[Entry[T], ...] = ()


@dataclass(frozen=True, slots=True)
class SiblingReport:
    """A sibling worker's highest queued priority per model (a model absent: nothing of it queued there),
    trusted before ``until`` (monotonic seconds)."""

    tops: Mapping[str, int]
    until: float


class FlowControl(Generic[T]):
    """The queues, the policy in force and the siblings' reports; every method takes ``now`` (monotonic
    seconds, the same clock as the reports' ``until``)."""

    def __init__(self, policy: FlowPolicy | None = None) -> None:
        self.queues: FlowQueues[T] = FlowQueues(policy)
        self._siblings: dict[str, SiblingReport] = {}

    @property
    def policy(self) -> FlowPolicy:
        return self.queues.policy

    def apply(self, policy: FlowPolicy) -> None:
        """Put ``policy`` in force (queued requests keep their expiry; new bounds apply to new arrivals)."""
        self.queues.policy = policy

    def offer(
        self, request: FlowRequest, payload: T, space: Room, now: float, known: bool = True
    ) -> Offer[T]:
        """Go, wait or refuse ``request`` given its model's ``space`` for its band (:func:`room` with its
        priority); ``known``: something declares its model (an endpoint, the config, a route: the router's
        :meth:`~extproc.routing.router.Router.knows`), else it is never queued, whatever the waiting room.
        Raises :class:`TooManyRequests` (``queue_full``; ``slo_unattainable`` for a deadline already
        past)."""
        policy = self.policy
        if request.deadline is not None and request.deadline <= now:
            raise self._error(SLO_UNATTAINABLE, request.model)
        if self.goes(request, space, now):
            return Offer(None)
        if space is Room.NONE and (policy.waiting_room_s <= 0 or not known):
            # No waiting room, or a name nothing serves (a typo, a made-up name: no queue per name): the
            # router answers at once (503 no_endpoint, 404 model_not_found).
            return Offer(None)
        waiting_room = space is Room.NONE
        # In the waiting room a band's own bound holds too (a sheddable band's sheddable_max_wait_s).
        limit = policy.limits(request.priority).max_wait_s
        wait = min(policy.waiting_room_s, limit) if waiting_room else None
        pushed = self.queues.push(
            payload,
            model=request.model,
            priority=request.priority,
            flow=request.flow,
            cost=request.cost,
            size=request.size,
            now=now,
            deadline=request.deadline,
            max_wait_s=wait,
            reason=NO_ENDPOINT if waiting_room else QUEUE_TIMEOUT,
        )
        if pushed.entry is None:
            raise self._error(QUEUE_FULL, request.model)
        return Offer(pushed.entry, pushed.evicted)

    def goes(self, request: FlowRequest, space: Room, now: float) -> bool:
        """Whether :meth:`offer` lets ``request`` go at once: ``OPEN`` space for its band, nothing of its
        model queued at its priority or higher, and no sibling outranking it."""
        top = self.queues.top_priority(request.model)
        return (
            space is Room.OPEN
            and (top is None or top < request.priority)
            and not self.outranked(request.model, request.priority, now)
        )

    def next(self, model: str, space: Room, now: float) -> Entry[T] | None:
        """The next queued request of ``model`` to dispatch while it has ``OPEN`` space for the top queued
        band (:func:`room` with :meth:`FlowQueues.top_priority`; strict priority: a lower band never goes
        while a higher one waits) and no sibling outranks it at ``now``, else ``None``."""
        if space is not Room.OPEN:
            return None
        top = self.queues.top_priority(model)
        if top is None or self.outranked(model, top, now):
            return None
        return self.queues.pop(model)

    # -- sibling workers ---------------------------------------------------------------------------------

    def heard(self, sender: str, tops: Mapping[str, int], until: float) -> bool:
        """Take sibling ``sender``'s report (replacing its last): its highest queued priority per model,
        trusted before ``until``. True when a model's reported top fell or left, so a request held back by
        it may go now (the shell runs a dispatch pass)."""
        before = self._siblings.get(sender)
        self._siblings[sender] = SiblingReport(dict(tops), until)
        if before is None:
            return False
        return any(model not in tops or tops[model] < top for model, top in before.tops.items())

    def forget(self, sender: str) -> bool:
        """Drop ``sender``'s report (it went silent or away); True when it reported anything queued."""
        before = self._siblings.pop(sender, None)
        return before is not None and bool(before.tops)

    def sibling_top(self, model: str, now: float) -> int | None:
        """The highest priority a sibling reports queued for ``model`` among the reports trusted at ``now``
        (``None``: none)."""
        tops = [r.tops[model] for r in self._siblings.values() if now < r.until and model in r.tops]
        return max(tops) if tops else None

    def outranked(self, model: str, priority: int, now: float) -> bool:
        """Whether a request of ``priority`` for ``model`` must wait for a sibling's higher one."""
        top = self.sibling_top(model, now)
        return top is not None and top > priority

    def deferred_until(self, now: float) -> float | None:
        """When the first report that now holds back one of this worker's queued models stops being
        trusted (``None``: none holds anything back); the shell runs a dispatch pass then."""
        ends = [
            report.until
            for model, own in self.queues.tops().items()
            for report in self._siblings.values()
            if now < report.until and report.tops.get(model, own) > own
        ]
        return min(ends, default=None)

    def error(self, entry: Entry[T], space: Room) -> GatewayError:
        """The answer to a request shed from the queues (expired or evicted), given its model's ``space``
        now: a waiting-room wait that ends with endpoints present but saturated is a queue timeout."""
        reason = entry.reason
        if reason == NO_ENDPOINT and space is not Room.NONE:
            reason = QUEUE_TIMEOUT
        return self._error(reason, entry.model)

    def _error(self, reason: str, model: str) -> GatewayError:
        retry = self.policy.retry_after_s
        if reason == NO_ENDPOINT:
            return Unavailable(f"No ready endpoint for model `{model}`.", code=NO_ENDPOINT)
        if reason == QUEUE_FULL:
            text = f"The gateway's queue for model `{model}` is full; retry later."
        elif reason == SLO_UNATTAINABLE:
            text = f"No endpoint for model `{model}` can meet the request's deadline."
        else:
            text = f"The request waited too long for a free endpoint for model `{model}`; retry later."
        return TooManyRequests(text, code=reason, retry_after_s=retry)


#: Request headers flow control reads (the Gateway API Inference Extension's names, llm-d's and the older
#: ``x-gateway-inference-*``), and the one it sets upstream.
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
OBJECTIVE_HEADER_OLD = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
FAIRNESS_HEADER_OLD = "x-gateway-inference-fairness-id"
SLO_TTFT_HEADER = "x-llm-d-slo-ttft-ms"
DEADLINE_HEADER = "x-kvgate-deadline-ms"
#: Set on a routed request with a TTFT deadline: the milliseconds left of it when it leaves the gateway
#: (for the engine side; the whole response is bounded only by the model's own timeouts). Defined with the
#: names Envoy shares (contracts/epp.py): the bundled Envoy strips clients' copies.
TTFT_DEADLINE_UPSTREAM = _TTFT_DEADLINE_UPSTREAM
#: The flow of a request with no tenant and no fairness id.
DEFAULT_FLOW = "default"
#: Output tokens a request that sets no ``max_tokens`` is counted for in fair shares by tokens.
DEFAULT_OUTPUT_TOKENS = 256
