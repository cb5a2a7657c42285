"""Smoke run of ``python -m load.bench.energy_stack --quick``: two node agents with simulated GPUs behind
each target, full stack (Envoy, agents, feeds), and the documented JSON shape (a benchmark, not a test:
no figure is asserted; sglang-router may be reported skipped where it cannot be installed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from load.bench import energy, energy_stack


@pytest.mark.e2e
def test_energy_stack_quick(tmp_path: Path) -> None:
    out = tmp_path / "energy-stack.json"
    argv = ["--quick", "--out", str(out), "--workdir", str(tmp_path / "work")]
    assert energy_stack.main(argv) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "machine", "revision", "config", "power_model", "cells", "goals", "command"} <= set(
        result
    )
    assert [c["target"] for c in result["cells"]] == list(energy_stack.TARGETS)
    for cell in result["cells"]:
        if "skipped" in cell:
            assert cell["target"] == "sglang-router"
            continue
        assert cell["completed"] == cell["requests"] > 0
        assert cell["joules_per_token"] > 0 and cell["output_tokens_per_s"] > 0
        assert len(cell["energy_j_per_replica"]) == 2 and min(cell["energy_j_per_replica"]) > 0
    assert "2" in result["goals"] and "sources" in result["power_model"]


def test_scheduling_sections() -> None:
    with_power = energy.scheduling(2.0)["profiles"][0]["plugins"]
    without = energy.scheduling(None)["profiles"][0]["plugins"]
    assert {"ref": "power", "weight": 2.0} in with_power and {"ref": "power-cap"} in with_power
    assert not any(r["ref"] in ("power", "power-cap") for r in without)
    assert with_power[-1] == without[-1] == {"ref": "max-score"}


def _cell(target: str, ttft: float | None, over: float) -> dict[str, object]:
    return {
        "target": target,
        "load_rps": 2.0,
        "joules_per_token": 1.0,
        "ttft_p90_s": ttft,
        "time_over_cap_s": over,
    }


def test_goals_without_a_baseline_are_not_met() -> None:
    """kvgate never over the cap: no cut to judge (NaN, not met); no TTFT p90: no TTFT ratio."""
    cells = [_cell("kvgate-power", None, 0.0), _cell("kvgate", 0.2, 0.0), _cell("round-robin", 0.2, 0.0)]
    got = energy_stack.goals(cells, [2.0])["2"]
    assert math.isnan(got["time_over_cap_cut_vs_kvgate"]["value"])
    assert math.isnan(got["time_over_cap_cut_vs_round_robin"])
    assert math.isnan(got["ttft_p90_vs_kvgate"]["value"])
    assert not got["time_over_cap_cut_vs_kvgate"]["met"] and not got["ttft_p90_vs_kvgate"]["met"]
    cells = [_cell("kvgate-power", 0.1, 1.0), _cell("kvgate", 0.2, 20.0), _cell("round-robin", 0.2, 10.0)]
    got = energy_stack.goals(cells, [2.0])["2"]
    assert got["time_over_cap_cut_vs_kvgate"] == {"value": 0.95, "goal": ">= 0.9", "met": True}
    assert got["ttft_p90_vs_kvgate"]["value"] == 0.5 and got["time_over_cap_cut_vs_round_robin"] == 0.9
