"""Sibling workers share cascade gate verdicts (extproc/control/siblings.py, kind 5): the codec, then two
real buses on a directory, each worker's preroute learner learning from the other's verdicts."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from extproc.cascade.gate import Verdict
from extproc.cascade.plan import CascadePolicy, Cascader, Run
from extproc.cascade.prior import PrerouteSpec, features
from extproc.cascade.spec import CascadeSpec
from extproc.control.siblings import (
    MessageError,
    SiblingBus,
    Verdicts,
    decode,
    encode_verdicts,
)
from tests.extproc.control.test_siblings import router
from tests.polling import until

SPEC = CascadeSpec(("small", "large"), -0.5, preroute=PrerouteSpec(above=0.7, min_seen=2, explore=0.0))


def test_verdicts_round_trip_and_split_at_the_datagram_limit() -> None:
    records = [("auto", i % 2 == 0, tuple(range(i, i + 40))) for i in range(30)]
    datagrams = encode_verdicts("w-0", records, limit=1_000)
    assert len(datagrams) > 1 and all(len(d) <= 1_000 for d in datagrams)
    got: list[tuple[str, bool, tuple[int, ...]]] = []
    for data in datagrams:
        message = decode(data)
        assert isinstance(message, Verdicts) and message.sender == "w-0"
        got += message.records
    assert got == records
    (one,) = encode_verdicts("w-0", [("m", True, (0, 2**32 - 1))])
    assert decode(one) == Verdicts("w-0", [("m", True, (0, 2**32 - 1))])
    with pytest.raises(MessageError):
        decode(one[:-1])  # a feature cut short
    with pytest.raises(MessageError):
        decode(one.replace(b"\x00\x01\x01\x00\x02m", b"\x00\x01\x07\x00\x02m"))  # escalated is 0 or 1


def cascader() -> Cascader:
    return Cascader(CascadePolicy(types.MappingProxyType({"auto": SPEC})))


def judged(c: Cascader, text: str, *, escalated: bool) -> None:
    """One request for ``auto`` whose first step the gate judged."""
    run = c.start(
        "auto", {"model": "auto", "messages": [{"role": "user", "content": text}]}, chat=True, now=0
    )
    assert isinstance(run, Run) and not run.preskipped
    run.verdicts.append(("small", Verdict(-2.0 if escalated else -0.1, not escalated, "gate")))
    c.learn(run)


async def test_two_workers_learners_learn_from_each_others_verdicts(tmp_path: Path) -> None:
    directory = tmp_path / "sib"
    directory.mkdir(mode=0o700)
    cascades = [cascader(), cascader()]
    buses = [
        SiblingBus(directory, name, router(), cascade=c, heartbeat_s=0.05, expire_s=0.3)
        for name, c in (("w-0", cascades[0]), ("w-1", cascades[1]))
    ]
    for bus in buses:
        bus.start()
    try:
        assert all(c.on_verdict is not None for c in cascades)
        await until(lambda: buses[0].loads.senders == ["w-1"] and buses[1].loads.senders == ["w-0"], 5.0)
        judged(cascades[0], "[hard] the first uncertain question", escalated=True)
        judged(cascades[1], "[hard] the other uncertain question", escalated=True)
        # Each saw one verdict itself and one from its sibling: alone, neither would reach min_seen 2.
        await until(lambda: all(c.priors["auto"].verdicts == 2 for c in cascades), 5.0)
        for c in cascades:
            run = c.start(
                "auto",
                {"model": "auto", "messages": [{"role": "user", "content": "[hard] a third"}]},
                chat=True,
                now=0,
            )
            assert run is not None and run.preskipped  # learnt from two verdicts, one of them a sibling's
        other = Cascader(CascadePolicy(types.MappingProxyType({})))  # no learner for the model: skipped
        other.heard("auto", features("[hard] x"), True)
        assert other.priors == {}
    finally:
        for bus in buses:
            await bus.aclose()
    assert all(c.on_verdict is None for c in cascades)
