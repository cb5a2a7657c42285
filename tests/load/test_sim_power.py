"""The simulator's power model: per-step watts and the cap's slowdown (pure), the engine's energy meter,
and replicas serving dcgm-exporter's format that kvgate's agent reads as it reads a real exporter: an
uncapped H100 and a capped A100, idle and under load."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from agent.power.dcgm import DcgmSource, parse_dcgm
from contracts.digest import chain_seed
from load.sim.engine import Engine, EngineConfig
from load.sim.power import GPU_CLASSES, EnergyMeter, PowerModel
from load.sim.server import DCGM_PATH, SimConfig, SimFleet, power_models
from load.sim.timing import TimingModel
from tests.load.test_sim_server import MODEL, model_dir  # noqa: F401  (the module-scoped fixture)

H100, A100 = GPU_CLASSES["h100"], GPU_CLASSES["a100"]


def test_step_power_between_idle_floor_and_tdp() -> None:
    model = PowerModel(H100)
    lone, _ = model.step(1, 0, 64, 2048)
    assert lone == pytest.approx(70 + 630 * (0.35 + 0.65 / 64))
    assert model.step(64, 0, 64, 2048) == (700.0, 1.0)
    assert model.step(0, 2048, 64, 2048) == (700.0, 1.0)  # a full prefill chunk: TDP


def test_a_cap_lowers_the_clock_by_the_cube_root() -> None:
    capped = PowerModel(H100, cap_w=385.0)  # (385 - 70) / (700 - 70) = 1/2 of the dynamic power
    watts, ratio = capped.step(0, 2048, 64, 2048)
    assert watts == 385.0 and ratio == pytest.approx(0.5 ** (1 / 3))
    assert capped.step(1, 0, 64, 2048)[1] == 1.0  # a light step stays under the cap
    with pytest.raises(ValueError, match="above the idle draw"):
        PowerModel(H100, cap_w=50.0)


def test_energy_meter_integrates_idle_and_steps() -> None:
    meter = EnergyMeter(70.0, 0.0)
    meter.begin(10.0, 12.0, 500.0, 0.8)  # 10 s idle, then a 2 s capped step
    assert meter.watts() == 500.0 and meter.energy_j(11.0) == pytest.approx(700 + 500)
    meter.end(12.0)
    assert meter.energy_j(13.0) == pytest.approx(700 + 1000 + 70) and meter.capped_s == 2.0


def test_engine_steps_follow_speed_and_cap() -> None:
    timing = TimingModel()
    plain = Engine(EngineConfig(), timing, chain_seed("m"))
    slow = Engine(EngineConfig(), timing, chain_seed("m"), power=PowerModel(A100, cap_w=250.0))
    for engine in (plain, slow):
        engine.add_request("r", list(range(2048)), [1, 2], 0.0)
    base, step = plain.schedule(0.0), slow.schedule(0.0)
    assert base is not None and step is not None
    ratio = ((250 - 55) / (400 - 55)) ** (1 / 3)
    assert step.end == pytest.approx(base.end / 0.61 / ratio)
    slow.complete(step)
    assert slow.meter is not None and slow.meter.capped_s == pytest.approx(step.end)
    assert slow.meter.energy_j(step.end) == pytest.approx(250.0 * step.end)


def test_power_models_from_flags() -> None:
    assert power_models(None, None) == ()
    models = power_models("h100,a100", "0,300,0,250")
    assert [(m.gpu.name, m.cap_w) for m in models] == [
        ("h100", None),
        ("a100", 300.0),
        ("h100", None),
        ("a100", 250.0),
    ]
    with pytest.raises(ValueError, match="unknown b200"):
        power_models("b200", None)


@pytest.fixture
async def fleet(model_dir: Path) -> AsyncIterator[SimFleet]:  # noqa: F811
    config = SimConfig(
        MODEL,
        model_dir,
        timing=TimingModel(time_scale=0.2),
        engine=EngineConfig(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64),
        power=(PowerModel(H100), PowerModel(A100, cap_w=200.0)),
    )
    async with SimFleet(config, 2) as fleet:
        yield fleet


async def test_replicas_serve_dcgm_format_that_the_agent_reads(fleet: SimFleet) -> None:
    h100 = DcgmSource("dcgm", f"http://{fleet.addresses[0]}{DCGM_PATH}")
    a100 = DcgmSource("dcgm", f"http://{fleet.addresses[1]}{DCGM_PATH}")
    try:
        idle = await h100.read()
        assert (idle.watts, idle.limit_w, idle.throttled) == (70.0, 700.0, False)
        assert idle.energy_j is not None and idle.energy_j > 0
        assert (await a100.read()).limit_w == 200.0
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": "block prefix token " * 10, "max_tokens": 200, "n": 4}
            busy = [
                asyncio.create_task(http.post(f"http://{address}/v1/completions", json=body))
                for address in fleet.addresses
            ]
            try:
                seen_h100: list[float] = []
                seen_a100: list[bool] = []
                for _ in range(200):
                    seen_h100.append((await h100.read()).watts or 0.0)
                    seen_a100.append(bool((await a100.read()).throttled))
                    if max(seen_h100) > 70.0 and any(seen_a100):
                        break
                    await asyncio.sleep(0.01)
                assert max(seen_h100) > 70.0  # drawing more while it decodes
                assert any(seen_a100)  # four sequences push the A100 past its 200 W cap: SW power cap
            finally:
                for task in busy:
                    task.cancel()
                await asyncio.gather(*busy, return_exceptions=True)
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://{fleet.addresses[1]}{DCGM_PATH}") as resp,
        ):
            text = await resp.text()
        assert 'modelName="NVIDIA A100-SXM4-80GB"' in text and parse_dcgm(text).watts is not None
        assert "DCGM_FI_DEV_POWER_VIOLATION" in text  # us capped, a counter
    finally:
        await h100.aclose()
        await a100.aclose()
