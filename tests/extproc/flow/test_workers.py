"""Strict priority across the sibling workers of one host (extproc/flow/control.py, dispatch.py): the rule
with ``now`` injected, then the dispatcher publishing its queued tops and going when a sibling's report
falls, leaves or stops being trusted."""

from __future__ import annotations

import asyncio
import time

import pytest

from extproc.errors import GatewayError
from extproc.flow.control import FlowControl, FlowRequest, Room
from extproc.flow.dispatch import Dispatcher
from extproc.flow.queue import FlowQueues

M = "m"

Report = tuple[str, dict[str, int], float]  # sender, tops, trusted until


def request(priority: int, model: str = M) -> FlowRequest:
    return FlowRequest(model, priority, "f", 1.0, 10)


def control_with(reports: list[Report]) -> FlowControl[str]:
    control: FlowControl[str] = FlowControl()
    for sender, tops, until in reports:
        control.heard(sender, tops, until)
    return control


# --- the queues' tops ------------------------------------------------------------------------------------


def test_top_priority_is_the_highest_band_holding_a_request() -> None:
    q = FlowQueues[str]()
    assert q.top_priority(M) is None and q.tops() == {}
    for name, priority, model in (("a", 0, M), ("b", 2, M), ("c", -1, "other")):
        q.push(name, model=model, priority=priority, flow="f", cost=1.0, size=1, now=0.0)
    assert q.top_priority(M) == 2 and q.tops() == {M: 2, "other": -1}
    popped = q.pop(M)
    assert popped is not None and popped.payload == "b"
    assert q.tops() == {M: 0, "other": -1}
    assert q.expire(now=1e9) and q.tops() == {}


# --- the rule --------------------------------------------------------------------------------------------

RULE = [
    # reports, own priority, now, held back
    ([], 0, 0.0, False),
    ([("b", {M: 1}, 3.0)], 0, 0.0, True),  # a higher request queued at a sibling
    ([("b", {M: 1}, 3.0)], 1, 0.0, False),  # a tie: both may go
    ([("b", {M: 0}, 3.0)], 1, 0.0, False),  # a lower one
    ([("b", {"other": 5}, 3.0)], 0, 0.0, False),  # another model's
    ([("b", {M: 1}, 3.0)], 0, 2.999, True),  # still trusted
    ([("b", {M: 1}, 3.0)], 0, 3.0, False),  # trusted no longer (the starvation guard)
    ([("b", {M: 1}, 3.0), ("c", {M: 2}, 1.0)], 1, 0.5, True),  # c outranks it while trusted
    ([("b", {M: 1}, 3.0), ("c", {M: 2}, 1.0)], 1, 1.5, False),  # then b only ties
    ([("b", {M: 5}, 3.0), ("b", {}, 3.0)], 0, 0.0, False),  # b's next report replaces: emptied
    ([("b", {M: -1}, 3.0)], -2, 0.0, True),  # sheddable bands too
]


@pytest.mark.parametrize(("reports", "priority", "now", "held_back"), RULE)
def test_a_request_waits_while_a_trusted_sibling_report_outranks_it(
    reports: list[Report], priority: int, now: float, held_back: bool
) -> None:
    control = control_with(reports)
    assert control.outranked(M, priority, now) is held_back
    # arriving with room and nothing queued here: it goes at once unless held back
    offer = control.offer(request(priority), "new", Room.OPEN, now)
    assert (offer.held is not None) is held_back
    # queued here while the model was full: the dispatch pass takes it unless held back
    queued = control_with(reports)
    assert queued.offer(request(priority), "waiting", Room.FULL, now).held is not None
    going = queued.next(M, Room.OPEN, now)
    assert (going is None) is held_back
    assert queued.next(M, Room.FULL, now) is None


def test_the_pass_goes_by_this_workers_top_band_first() -> None:
    """Held back is decided for the band that would leave next: this worker's own top."""
    control = control_with([("b", {M: 1}, 3.0)])
    for name, priority in (("low", 0), ("high", 1)):
        assert control.offer(request(priority), name, Room.FULL, 0.0).held is not None
    high = control.next(M, Room.OPEN, 0.0)
    assert high is not None and high.payload == "high"  # ties b's
    assert control.next(M, Room.OPEN, 0.0) is None  # 0 < b's 1
    assert control.next(M, Room.OPEN, 3.0) is not None  # b's report lapsed


@pytest.mark.parametrize(
    ("before", "after", "fell"),
    [
        (None, {M: 1}, False),  # a new sibling holds nothing back that was not already waiting
        ({M: 1}, {M: 1}, False),
        ({M: 1}, {M: 2}, False),
        ({M: 1}, {M: 1, "other": 3}, False),
        ({M: 2}, {M: 1}, True),
        ({M: 1}, {}, True),  # its queue of m emptied
        ({M: 1, "other": 0}, {M: 1}, True),
    ],
)
def test_heard_says_when_a_report_fell_or_left(
    before: dict[str, int] | None, after: dict[str, int], fell: bool
) -> None:
    control: FlowControl[str] = FlowControl()
    if before is not None:
        control.heard("b", before, 3.0)
    assert control.heard("b", after, 4.0) is fell


