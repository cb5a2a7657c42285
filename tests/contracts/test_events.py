"""The feed's ``Load`` grows compatibly: power readings and prefix-cache counters added at the end decode
both ways between an agent and a gateway of different versions."""

from __future__ import annotations

import itertools

import msgspec
import msgspec.structs

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


class LoraLoad(msgspec.Struct, tag="load", array_like=True, frozen=True):
    """``Load`` as it was before the prefix-cache counters (issue 28, the drift alarm)."""

    endpoint: str
    waiting: float
    running: float
    kv_usage: float | None = None
    healthy: bool = True
    draining: bool = False
    gpus: list[Gpu] = msgspec.field(default_factory=list)
    power: list[Power] = msgspec.field(default_factory=list)
    output_tps: float | None = None
    lora_running: list[str] | None = None
    lora_waiting: list[str] | None = None
    max_lora: int | None = None
    lora_slots_used: int | None = None


class LoraBatch(msgspec.Struct, array_like=True, frozen=True):
    source: str
    epoch: int
    seq: int
    events: list[LoraLoad]
    snapshot: bool = False
    ts: float = 0.0


def test_prefix_cache_counters_decode_both_ways() -> None:
    """A gateway older than the counters ignores them; a newer one reads ``None`` from an older agent."""
    new = encode(
        Batch("node-a", 1, 1, [Load("e0", 1.0, 2.0, 0.5, max_lora=2, prefix_hits=5.0, prefix_queries=8.0)])
    )
    assert msgspec.msgpack.decode(new, type=LoraBatch).events[0] == LoraLoad("e0", 1.0, 2.0, 0.5, max_lora=2)
    again = decode_batch(new).events[0]
    assert isinstance(again, Load) and (again.prefix_hits, again.prefix_queries) == (5.0, 8.0)
    old = msgspec.msgpack.encode(LoraBatch("node-a", 1, 1, [LoraLoad("e0", 1.0, 2.0, 0.5, max_lora=2)]))
    load = decode_batch(old).events[0]
    assert isinstance(load, Load) and load.max_lora == 2
    assert (load.prefix_hits, load.prefix_queries) == (None, None)


#: :class:`Gpu` before its energy counter: its fields up to ``energy_mj``, the same wire shape.
OldGpu = msgspec.defstruct(
    "OldGpu",
    [
        (f.name, f.type, f.default)
        for f in itertools.takewhile(lambda f: f.name != "energy_mj", msgspec.structs.fields(Gpu))
    ],
    array_like=True,
    frozen=True,
)


def test_gpu_energy_counter_decodes_both_ways() -> None:
    """An older reader ignores a GPU's energy counter; a newer one reads ``None`` from an older agent."""
    new = msgspec.msgpack.encode(Gpu(0, "H100", power_w=300.0, throttle_reasons=4, energy_mj=9_000))
    assert msgspec.msgpack.decode(new, type=OldGpu) == OldGpu(0, "H100", power_w=300.0, throttle_reasons=4)
    old = msgspec.msgpack.encode(OldGpu(0, "H100", power_w=300.0))
    assert msgspec.msgpack.decode(old, type=Gpu) == Gpu(0, "H100", power_w=300.0, energy_mj=None)
