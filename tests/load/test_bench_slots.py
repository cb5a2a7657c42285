"""Smoke run of ``python -m load.bench.slots --quick``: it runs two real llama-servers and writes the
documented JSON shape. Benchmarks are not tests: nothing here asserts a figure."""

from __future__ import annotations

import json
from pathlib import Path

from load.bench import slots

STATS = {"n", "p50", "p90", "p99", "max", "mean"}


def test_slots_quick(tmp_path: Path) -> None:
    out = tmp_path / "slots.json"
    assert slots.main(["--quick", "--out", str(out), "--workdir", str(tmp_path / "work")]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "revision", "parameters", "cases"} <= result.keys()
    assert set(result["cases"]) == {"local_hit", "cold", "restored", "restored_total"}
    for case in result["cases"].values():
        assert case["ttft_ms"].keys() >= STATS and case["ttft_ms"]["n"] == 2
    assert len(result["cases"]["restored"]["cache_n"]) == 2
    assert result["restored_tokens"] > 0 and result["slot_value_bytes"] > 0
    assert result["save_ms"]["n"] == result["restore_ms"]["n"] == 2
