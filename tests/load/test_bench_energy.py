"""Smoke run of ``python -m load.bench.energy --quick``: it runs every target and writes the documented
JSON shape (a benchmark, not a test: no figure is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from load.bench import energy


def test_energy_quick(tmp_path: Path) -> None:
    out = tmp_path / "energy.json"
    assert energy.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "machine", "revision", "config", "cells", "summary", "command"} <= result.keys()
    assert {c["target"] for c in result["cells"]} == set(energy.TARGETS)
    for cell in result["cells"]:
        assert cell["completed"] == cell["requests"] > 0
        assert cell["joules_per_token"] > 0 and cell["output_tokens_per_s"] > 0
