"""Fuzzing the feed wire into the gateway (issue 24 part 3): the bytes an agent (or kvcached) sends on
its feed, decoded as the gateway's feed client decodes them (:func:`contracts.events.decode_batch_skewed`,
its gRPC response deserializer), checked for sequence (:class:`SequenceTracker`) and applied by the
:class:`FeedManager` to a real fleet and prefix index, after which the router still decides.

Property: any bytes give a :class:`Batch` or an :class:`EventError`; any decodable batch is applied
without an exception (one would make the client drop the subscription and resync, over and over, for
as long as the agent kept sending it); and a request is then routed or refused with the gateway's typed
error, whatever loads (NaN, infinities, negatives) the feed reported; such a load is refused (counted
malformed), so the fleet never holds a NaN, infinite or negative queue.
"""

from __future__ import annotations

import math
import random
from typing import Any

import msgspec
from hypothesis import example, given
from hypothesis import strategies as st

from contracts.digest import DIGEST_BYTES
from contracts.events import (
    FEED_VERSION,
    Batch,
    EndpointId,
    EventError,
    SequenceTracker,
    Verdict,
    decode_batch_skewed,
    decode_subscribe,
)
from engines.endpoint import Endpoint
from extproc.control.feeds import FeedManager, _Feed
from extproc.errors import GatewayError
from extproc.fleet import Fleet
from extproc.index.hybrid import HybridIndex
from extproc.models.registry import ModelRegistry
from extproc.routing.request import Kind, ParsedRequest
from extproc.routing.router import Router, RoutingPolicy
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile
from tests.fuzz.strategies import FUZZ, edge_ints, json_values

FEED = "127.0.0.1:9999"
IDS = ("e1", "e2", "e3")
numbers = st.floats(allow_nan=True, allow_infinity=True) | edge_ints
digests = st.binary(min_size=DIGEST_BYTES, max_size=DIGEST_BYTES) | st.binary(max_size=20)
endpoint_ids = st.sampled_from(IDS) | st.text(max_size=4)
tiers = st.sampled_from(["gpu", "cpu", "disk", "ram", "ssd", "hbm"])


@st.composite
def event(draw: st.DrawFn) -> list[Any]:
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return ["stored", draw(endpoint_ids), draw(st.lists(digests, max_size=3)), draw(tiers),
                draw(st.none() | digests)]  # fmt: skip
    if kind == 1:
        return ["removed", draw(endpoint_ids), draw(st.lists(digests, max_size=3)), draw(tiers)]
    if kind == 2:
        return ["cleared", draw(endpoint_ids), draw(st.none() | tiers)]
    if kind == 3:
        gpu = [draw(edge_ints), draw(st.text(max_size=4)), *draw(st.lists(st.none() | numbers, max_size=9))]
        power = [draw(st.text(max_size=4)), draw(st.sampled_from(["nvml", "dcgm", "x"])),
                 *draw(st.lists(st.none() | numbers, max_size=7))]  # fmt: skip
        fields = [
            "load",
            draw(endpoint_ids),
            draw(numbers),
            draw(numbers),
            draw(st.none() | numbers),
            draw(st.booleans()),
            draw(st.booleans()),
            draw(st.lists(st.just(gpu), max_size=1)),
            draw(st.lists(st.just(power), max_size=1)),
            draw(st.none() | numbers),
            draw(st.none() | st.lists(st.text(max_size=3), max_size=2)),
            draw(st.none() | st.lists(st.text(max_size=3), max_size=2)),
            draw(st.none() | edge_ints),
            draw(st.none() | edge_ints),
        ]
        return fields[: draw(st.integers(4, len(fields)))]
    return draw(st.lists(json_values(3), max_size=4))


@st.composite
def wire(draw: st.DrawFn, seq: int) -> bytes:
    """A feed message: a batch ``[source, epoch, seq, events, snapshot, ts, version, digest]`` with
    plausible or arbitrary fields, any msgpack, or any bytes."""
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(st.binary(max_size=48))
    if kind == 1:
        return msgspec.msgpack.encode(draw(json_values(8)))
    fields: list[Any] = [
        "node-a",
        1,
        draw(st.just(seq) | edge_ints),
        draw(st.lists(event(), max_size=4)),
        draw(st.booleans()),
        draw(numbers),
        draw(st.just(FEED_VERSION) | st.integers(-1, FEED_VERSION + 2)),
        draw(st.just(1) | st.integers(-1, 3)),
    ]
    return msgspec.msgpack.encode(fields[: draw(st.integers(4, len(fields)))])


