"""Strict priority across two ext_proc workers of one host (issue 17, workers=2), without Envoy: two
workers, each a real router, flow control, dispatcher and sibling bus on one siblings directory, wired as
``extproc/server.py`` wires them, share one engine that holds one request (``max_in_flight = 1``).

Worker A holds a priority-0 request and worker B a priority-1 one; when the engine's one request ends
(its stream ends at A and Envoy's completion log kicks both dispatchers), B's priority-1 request is routed
and A's waits until that one ends too, though A saw the room first.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import orjson

from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.control.siblings import SiblingBus
from extproc.errors import GatewayError
from extproc.fleet import Fleet
from extproc.flow.control import FlowControl, FlowRequest, Room, room
from extproc.flow.dispatch import Dispatcher
from extproc.flow.policy import FlowPolicy, Saturation
from extproc.index.approximate import ApproximateIndex
from extproc.models.registry import ModelRegistry
from extproc.routing.request import Kind, parse_body
from extproc.routing.router import Decision, Router, RoutingPolicy
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile
from tests.polling import until

M = "m"
ENGINE = EndpointId("e0")
POLICY = FlowPolicy(saturation=Saturation(max_in_flight=1))


class Stream:
    """A held request: routed by its worker's router when dispatched."""

    def __init__(self, worker: Worker, name: str) -> None:
        self.worker, self.name = worker, name

    def resume(self) -> Decision:
        return self.worker.route(self.name)

    def shed(self, error: GatewayError) -> Decision:
        raise AssertionError(f"{self.name} shed: {error.code}")


class Worker:
    def __init__(self, directory: Path, name: str, routed: list[str]) -> None:
        fleet = Fleet([Endpoint(ENGINE, "127.0.0.1:1", frozenset({M}))])
        self.router = Router(
            fleet,
            ModelRegistry([]),
            ApproximateIndex(),
            RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16),
            rng=random.Random(0),
        )
        self.routed = routed
        self.control: FlowControl[Stream] = FlowControl(POLICY)
        self.dispatcher: Dispatcher[Stream, Decision] = Dispatcher(self.control, self.space, time.monotonic)
        fleet.watch(self.dispatcher.kick)
        self.bus = SiblingBus(directory, name, self.router, flow=self.dispatcher, heartbeat_s=0.05)

    @property
    def engine_load(self) -> float:
        state = self.router.fleet.get(ENGINE)
        assert state is not None
        return state.load

    def space(self, model: str, priority: int, now: float) -> Room:
        return room(POLICY, model, list(self.router.fleet), now, priority)

    def route(self, name: str) -> Decision:
        body = orjson.dumps({"model": M, "prompt": f"{name} " * 40})
        now = time.monotonic()
        decision = self.router.decide(parse_body(Kind.COMPLETION, body), request_id=name, now=now)
        self.router.commit(decision, now)
        self.routed.append(name)
        return decision

    def hold(self, name: str, priority: int) -> asyncio.Future[Decision]:
        now = time.monotonic()
        offer = self.control.offer(
            FlowRequest(M, priority, "f", 1.0, 10), Stream(self, name), self.space(M, priority, now), now
        )
        assert offer.held is not None, f"{name} was not held"
        return self.dispatcher.wait(offer.held)

    def end(self, decision: Decision) -> None:
        """The request's stream ended at its engine: the stream's end and the completion log."""
        self.router.finish(decision)
        self.router.completed(decision.request_id, time.monotonic())


async def test_the_higher_priority_request_of_another_worker_goes_first(tmp_path: Path) -> None:
    directory = tmp_path / "siblings"
    routed: list[str] = []
    a, b = Worker(directory, "a", routed), Worker(directory, "b", routed)
    for worker in (a, b):
        worker.bus.start()
    try:
        await until(lambda: a.bus.loads.senders == ["b"] and b.bus.loads.senders == ["a"], 5.0)
        first = a.route("first")  # the engine's one slot
        await until(lambda: b.engine_load == 1.0, 5.0)
        low = a.hold("low", 0)
        high = b.hold("high", 1)
        await until(
            lambda: (
                a.control.sibling_top(M, time.monotonic()) == 1
                and b.control.sibling_top(M, time.monotonic()) == 0
            ),
            5.0,
        )
        a.end(first)
        for worker in (a, b):  # the completion log reaches every worker
            worker.dispatcher.kick()
        await until(lambda: len(routed) == 2, 5.0)
        assert routed == ["first", "high"]  # not "low", though A saw the room first
        second = await asyncio.wait_for(high, timeout=5)
        await until(lambda: a.engine_load == 1.0 and a.control.sibling_top(M, time.monotonic()) is None, 5.0)
        assert routed == ["first", "high"] and not low.done()  # the engine is full again: A waits
        b.end(second)
        b.dispatcher.kick()
        a.dispatcher.kick()
        await asyncio.wait_for(low, timeout=5)
        assert routed == ["first", "high", "low"]
    finally:
        for worker in (a, b):
            worker.dispatcher.close()
            await worker.bus.aclose()
