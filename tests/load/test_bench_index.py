"""Smoke run of ``python -m load.bench.index --quick``: it runs and writes the documented JSON shape.

A benchmark is not a test: nothing here asserts a figure, only that the results file is complete and
that the indexes agreed on what they matched.
"""

from __future__ import annotations

import json
from pathlib import Path

from load.bench import index

STATS = {"p50", "p99", "result"}


def test_index_quick(tmp_path: Path) -> None:
    out = tmp_path / "index.json"
    assert index.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "revision", "parameters", "cells", "goals"} <= result.keys()
    assert result["machine"]["nproc"] >= 1
    (cell,) = result["cells"]
    assert cell["endpoints"] == 8
    assert cell["pairs"] >= result["parameters"]["blocks"]
    for key in ("ingest", "ingest_confirming", "removed"):
        assert cell[key]["block_events_per_s"] > 0
    assert set(cell["match_us"]) == {"precise", "hybrid", "approximate"}
    for cases in cell["match_us"].values():
        assert set(cases) == {"full", "partial", "miss"}
        for figures in cases.values():
            assert figures.keys() == STATS
    precise = cell["match_us"]["precise"]
    for case in ("full", "partial", "miss"):
        for other in ("approximate", "hybrid"):
            assert precise[case]["result"] == cell["match_us"][other][case]["result"]
    assert precise["full"]["result"] == {"e0": 256, "e1": 256}
    assert precise["partial"]["result"] == {"e2": 150, "e3": 128, "e4": 64, "e5": 32}
    assert precise["miss"]["result"] == {}
    assert set(cell["record_us"]["precise"]) == {"new", "held"}
    assert set(cell["clear_ms"]) == {"precise_clear_endpoint", "approximate_drop_endpoint"}
    for kind in ("precise", "approximate"):
        memory = cell["memory"][kind]
        assert memory["tracemalloc_per_pair"] > 0
        assert memory["pairs"] >= result["parameters"]["blocks"]
    assert set(result["goals"]) == {
        "match_256_p50_us",
        "ingest_block_events_per_s",
        "bytes_per_block_endpoint_tracemalloc",
        "bytes_per_block_endpoint_rss",
    }