def _gateway() -> tuple[FeedManager, Router]:
    endpoints = [
        Endpoint(
            EndpointId(i), f"127.0.0.{n + 1}:8000", frozenset({"m"}), node="node-a", feed=FEED, kv_events=True
        )
        for n, i in enumerate(IDS)
    ]
    fleet, index = Fleet(endpoints), HybridIndex()
    router = Router(
        fleet,
        ModelRegistry([]),
        index,
        RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16),
        rng=random.Random(0),
    )
    return FeedManager(index, fleet, subscriber="fuzz", clock=lambda: 100.0, wall=lambda: 1e9), router


#: A run of feed messages, numbered from 1.
messages = st.integers(1, 6).flatmap(lambda n: st.tuples(*(wire(seq) for seq in range(1, n + 1))))
NAN_LOAD = msgspec.msgpack.encode(
    ["node-a", 1, 1, [["load", "e1", math.nan, math.inf, -math.inf, True, False]], True, math.nan]
)
#: A good load, then NaN and infinite queues for the same endpoint: refused (counted malformed), the
#: good one stays in force (it was applied as is before, a NaN queue reading as idle).
GOOD_THEN_NAN = msgspec.msgpack.encode(
    ["node-a", 1, 1, [["load", "e1", 3.0, 1.0, 0.5, True, False], ["load", "e1", math.nan, 0.0],
                      ["load", "e1", 0.0, -math.inf, 0.2]], True]
)  # fmt: skip


#: Found by this fuzzer: a string that is not UTF-8 raised UnicodeDecodeError, not EventError (msgspec
#: passes it up as it is; contracts.errors.MSGPACK_ERRORS).
NOT_UTF8 = b"\x94\xa2\x80\x80\x01\x01\x90"


@FUZZ
@given(messages=messages)
@example(messages=(NAN_LOAD,))
@example(messages=(NOT_UTF8,))
@example(messages=(GOOD_THEN_NAN,))
def test_feed_bytes_are_decoded_applied_and_routing_goes_on(messages: tuple[bytes, ...]) -> None:
    manager, router = _gateway()
    feed, tracker = _Feed(manager, FEED), SequenceTracker()
    for raw in messages:
        try:
            batch = decode_batch_skewed(raw)
        except EventError:
            continue
        assert isinstance(batch, Batch)
        verdict = tracker.check(batch)
        if verdict in (Verdict.GAP, Verdict.DUPLICATE):
            continue
        if verdict is Verdict.RESET:
            feed.on_reset(batch.source, frozenset(EndpointId(e.endpoint) for e in batch.events))
        feed.on_batch(batch)
    for state in manager.fleet:  # no NaN, infinite or negative queue is ever applied
        if state.metrics is not None:
            assert all(math.isfinite(v) and v >= 0 for v in (state.metrics.waiting, state.metrics.running))
            assert state.metrics.kv_usage is None or math.isfinite(state.metrics.kv_usage)
    request = ParsedRequest(Kind.COMPLETION, "m", {"model": "m", "prompt": [1] * 64}, False, prompt=[1] * 64)
    try:
        decision = router.decide(request, request_id="r1", now=100.0)
    except GatewayError as exc:
        assert 400 <= exc.status < 600
        return
    assert decision.endpoints


@FUZZ
@given(raw=st.binary(max_size=48) | json_values(6).map(msgspec.msgpack.encode))
@example(raw=b"\x81\xaasubscriber\xa1\x80")
def test_subscribe_requests_decode_or_are_refused(raw: bytes) -> None:
    """The other direction: what a subscriber sends an agent's feed server."""
    try:
        request = decode_subscribe(raw)
    except EventError:
        return
    assert isinstance(request.subscriber, str)