def test_forget_drops_a_report_and_says_whether_it_held_anything() -> None:
    control = control_with([("b", {M: 1}, 3.0), ("c", {}, 3.0)])
    assert control.forget("c") is False and control.forget("nobody") is False
    assert control.outranked(M, 0, 0.0)
    assert control.forget("b") is True
    assert not control.outranked(M, 0, 0.0) and control.sibling_top(M, 0.0) is None


def test_deferred_until_is_the_first_lapse_of_a_report_holding_something_back() -> None:
    control = control_with(
        [("b", {M: 1}, 3.0), ("c", {M: 2}, 2.0), ("d", {M: 0}, 1.0), ("e", {"other": 9}, 0.5)]
    )
    assert control.deferred_until(0.0) is None  # nothing queued here
    assert control.offer(request(0), "x", Room.FULL, 0.0).held is not None
    assert control.deferred_until(0.0) == 2.0  # d ties, e is another model's
    assert control.deferred_until(2.5) == 3.0
    assert control.deferred_until(3.0) is None


# --- the dispatcher --------------------------------------------------------------------------------------


class Stream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def resume(self) -> list[str]:
        self.log.append(self.name)
        return [f"routed {self.name}"]

    def shed(self, error: GatewayError) -> list[str]:
        return [f"shed {self.name} {error.code}"]


def dispatcher(space: Room = Room.OPEN) -> Dispatcher[Stream, list[str]]:
    return Dispatcher(FlowControl(), lambda model, priority, now: space, time.monotonic)


async def test_the_dispatcher_announces_each_change_of_its_queued_tops() -> None:
    d = dispatcher(Room.FULL)
    calls: list[dict[str, int]] = []
    d.on_tops = lambda: calls.append(d.queued_tops())
    held = []
    for name, priority in (("a", 0), ("b", 0), ("c", 2)):
        offer = d.control.offer(request(priority), Stream(name, []), Room.FULL, time.monotonic())
        assert offer.held is not None
        held.append(offer.held)
        d.wait(offer.held)
    assert calls == [{M: 0}, {M: 2}]  # b changed no top
    d.cancel(held[2])
    d.cancel(held[0])
    d.cancel(held[1])
    assert calls == [{M: 0}, {M: 2}, {M: 0}, {}]
    d.close()


@pytest.mark.parametrize("how", ["emptied", "gone", "lapsed"])
async def test_a_held_back_request_goes_when_the_siblings_report_drops(how: str) -> None:
    d = dispatcher(Room.OPEN)
    log: list[str] = []
    trusted = 0.2 if how == "lapsed" else 60.0
    d.sibling_heard("b", {M: 1}, time.monotonic() + trusted)
    offer = d.control.offer(request(0), Stream("mine", log), Room.OPEN, time.monotonic())
    assert offer.held is not None  # room, but a sibling holds a higher one: it waits
    future = d.wait(offer.held)
    await asyncio.sleep(0)  # the pass wait() scheduled holds it back
    assert log == [] and not future.done()
    if how == "emptied":
        d.sibling_heard("b", {}, time.monotonic() + 60.0)
    elif how == "gone":
        d.sibling_gone("b")
    assert await asyncio.wait_for(future, timeout=5) == ["routed mine"]  # no kick from the test
    d.close()


# --- fairness across two workers -------------------------------------------------------------------------


def test_two_flows_of_one_band_each_get_at_least_45_percent_across_two_workers() -> None:
    """Envoy spreads streams over the workers, so each worker queues its share of both flows of one band
    (flow A sending 4x flow B's rate); each worker's fair queueing is local, and slots free on either
    worker in turn. While both flows stay backlogged, each gets at least 45 % of the dispatches over the
    two workers together (the issue's fairness test, at workers = 2)."""
    workers = [FlowControl[str](), FlowControl[str]()]
    arrivals = 0
    dispatched = {"a": 0, "b": 0}
    for step in range(400):
        for _ in range(4):  # flow a: 4 arrivals per step, flow b: 1
            workers[arrivals % 2].offer(FlowRequest(M, 0, "a", 1.0, 10), "a", Room.FULL, float(step))
            arrivals += 1
        workers[arrivals % 2].offer(FlowRequest(M, 0, "b", 1.0, 10), "b", Room.FULL, float(step))
        arrivals += 1
        for worker in workers:  # two slots free per step, one on each worker
            going = worker.next(M, Room.OPEN, float(step))
            assert going is not None
            dispatched[going.payload] += 1
        if min(len(w.queues) for w in workers) == 0:
            break
    total = sum(dispatched.values())
    assert total >= 400
    assert min(dispatched.values()) / total >= 0.45, dispatched
