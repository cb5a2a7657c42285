"""Smoke run of ``python -m load.bench.render --quick``: it runs and writes the documented JSON shape.

A benchmark is not a test: nothing here asserts a figure, only that the results file is complete.
"""

from __future__ import annotations

import json
from pathlib import Path

from load.bench import render


def test_render_quick(tmp_path: Path) -> None:
    out = tmp_path / "render.json"
    assert render.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "revision", "parameters", "cells"} <= result.keys()
    (cell,) = result["cells"]
    assert cell["target_tokens"] == 1024 and cell["prompt_tokens"]["p50"] > 500
    assert set(cell["stages_us"]) == set(render.STAGES)
    for figures in cell["stages_us"].values():
        assert figures["n"] == result["parameters"]["iterations"] and figures["p50"] > 0
