"""Smoke run of ``python -m load.bench.energy --quick``: it runs every target, the reference points and
the 2x sweep, and writes the documented JSON shape with the power model's parameters and their sources (a
benchmark, not a test: no figure is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from load.bench import energy


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
