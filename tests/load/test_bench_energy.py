"""Smoke run of ``python -m load.bench.energy --quick``: it runs every target, the reference points and
the 2x sweep, and writes the documented JSON shape with the power model's parameters and their sources (a
benchmark, not a test: no figure is asserted)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from load.bench import energy, percentile


def test_energy_quick(tmp_path: Path) -> None:
    out = tmp_path / "energy.json"
    assert energy.main(["--quick", "--references", "--sweep", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    keys = {"benchmark", "machine", "revision", "config", "power_model", "cells", "summary", "sweep"}
    assert keys | {"command"} <= result.keys()
    assert {c["target"] for c in result["cells"]} == {*energy.TARGETS, *energy.REFERENCES}
    for cell in result["cells"]:
        assert cell["completed"] == cell["requests"] > 0
        assert cell["joules_per_token"] > 0 and cell["output_tokens_per_s"] > 0
    model = result["power_model"]
    assert {"h100.max_w", "a100.max_w", "idle_w", "floor"} <= model["sources"].keys()
    assert {r["gpu"] for r in model["replicas"].values()} == {"h100", "a100"}
    assert {(r["parameter"], r["factor"]) for r in result["sweep"]} == {
        (name, f) for name, factors in energy.SWEEP for f in factors
    }
    assert all("2.0" in r and "order_holds" in r["2.0"] for r in result["sweep"])


def _cell(target: str, ttft: float | None, capped: float) -> dict[str, object]:
    return {
        "target": target,
        "load_rps": 5.0,
        "joules_per_token": 1.0,
        "ttft_p90_s": ttft,
        "time_at_cap_s": capped,
    }


def test_goals_without_a_baseline_are_not_met() -> None:
    """kvgate never at the cap: there is no time to cut, so the cut is undefined (NaN), not a met 100 %;
    a target without a TTFT p90 (nothing completed) has no TTFT ratio either."""
    cells = [_cell("kvgate-power", None, 0.0), _cell("kvgate", 0.2, 0.0), _cell("round-robin", 0.2, 0.0)]
    got = energy.goals(cells, [5.0])["5.0"]
    assert math.isnan(got["time_at_cap_cut"]) and math.isnan(got["time_at_cap_cut_vs_round_robin"])
    assert math.isnan(got["ttft_p90_vs_kvgate"])
    assert got["met"]["time_at_cap"] is False and got["met"]["ttft_p90"] is False
    cells = [_cell("kvgate-power", 0.1, 1.0), _cell("kvgate", 0.2, 20.0), _cell("round-robin", 0.2, 0.0)]
    got = energy.goals(cells, [5.0])["5.0"]
    assert got["time_at_cap_cut"] == 0.95 and got["met"]["time_at_cap"] is True
    assert got["ttft_p90_vs_kvgate"] == 0.5 and math.isnan(got["time_at_cap_cut_vs_round_robin"])


def test_ttft_p90_by_the_shared_percentile_rule() -> None:
    """energy's TTFT p90 is :func:`load.bench.percentile`'s (linear interpolation between ranks), the
    rule energy_stack and the other benches use, so the same TTFTs read the same p90 in both (the floor
    rank it used before read 9.0 here, not 9.1)."""
    ttfts = [float(v) for v in (10, 3, 7, 1, 9, 5, 2, 8, 6, 4)]
    assert energy._p90(ttfts) == percentile(sorted(ttfts), 90) == 9.1
    assert energy._p90([]) is None
