"""The simulator's LoRA slots (load/sim/lora.py) and the engine's use of them: in memory."""

from __future__ import annotations

import pytest

from contracts.digest import chain_seed
from load.sim.engine import Engine, EngineConfig
from load.sim.lora import LoraSlots
from load.sim.timing import TimingModel


def test_slots_load_once_and_evict_the_least_recent_idle_adapter() -> None:
    slots = LoraSlots(2)
    assert slots.use("a", set()) and slots.use("b", {"a"}) and not slots.use("a", set())
    assert slots.loaded == ["b", "a"]
    assert slots.can_run("c", {"a"}) and slots.use("c", {"a"})  # b is idle: evicted
    assert slots.loaded == ["a", "c"] and (slots.loads, slots.evictions) == (3, 1)
    assert not slots.can_run("d", {"a", "c"})  # every slot busy: d waits
    with pytest.raises(ValueError):
        LoraSlots(0)


def test_an_adapter_waits_for_a_slot_while_others_go_first_and_a_load_costs_time() -> None:
    timing = TimingModel(lora_load_s=0.5)
    engine = Engine(EngineConfig(max_loras=1), timing, chain_seed("m"))
    prompt = list(range(1, 40))
    engine.add_request("a", prompt, [1, 2, 3], 0.0, lora="x")
    engine.add_request("b", prompt, [1], 0.0, lora="y")  # its slot is taken by x: waits
    engine.add_request("c", prompt, [1], 0.0)  # the base model: goes ahead of b
    step = engine.schedule(0.0)
    assert step is not None
    assert {s.request_id for s, _ in step.prefill} == {"a", "c"}
    assert step.end - step.start == pytest.approx(timing.step_s(0, 2 * len(prompt)) + 0.5)  # x loaded
    assert engine.lora_requests() == (["x"], ["y"])
    now = step.end
    engine.complete(step)
    while engine.has_work():
        step = engine.schedule(now)
        assert step is not None
        engine.complete(step)
        now = step.end
    assert engine.loras.loaded == ["y"] and engine.loras.loads == 2
