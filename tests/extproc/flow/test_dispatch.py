"""The dispatcher on a real event loop: held streams get their replies when a kick finds room, expired
ones are shed by the dispatcher's own timer (no kick needed), cancelled ones never run."""

from __future__ import annotations

import asyncio
import time

from extproc.errors import GatewayError
from extproc.flow.control import FlowControl, FlowRequest, Room
from extproc.flow.dispatch import Dispatcher
from extproc.flow.policy import BandLimits, FlowPolicy


class Stream:
    """A held stream: what it answered, in order."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def resume(self) -> list[str]:
        self.log.append(f"routed {self.name}")
        return [f"routed {self.name}"]

    def shed(self, error: GatewayError) -> list[str]:
        self.log.append(f"shed {self.name} {error.code}")
        return [f"shed {self.name} {error.code}"]


class Listener:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.last_depth: dict[tuple[str, int], int] = {}

    def dispatched(self, model: str, priority: int, waited_s: float) -> None:
        self.events.append(("dispatched", model))

    def shed(self, model: str, priority: int, reason: str, waited_s: float) -> None:
        self.events.append(("shed", reason))

    def depth(self, depth: dict[tuple[str, int], int]) -> None:
        self.last_depth = depth


def request(priority: int = 0, flow: str = "f") -> FlowRequest:
    return FlowRequest("m", priority, flow, 1.0, 10)


def setup(
    policy: FlowPolicy,
) -> tuple[FlowControl[Stream], dict[str, Room], Dispatcher[Stream, list[str]], Listener]:
    control: FlowControl[Stream] = FlowControl(policy)
    space = {"m": Room.FULL}
    listener = Listener()
    dispatcher: Dispatcher[Stream, list[str]] = Dispatcher(
        control, lambda model, priority, now: space[model], time.monotonic, listener
    )
    return control, space, dispatcher, listener


async def test_a_kick_with_room_routes_held_streams_in_priority_order() -> None:
    control, space, dispatcher, listener = setup(FlowPolicy())
    log: list[str] = []
    futures = []
    for name, priority in (("low", 0), ("high", 5)):
        offer = control.offer(request(priority), Stream(name, log), Room.FULL, time.monotonic())
        assert offer.held is not None
        futures.append(dispatcher.wait(offer.held))
    await asyncio.sleep(0)  # the pass wait() scheduled finds no room
    assert log == [] and listener.last_depth == {("m", 0): 1, ("m", 5): 1}
    space["m"] = Room.OPEN
    dispatcher.kick()
    assert await asyncio.gather(*futures) == [["routed low"], ["routed high"]]
    assert log == ["routed high", "routed low"]
    assert listener.events == [("dispatched", "m"), ("dispatched", "m")]
    assert listener.last_depth == {}
    dispatcher.close()


async def test_an_expired_stream_is_shed_by_the_timer_without_a_kick() -> None:
    control, _space, dispatcher, listener = setup(FlowPolicy(bands=BandLimits(max_wait_s=0.05)))
    log: list[str] = []
    offer = control.offer(request(), Stream("a", log), Room.FULL, time.monotonic())
    assert offer.held is not None
    replies = await asyncio.wait_for(dispatcher.wait(offer.held), timeout=5)
    assert replies == ["shed a queue_timeout"]
    assert listener.events == [("shed", "queue_timeout")]
    assert len(control.queues) == 0
    dispatcher.close()


async def test_a_cancelled_stream_is_never_routed() -> None:
    control, space, dispatcher, _listener = setup(FlowPolicy())
    log: list[str] = []
    offer = control.offer(request(), Stream("gone", log), Room.FULL, time.monotonic())
    assert offer.held is not None
    future = dispatcher.wait(offer.held)
    dispatcher.cancel(offer.held)
    space["m"] = Room.OPEN
    dispatcher.kick()
    await asyncio.sleep(0)
    assert log == [] and not future.done() and len(control.queues) == 0
    dispatcher.close()


async def test_evicted_streams_are_answered_at_once() -> None:
    control, _space, dispatcher, listener = setup(FlowPolicy(max_queued=2))
    log: list[str] = []
    low = control.offer(request(-1), Stream("low", log), Room.FULL, time.monotonic())
    batch = control.offer(request(0), Stream("batch", log), Room.FULL, time.monotonic())
    assert low.held is not None and batch.held is not None
    low_future, batch_future = dispatcher.wait(low.held), dispatcher.wait(batch.held)
    urgent = control.offer(request(3), Stream("urgent", log), Room.FULL, time.monotonic())
    assert urgent.held is not None and urgent.evicted == (low.held,)
    dispatcher.evict(urgent.evicted)
    assert low_future.result() == ["shed low queue_full"]
    assert not batch_future.done()
    assert listener.events == [("shed", "queue_full")]
    assert listener.last_depth == {("m", 0): 1, ("m", 3): 1}
    dispatcher.close()


async def test_a_pass_asks_for_room_per_band_and_stops_at_a_band_with_none() -> None:
    """The room a pass asks for is the top queued band's: a band whose headroom leaves it no room stays
    queued while a higher band (room up to the full limit) goes; nothing below a blocked band overtakes."""
    control: FlowControl[Stream] = FlowControl(FlowPolicy())
    asked: list[int] = []

    def space(model: str, priority: int, now: float) -> Room:
        asked.append(priority)
        return Room.OPEN if priority >= 1 else Room.FULL

    dispatcher: Dispatcher[Stream, list[str]] = Dispatcher(control, space, time.monotonic)
    log: list[str] = []
    futures = {}
    for name, priority in (("batch", 0), ("sheddable", -1), ("interactive", 1)):
        offer = control.offer(request(priority), Stream(name, log), Room.FULL, time.monotonic())
        assert offer.held is not None
        futures[name] = dispatcher.wait(offer.held)
    assert await asyncio.wait_for(futures["interactive"], timeout=5) == ["routed interactive"]
    assert log == ["routed interactive"]
    assert 1 in asked and 0 in asked and -1 not in asked
    assert not futures["batch"].done() and not futures["sheddable"].done()
    dispatcher.close()


async def test_a_stream_whose_future_is_cancelled_before_the_pass_is_not_routed() -> None:
    """The stream's task was cancelled (its future with it) but its handler has not yet taken it out of
    the queue when a pass runs: it leaves the queue unrouted."""
    control, space, dispatcher, listener = setup(FlowPolicy())
    log: list[str] = []
    offer = control.offer(request(), Stream("gone", log), Room.FULL, time.monotonic())
    assert offer.held is not None
    future = dispatcher.wait(offer.held)
    future.cancel()
    space["m"] = Room.OPEN
    dispatcher.kick()
    await asyncio.sleep(0)  # the pass kick() scheduled
    assert log == [] and len(control.queues) == 0 and listener.events == []
    dispatcher.cancel(offer.held)  # the handler's own cancel then finds nothing
    dispatcher.close()
