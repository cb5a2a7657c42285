"""Smoke run of ``python -m load.bench.kvcached --quick``: it runs and writes the documented JSON shape.

A benchmark is not a test: nothing here asserts a figure, only that the results file is complete.
"""

from __future__ import annotations

import json
from pathlib import Path

from load.bench import kvcached

STATS = {"p50", "p90", "p99"}


def test_kvcached_quick(tmp_path: Path) -> None:
    out = tmp_path / "kvcached.json"
    assert kvcached.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "revision", "parameters", "cells", "goals"} <= result.keys()
    assert result["benchmark"] == "kvcached"
    assert [c["block_bytes"] for c in result["cells"]] == result["parameters"]["sizes"]
    for cell in result["cells"]:
        for mode in kvcached.MODES:
            assert cell[mode].keys() == STATS
            assert cell[mode]["p50"] > 0
        assert cell["ssd_hits"] > 0
        assert cell["ssd_corrupt"] == 0
    assert set(result["goals"]) == {"ram_hit_p99_us", "ssd_hit_p99_us"}
    assert ("peer" in result) == (kvcached.PEER_BENCH is not None)
