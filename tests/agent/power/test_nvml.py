"""NVML as a power source, through the agent's GpuTelemetry and the fake ``pynvml`` of the telemetry tests
(no GPU here): the node's sums, throttling from clocks event reasons, and no GPU as a reported error."""

from __future__ import annotations

import sys
import threading

import pytest

from agent.power.errors import PowerSourceError
from agent.power.monitor import PowerMonitor
from agent.power.nvml import NvmlSource
from agent.power.reading import from_gpus
from agent.telemetry import GpuTelemetry
from contracts.events import Gpu
from extproc.scheduling.energy import average_watts
from tests.agent.test_telemetry import H100, fake_pynvml


async def test_two_gpus_summed(monkeypatch: pytest.MonkeyPatch) -> None:
    idle = dict(H100, power_mw=90_000, temp_c=41, reasons=0x1, sm_mhz=345)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([H100, idle]))
    gpus = GpuTelemetry()
    monitor = PowerMonitor([(NvmlSource("nvml", gpus.read), 1.0, 2.0)], wall=lambda: 5.0)
    try:
        reading = await monitor.read_once("nvml")
        assert (reading.kind, reading.error, reading.at) == ("nvml", "", 5.0)
        assert (reading.watts, reading.limit_w, reading.temperature_c) == (402.5, 1400.0, 54.0)
        assert reading.throttled is True  # GPU 0 at its SW power cap (0x4)
        assert reading.sm_clock_mhz == pytest.approx((1980 + 345) / 2)
        assert reading.energy_j == pytest.approx(2 * 7_200_000_123 / 1000)  # the counters, summed, in J
    finally:
        await monitor.aclose()
        gpus.close()


async def test_no_gpu_is_a_reported_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([], init_error="Driver Not Loaded"))
    gpus = GpuTelemetry()
    monitor = PowerMonitor([(NvmlSource("nvml", gpus.read), 1.0, 2.0)])
    reading = await monitor.read_once("nvml")
    assert reading.watts is None and reading.error == "no GPU reports its power draw"
    assert monitor.delay("nvml") == 1.0 and (await monitor.read_once("nvml")).error
    assert monitor.delay("nvml") == 2.0  # retried, backing off


def test_from_gpus_limits_only_when_every_gpu_has_one() -> None:
    a = Gpu(0, "a", power_w=300.0, power_limit_w=700.0, throttle_reasons=0x0, energy_mj=5_000)
    b = Gpu(1, "b", power_w=100.0, throttle_reasons=0x100)  # display clocks: not throttling
    sample = from_gpus([a, b])
    assert (sample.watts, sample.limit_w, sample.throttled) == (400.0, None, False)
    assert sample.energy_j is None  # b has no counter: half a node's energy would be no figure at all
    with pytest.raises(PowerSourceError, match="no GPU reports"):
        from_gpus([Gpu(0, "a")])


@pytest.mark.parametrize(
    ("gpu", "match"),
    [
        (Gpu(1, "b", power_w=float("nan")), "GPU 1 power"),
        (Gpu(1, "b", power_w=-5.0), "GPU 1 power"),
        (Gpu(1, "b", power_w=100.0, power_limit_w=float("inf")), "GPU 1 power limit"),
        (Gpu(1, "b", power_w=100.0, temperature_c=4000.0), "GPU 1 temperature"),
        (Gpu(1, "b", power_w=100.0, sm_clock_mhz=-1.0), "GPU 1 SM clock"),
        (Gpu(1, "b", power_w=100.0, energy_mj=-1), "GPU 1 energy counter"),
    ],
)
def test_from_gpus_refuses_implausible_numbers(gpu: Gpu, match: str) -> None:
    """NVML's numbers pass the plausibility checks every source's do (a garbled answer is an error, never
    a reading; from_gpus used to sum whatever NVML said, NaN and negatives included)."""
    with pytest.raises(PowerSourceError, match=match):
        from_gpus([Gpu(0, "a", power_w=300.0, power_limit_w=700.0, energy_mj=5_000), gpu])


async def test_the_energy_counter_gives_the_mean_draw_between_readings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway's energy model reads a node's mean draw between two NVML readings from the counter
    (what the GPUs used over the whole interval), not from the instantaneous watts of the second one."""
    board = dict(H100, power_mw=100_000, energy_mj=1_000_000)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([board]))
    gpus = GpuTelemetry()
    wall = iter([10.0, 14.0, 18.0])
    monitor = PowerMonitor([(NvmlSource("nvml", gpus.read), 1.0, 2.0)], wall=lambda: next(wall))
    try:
        first = await monitor.read_once("nvml")
        board["energy_mj"] += 4 * 650_000  # 650 W on average over the 4 s between the reads
        second = await monitor.read_once("nvml")  # the instantaneous reading is back at 100 W
        assert (first.energy_j, second.energy_j) == (1_000.0, 3_600.0)
        assert second.watts == 100.0 and average_watts(first, second) == pytest.approx(650.0)
        board["energy_mj"] = 0  # the driver was reloaded: the counter restarts, the watts stand in
        assert average_watts(second, await monitor.read_once("nvml")) == 100.0
    finally:
        await monitor.aclose()
        gpus.close()


async def test_a_hung_nvml_holds_one_thread_not_one_per_retry() -> None:
    """NVML that never answers: the first read times out, and each retry while that read's thread still
    waits is a reported error without a new thread (each used to start one more: a hung driver filled
    the loop's default thread pool, shared with DNS lookups and file IO)."""
    release = threading.Event()
    calls: list[int] = []

    def read_gpus() -> list[Gpu]:
        calls.append(1)
        release.wait()
        return [Gpu(0, "a", power_w=100.0)]

    monitor = PowerMonitor([(NvmlSource("nvml", read_gpus), 1.0, 0.05)])
    try:
        first = await monitor.read_once("nvml")
        assert first.watts is None and first.error == "no answer within 0.05 s"
        for _ in range(5):
            again = await monitor.read_once("nvml")
            assert again.watts is None and "still running" in again.error
        assert len(calls) == 1
    finally:
        release.set()
        await monitor.aclose()
