"""The flow-control shell: holds streams until :class:`~extproc.flow.control.FlowControl` lets them go.

Event-driven, on the ext_proc's event loop; nothing polls. :meth:`Dispatcher.wait` gives a held stream a
future. :meth:`Dispatcher.kick` (the gateway calls it when capacity may have freed: an engine completion,
a scrape round, a load update from a feed, a stream's end, a policy or fleet change, a sibling's counts)
schedules one dispatch pass: expired requests are shed (:meth:`Held.shed`), then, per model, queued
requests are routed (:meth:`Held.resume`, which decides with the fleet's state as it is now and counts the
request against its pick) while :func:`space` says the model has room for its top queued band. A timer
fires the pass again at the next expiry. :meth:`Dispatcher.cancel` takes out a stream whose client went
away, so it is never routed; a queued stream whose future is already done or cancelled (its client left
in the same loop turn, before :meth:`Dispatcher.cancel` ran) leaves the queue unrouted too.

Sibling workers (:class:`~extproc.control.siblings.SiblingBus`): after each change of the queues the
dispatcher calls :attr:`Dispatcher.on_tops` if this worker's highest queued priority of some model
changed (the bus sends :meth:`Dispatcher.queued_tops` to the siblings); the bus hands it theirs
(:meth:`Dispatcher.sibling_heard`, :meth:`Dispatcher.sibling_gone`), and a pass runs when a report that
held a request back falls, leaves, or stops being trusted (a timer, as for expiries).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Generic, Protocol, TypeVar

from extproc.errors import GatewayError
from extproc.flow.control import FlowControl, Room
from extproc.flow.queue import Entry

log = logging.getLogger(__name__)

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Held(Protocol[R_co]):
    """A held stream: :meth:`resume` routes it now, :meth:`shed` answers it with an error; either returns
    the stream's replies."""

    def resume(self) -> R_co: ...

    def shed(self, error: GatewayError) -> R_co: ...


H = TypeVar("H", bound=Held[object])


class FlowListener(Protocol):
    """What the metrics hear: each dispatch and each shed (with how long the request waited), and the
    queue depth per (model, priority) after a change."""

    def dispatched(self, model: str, priority: int, waited_s: float) -> None: ...

    def shed(self, model: str, priority: int, reason: str, waited_s: float) -> None: ...

    def depth(self, depth: dict[tuple[str, int], int]) -> None: ...


class Dispatcher(Generic[H, R]):
    """Dispatches ``control``'s queues; ``space(model, priority, now)`` is the model's room now for a
    request of that band (:func:`~extproc.flow.control.room`), ``clock`` monotonic seconds (the
    processors' clock)."""

    def __init__(
        self,
        control: FlowControl[H],
        space: Callable[[str, int, float], Room],
        clock: Callable[[], float],
        listener: FlowListener | None = None,
    ) -> None:
        self.control = control
        self._space = space
        self._clock = clock
        self._listener = listener
        self._futures: dict[int, asyncio.Future[R]] = {}
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        #: Called after this worker's highest queued priority of some model changed (the sibling bus).
        self.on_tops: Callable[[], None] | None = None
        self._tops: dict[str, int] = {}

    def wait(self, entry: Entry[H]) -> asyncio.Future[R]:
        """The future of a held stream's replies (call it before the stream's next ``await``)."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._futures[entry.seq] = future
        self._depth()
        self.kick()
        return future

    def evict(self, entries: tuple[Entry[H], ...]) -> None:
        """Answer entries another request pushed out of a full queue (429 ``queue_full``)."""
        now = self._clock()
        for entry in entries:
            self._shed(entry, now)
        if entries:
            self._depth()

    def cancel(self, entry: Entry[H]) -> None:
        """The held stream's client went away: out of the queue, never routed."""
        if self.control.queues.remove(entry):
            self._depth()
        self._futures.pop(entry.seq, None)

    def kick(self) -> None:
        """Capacity may have freed: run one dispatch pass soon (passes coalesce)."""
        if not self._scheduled and len(self.control.queues):
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        control = self.control
        now = self._clock()
        changed = False
        for entry in control.queues.expire(now):
            self._shed(entry, now)
            changed = True
        queues = control.queues
        for model in queues.models():
            while (top := queues.top_priority(model)) is not None and (
                going := control.next(model, self._space(model, top, now), now)
            ) is not None:
                changed = True
                future = self._futures.get(going.seq)
                if future is None or future.done():
                    # Its client went away in this loop turn (the stream's task cancelled, its handler
                    # not yet run): routing it now would count a request no engine will see.
                    self._futures.pop(going.seq, None)
                    continue
                self._settle(going, going.payload.resume())
                if self._listener is not None:
                    self._listener.dispatched(model, going.priority, now - going.enqueued)
        if changed:
            self._depth()
        self._arm()

    def _shed(self, entry: Entry[H], now: float) -> None:
        error = self.control.error(entry, self._space(entry.model, entry.priority, now))
        log.info(
            "flow control shed a request for model %s (priority %d): %s",
            entry.model,
            entry.priority,
            error.code,
        )
        self._settle(entry, entry.payload.shed(error))
        if self._listener is not None:
            self._listener.shed(entry.model, entry.priority, error.code or entry.reason, now - entry.enqueued)

    def _settle(self, entry: Entry[H], replies: object) -> None:
        future = self._futures.pop(entry.seq, None)
        if future is not None and not future.done():
            future.set_result(replies)  # type: ignore[arg-type]

    def _arm(self) -> None:
        """Fire a pass at the next expiry, or when a sibling's report that holds a request back stops
        being trusted, whichever comes first (one timer, moved when an earlier time appears)."""
        control = self.control
        times = [
            t for t in (control.queues.next_expiry(), control.deferred_until(self._clock())) if t is not None
        ]
        at = min(times, default=None)
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, at
        if at is not None:
            loop = asyncio.get_running_loop()
            delay = max(0.0, at - self._clock())
            self._timer = loop.call_at(loop.time() + delay, self._expired)

    def _expired(self) -> None:
        self._timer, self._timer_at = None, None
        self._run()

    def _depth(self) -> None:
        """The queues changed: tell the metrics their depth, and the siblings a changed top priority."""
        if self._listener is not None:
            self._listener.depth(self.control.queues.depth())
        tops = self.control.queues.tops()
        if tops != self._tops:
            self._tops = tops
            if self.on_tops is not None:
                self.on_tops()

    # -- sibling workers -------------------------------------------------------------------------------

    def queued_tops(self) -> dict[str, int]:
        """This worker's highest queued priority per model with queued requests (for its siblings)."""
        return self.control.queues.tops()

    def sibling_heard(self, sender: str, tops: Mapping[str, int], until: float) -> None:
        """A sibling's report (:meth:`FlowControl.heard`): a pass runs if one of its tops fell or left."""
        if self.control.heard(sender, tops, until):
            self.kick()

    def sibling_gone(self, sender: str) -> None:
        """A sibling went silent or away: its report no longer holds anything back."""
        if self.control.forget(sender):
            self.kick()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
