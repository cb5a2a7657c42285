"""Sibling workers' queued tops (extproc/control/siblings.py): the codec, then two real buses in a temp dir
where a worker's highest queued priority crosses to its sibling, is replaced when it falls, and is
forgotten when the worker goes silent."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from contracts.events import EndpointId
from extproc.control.siblings import Loads, MessageError, SiblingBus, decode, encode_loads
from tests.extproc.control.test_siblings import router
from tests.polling import until

M = "m"
E0 = EndpointId("e0")


def test_queued_tops_ride_on_the_first_datagram_of_a_loads_snapshot() -> None:
    counts = {EndpointId(f"endpoint-{i}"): (i, i) for i in range(1, 50)}
    tops = {M: 2, "other": -1}
    (whole,) = encode_loads("w", counts, tops=tops)
    assert decode(whole) == Loads("w", True, counts, tops)
    parts = [decode(d) for d in encode_loads("w", counts, limit=200, tops=tops)]
    assert len(parts) > 1
    assert [p.tops for p in parts] == [tops] + [{}] * (len(parts) - 1)  # type: ignore[union-attr]
    assert [decode(d) for d in encode_loads("w", {}, tops=tops)] == [Loads("w", True, {}, tops)]
    assert [decode(d) for d in encode_loads("w", {})] == [Loads("w", True, {}, {})]


def test_tops_are_clamped_and_those_that_do_not_fit_are_left_out() -> None:
    (data,) = encode_loads("w", {}, tops={M: 2**40, "low": -(2**40)})
    assert decode(data).tops == {M: 2**31 - 1, "low": -(2**31)}  # type: ignore[union-attr]
    (short,) = encode_loads("w", {E0: (1, 0)}, limit=40, tops={"a" * 30: 1, "b": 2})
    assert len(short) <= 40 and decode(short).tops == {"b": 2}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "data",
    [
        encode_loads("w", {}, tops={M: 1})[0][:-1],  # a model name cut short
        encode_loads("w", {}, tops={M: 1})[0][:-3],  # a priority cut short
        b"KVS1\x02\x01w\x01",  # the version before queued tops
    ],
)
def test_malformed_or_older_loads_are_message_errors(data: bytes) -> None:
    with pytest.raises(MessageError):
        decode(data)


class Flow:
    """A worker's flow-control shell as the bus sees it: fixed tops, and what it heard."""

    def __init__(self) -> None:
        self.on_tops: Callable[[], None] | None = None
        self.tops: dict[str, int] = {}
        self.heard: dict[str, dict[str, int]] = {}
        self.until = 0.0
        self.gone: list[str] = []
        self.kicks = 0

    def queued_tops(self) -> dict[str, int]:
        return dict(self.tops)

    def sibling_heard(self, sender: str, tops: Mapping[str, int], until: float) -> None:
        self.heard[sender] = dict(tops)
        self.until = until

    def sibling_gone(self, sender: str) -> None:
        self.gone.append(sender)

    def kick(self) -> None:
        self.kicks += 1


async def test_a_workers_queued_top_crosses_to_its_sibling_and_expires(tmp_path: Path) -> None:
    directory = tmp_path / "sib"
    flows = [Flow(), Flow()]
    buses = [
        SiblingBus(directory, name, router(), flow=flow, heartbeat_s=0.05, expire_s=0.3)
        for name, flow in (("w-0", flows[0]), ("w-1", flows[1]))
    ]
    for bus in buses:
        bus.start()
    sender, receiver = flows
    try:
        assert sender.on_tops == buses[0].queue_changed
        await until(lambda: receiver.heard.get("w-0") == {}, 5.0)  # the heartbeat: nothing queued
        sender.tops = {M: 1}
        assert sender.on_tops is not None
        sender.on_tops()  # the dispatcher announces a change: sent within coalesce_s
        await until(lambda: receiver.heard.get("w-0") == {M: 1}, 5.0)
        assert receiver.kicks > 0
        assert 0.0 < receiver.until - time.monotonic() <= 0.3  # trusted for expire_s after it was heard
        sender.tops = {}
        sender.on_tops()
        await until(lambda: receiver.heard.get("w-0") == {}, 5.0)
        sender.tops = {M: 3}
        sender.on_tops()
        await until(lambda: receiver.heard.get("w-0") == {M: 3}, 5.0)
        await buses[0].aclose()  # silent now: forgotten after expire_s
        assert sender.on_tops is None
        await until(lambda: receiver.gone == ["w-0"], 5.0)
    finally:
        for bus in buses:
            await bus.aclose()
