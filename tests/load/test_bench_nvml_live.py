"""The NVML live bench's arithmetic, its sampling through the agent's telemetry (the fake ``pynvml``), and
its refusal without a GPU. The bench itself runs on the lent GPU machine (BENCHMARKS.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.telemetry import GpuTelemetry
from load.bench import nvml_live
from tests.agent.test_telemetry import H100, fake_pynvml


def test_integrate_j_is_trapezoids() -> None:
    assert nvml_live.integrate_j([0.0, 1.0, 3.0], [100.0, 300.0, 300.0]) == 200.0 + 600.0
    assert nvml_live.integrate_j([5.0], [100.0]) == 0.0


def _row(phase: str, t: float, watts: float, counter: float | None) -> dict[str, object]:
    return {
        "phase": phase,
        "t": t,
        "watts": watts,
        "limit_w": 700.0,
        "sm_clock_mhz": 1980.0,
        "temperature_c": 40.0 + t,
        "throttled": t >= 2.0,
        "utilization": 1.0,
        "counter_j": counter,
        "read_us": 50.0,
    }


def test_summarize_a_phase() -> None:
    readings = [(0.0, 100.0, 0.0), (1.0, 300.0, 210.0), (2.0, 300.0, 500.0)]
    rows = [_row("load", t, w, c) for t, w, c in readings]
    rows.append(_row("idle", 9.0, 80.0, 900.0))
    got = nvml_live.summarize(rows, "load")
    assert (got["samples"], got["seconds"], got["watts_median"], got["watts_max"]) == (3, 2.0, 300.0, 300.0)
    energy = (got["energy_integrated_j"], got["energy_counter_j"], got["integrated_over_counter"])
    assert energy == (500.0, 500.0, 1.0)
    assert (got["throttled_share"], got["temperature_c_max"], got["limit_w"]) == (0.333, 42.0, 700.0)
    assert nvml_live.summarize(rows, "idle") == {"samples": 1}  # too few to integrate


def test_sample_reads_the_agent_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    idle = dict(H100, power_mw=90_000, temp_c=41, reasons=0x1, sm_mhz=345)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([H100, idle]))
    telemetry = GpuTelemetry()
    try:
        row = nvml_live._sample(telemetry, "idle", 0.0)
    finally:
        telemetry.close()
    assert (row["phase"], row["watts"], row["limit_w"], row["throttled"]) == ("idle", 402.5, 1400.0, True)
    assert row["counter_j"] == pytest.approx(2 * H100["energy_mj"] / 1000)  # the agent's energy_j


def test_without_a_gpu_it_writes_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([], init_error="Driver Not Loaded"))
    out = tmp_path / "r.json"
    assert nvml_live.main(["--out", str(out)]) == 1
    assert not out.exists()
