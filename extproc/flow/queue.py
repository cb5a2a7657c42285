"""The flow-control queues, sans IO: strict priority bands, fair share between flows, EDF within a flow.

One :class:`FlowQueues` holds every queued request of a gateway, per model. Order of dispatch for a
model (:meth:`FlowQueues.pop`):

1. **Bands** by priority, strictly: nothing of a lower band leaves while a higher band has a request.
2. **Flows** within a band share by self-clocked fair queueing: each backlogged flow carries a start
   tag ``S`` and the band a virtual time ``V``. A flow that becomes backlogged starts at
   ``S = max(V, F)`` (``F``: its last finish tag); the flow with the least ``S`` goes next, then
   ``F = S + cost``, ``V = max(V, F)`` (the finish tag of the latest dispatch: ``V`` advances with
   service) and, if it still has requests, ``S = F``. ``cost`` is what the request consumes (prompt +
   output tokens, or 1 per request: :attr:`~extproc.flow.policy.FlowPolicy.fairness`), so two backlogged
   flows get equal shares of it whatever their arrival rates, and a client that names a new flow for
   each request starts each one at ``V``, behind what a backlogged flow is owed. A flow's ``F`` is at
   most ``V`` once it is dispatched from, so an idle flow has no credit and is dropped at once: a band
   keeps only its backlogged flows (at most its ``max_requests``).
3. **Within a flow**: earliest deadline first; requests without a deadline after those with one, first
   come first served.

Bounds: a request that would exceed its (model, band)'s ``max_requests`` or ``max_bytes``
(:class:`~extproc.flow.policy.BandLimits`) is refused (``queue_full``), unless the band's longest other flow
holds more requests than the arrival's would: then that flow's newest request is dropped for it
(``queue_full``), so one flow's backlog cannot lock the others out of the band. One that would exceed
the model's ``max_queued`` or ``max_queued_bytes`` over all bands first evicts the newest queued request
of the model's lowest sheddable band (priority < 0, lower than its own), and is refused if there is none.
Each request leaves by :meth:`pop`, :meth:`remove` (its client went away) or :meth:`expire` at its
``expires`` time with its ``reason`` (``queue_timeout``, ``slo_unattainable``, ``no_endpoint``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from extproc.flow.policy import BandLimits, FlowPolicy

T = TypeVar("T")

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
SLO_UNATTAINABLE = "slo_unattainable"
NO_ENDPOINT = "no_endpoint"


@dataclass(eq=False, slots=True)
class Entry(Generic[T]):
    """One queued request. ``payload``: the caller's (the stream waiting); ``cost``: its fair-share cost
    (>= 1); ``size``: its body bytes; ``deadline``: monotonic seconds by which its first token is due
    (``None``: none); ``expires``/``reason``: when and why it is shed if still queued; ``queued``: still in
    the queues."""

    payload: T
    model: str
    priority: int
    flow: str
    cost: float
    size: int
    enqueued: float
    expires: float
    reason: str
    deadline: float | None
    seq: int
    queued: bool = True


@dataclass(slots=True)
class _Flow(Generic[T]):
    start: float = 0.0
    finish: float = 0.0
    count: int = 0
    heap: list[tuple[float, int, Entry[T]]] = field(default_factory=list)

    def head(self) -> Entry[T]:
        while not self.heap[0][2].queued:
            heapq.heappop(self.heap)
        return self.heap[0][2]


@dataclass(slots=True)
class _Band(Generic[T]):
    vtime: float = 0.0
    count: int = 0
    bytes: int = 0
    flows: dict[str, _Flow[T]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Pushed(Generic[T]):
    """What :meth:`FlowQueues.push` did: the queued ``entry`` (``None``: refused, ``queue_full``) and the
    sheddable entries it ``evicted`` to make room (each leaves with reason ``queue_full``)."""

    entry: Entry[T] | None
    evicted: tuple[Entry[T], ...] = ()


class FlowQueues(Generic[T]):
    """Every queued request, per model and band (see the module docstring for the order and bounds)."""

    def __init__(self, policy: FlowPolicy | None = None) -> None:
        self.policy = policy or FlowPolicy()
        self._models: dict[str, dict[int, _Band[T]]] = {}
        self._expiry: list[tuple[float, int, Entry[T]]] = []
        self._seq = itertools.count()
        self._gone = 0  # entries that left but may still sit in the expiry heap

    def __len__(self) -> int:
        return sum(b.count for bands in self._models.values() for b in bands.values())

    def models(self) -> list[str]:
        """The models with queued requests."""
        return list(self._models)

    def depth(self) -> dict[tuple[str, int], int]:
        """Queued requests per (model, priority) band, for the metrics."""
        return {(m, p): b.count for m, bands in self._models.items() for p, b in bands.items() if b.count}

    def queued(self, model: str) -> int:
        return sum(b.count for b in self._models.get(model, {}).values())

    def top_priority(self, model: str) -> int | None:
        """The highest priority with a queued request of ``model`` (the band :meth:`pop` takes from next);
        ``None``: nothing of ``model`` is queued."""
        bands = [p for p, b in self._models.get(model, {}).items() if b.count]
        return max(bands) if bands else None

    def tops(self) -> dict[str, int]:
        """:meth:`top_priority` of every model with queued requests (what a worker tells its siblings)."""
        return {m: top for m in self._models if (top := self.top_priority(m)) is not None}

    def push(
        self,
        payload: T,
        *,
        model: str,
        priority: int,
        flow: str,
        cost: float,
        size: int,
        now: float,
        deadline: float | None = None,
        max_wait_s: float | None = None,
        reason: str = QUEUE_TIMEOUT,
    ) -> Pushed[T]:
        """Queue a request; it expires at ``now + max_wait_s`` (default: its band's ``max_wait_s``) with
        ``reason``, or at its ``deadline`` with ``slo_unattainable`` if that comes first."""
        policy = self.policy
        limits = policy.limits(priority)
        bands = self._models.get(model, {})
        own = bands.get(priority)
        if size > limits.max_bytes or size > policy.max_queued_bytes:
            return Pushed(None)
        victims: list[Entry[T]] = []
        if own is not None and (own.count + 1 > limits.max_requests or own.bytes + size > limits.max_bytes):
            dropped = self._fair_drop(own, flow, size, limits)
            if dropped is None:
                return Pushed(None)
            victims.append(dropped)
        count = sum(b.count for b in bands.values()) - len(victims)
        size_queued = sum(b.bytes for b in bands.values()) - sum(v.size for v in victims)
        if count + 1 > policy.max_queued or size_queued + size > policy.max_queued_bytes:
            lower = sorted(
                (e for p, b in bands.items() if p < 0 and p < priority for e in self._entries(b)),
                key=lambda e: (e.priority, -e.seq),
            )
            for victim in lower:
                if count + 1 <= policy.max_queued and size_queued + size <= policy.max_queued_bytes:
                    break
                victims.append(victim)
                count -= 1
                size_queued -= victim.size
            if count + 1 > policy.max_queued or size_queued + size > policy.max_queued_bytes:
                return Pushed(None)
        for victim in victims:
            self.remove(victim)
            victim.reason = QUEUE_FULL
        bands = self._models.setdefault(model, {})
        band = bands.setdefault(priority, _Band())
        evicted = victims
        wait = limits.max_wait_s if max_wait_s is None else max_wait_s
        expires, why = now + wait, reason
        if deadline is not None and deadline < expires:
            expires, why = deadline, SLO_UNATTAINABLE
        seq = next(self._seq)
        entry = Entry(payload, model, priority, flow, max(1.0, cost), size, now, expires, why, deadline, seq)
        fl = band.flows.get(flow)
        if fl is None:
            fl = band.flows[flow] = _Flow(finish=band.vtime)
        if fl.count == 0:
            fl.start = max(band.vtime, fl.finish)
        fl.count += 1
        heapq.heappush(fl.heap, (math.inf if deadline is None else deadline, seq, entry))
        band.count += 1
        band.bytes += size
        heapq.heappush(self._expiry, (expires, seq, entry))
        return Pushed(entry, tuple(evicted))

    @staticmethod
    def _fair_drop(band: _Band[T], flow: str, size: int, limits: BandLimits) -> Entry[T] | None:
        """A full band would refuse a request of ``flow``: the newest request of the band's longest other
        flow when that flow holds more requests than ``flow`` would with this one and dropping it makes
        room (so a heavy flow's backlog cannot lock a light flow out of its band); else ``None``."""
        mine = band.flows.get(flow)
        after = (mine.count if mine is not None else 0) + 1
        longest = max(
            (f for name, f in band.flows.items() if name != flow and f.count),
            key=lambda f: f.count,
            default=None,
        )
        if longest is None or longest.count <= after:
            return None
        victim = max((e for _, _, e in longest.heap if e.queued), key=lambda e: e.seq)
        if band.count > limits.max_requests or band.bytes - victim.size + size > limits.max_bytes:
            return None
        return victim

    @staticmethod
    def _entries(band: _Band[T]) -> list[Entry[T]]:
        return [e for f in band.flows.values() for _, _, e in f.heap if e.queued]

    def pop(self, model: str) -> Entry[T] | None:
        """The next request of ``model`` to dispatch (removed from the queues), or ``None``."""
        bands = self._models.get(model)
        if not bands:
            return None
        priority = max(p for p, b in bands.items() if b.count)
        band = bands[priority]
        fl = min((f for f in band.flows.values() if f.count), key=lambda f: (f.start, f.head().seq))
        entry = fl.head()
        heapq.heappop(fl.heap)
        fl.finish = fl.start + entry.cost
        band.vtime = max(band.vtime, fl.finish)
        if fl.count > 1:
            fl.start = fl.finish
        self._take(band, fl, entry)
        self._tidy(model, priority)
        return entry

    def remove(self, entry: Entry[T]) -> bool:
        """Take a queued request out (its client went away); ``False`` if it had already left."""
        if not entry.queued:
            return False
        band = self._models[entry.model][entry.priority]
        self._take(band, band.flows[entry.flow], entry)
        self._tidy(entry.model, entry.priority)
        return True

    def _take(self, band: _Band[T], fl: _Flow[T], entry: Entry[T]) -> None:
        entry.queued = False
        self._gone += 1
        if self._gone > 64 and self._gone > len(self._expiry) // 2:
            # Entries that left stay in the expiry heap until their time: rebuild it before they pile up.
            self._expiry = [item for item in self._expiry if item[2].queued]
            heapq.heapify(self._expiry)
            self._gone = 0
        fl.count -= 1
        band.count -= 1
        band.bytes -= entry.size
        if fl.count == 0:
            fl.heap.clear()
        elif len(fl.heap) > 2 * fl.count + 8:
            # Entries that left (expired, client gone) stay behind the head until it reaches them: a flow
            # that nobody dispatches from would keep them all (and their streams), so drop them first.
            fl.heap = [item for item in fl.heap if item[2].queued]
            heapq.heapify(fl.heap)

    def _tidy(self, model: str, priority: int) -> None:
        """Drop idle flows that have no credit left (``F <= V``: every idle flow, as ``V`` is at least the
        finish tag of every dispatch), an empty band (nobody is backlogged, so no flow's tags matter any
        more) and an empty model."""
        bands = self._models[model]
        band = bands[priority]
        if band.count == 0:
            del bands[priority]
        else:
            for name in [n for n, f in band.flows.items() if f.count == 0 and f.finish <= band.vtime]:
                del band.flows[name]
        if not bands:
            del self._models[model]

    def next_expiry(self) -> float | None:
        """When the next queued request expires (monotonic seconds), or ``None``."""
        while self._expiry and not self._expiry[0][2].queued:
            heapq.heappop(self._expiry)
        return self._expiry[0][0] if self._expiry else None

    def expire(self, now: float) -> list[Entry[T]]:
        """Take out and return every request whose ``expires`` is at or before ``now``, in expiry order."""
        out: list[Entry[T]] = []
        while self._expiry and self._expiry[0][0] <= now:
            _, _, entry = heapq.heappop(self._expiry)
            if self.remove(entry):
                out.append(entry)
        return out
