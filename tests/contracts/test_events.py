"""The feed's ``Load`` grows compatibly: power readings added at the end decode both ways between an
agent and a gateway of different versions."""

from __future__ import annotations

import msgspec

from contracts.events import Batch, Gpu, Load, Power, decode_batch, encode


class OldLoad(msgspec.Struct, tag="load", array_like=True, frozen=True):
    """``Load`` as it was before power readings (issue 20)."""

    endpoint: str
    waiting: float
    running: float
    kv_usage: float | None = None
    healthy: bool = True
    draining: bool = False
    gpus: list[Gpu] = msgspec.field(default_factory=list)


class OldBatch(msgspec.Struct, array_like=True, frozen=True):
    source: str
    epoch: int
    seq: int
    events: list[OldLoad]
    snapshot: bool = False
    ts: float = 0.0


def test_a_new_receiver_reads_an_old_load() -> None:
    old = msgspec.msgpack.encode(OldBatch("node-a", 1, 1, [OldLoad("e0", 1.0, 2.0, 0.5)]))
    load = decode_batch(old).events[0]
    assert isinstance(load, Load) and load.power == [] and load.running == 2.0


def test_an_old_receiver_ignores_power() -> None:
    power = Power("bmc", "redfish", watts=352.5, limit_w=500.0, temperature_c=39.0, at=1.0)
    new = encode(Batch("node-a", 1, 1, [Load("e0", 1.0, 2.0, 0.5, power=[power])]))
    old = msgspec.msgpack.decode(new, type=OldBatch)
    assert old.events[0] == OldLoad("e0", 1.0, 2.0, 0.5)
    again = decode_batch(new).events[0]
    assert isinstance(again, Load) and again.power == [power]
