"""Smoke run of ``python -m load.bench.staleness --quick``: it runs (a real etcd, one agent with a simulated
replica, two in-process gateways) and writes the documented JSON shape. No figure is asserted beyond what
makes the run meaningful: every sample saw its prompt reach the precise index, never the approximate one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from load.bench import staleness

STATS = {"n", "p50", "p90", "p99", "max", "mean"}
SIGNALS = {"send_to_engine_event_ms", "engine_event_to_index_ms", "send_to_index_ms", "send_to_load_ms"}


@pytest.mark.e2e
def test_staleness_quick(tmp_path: Path) -> None:
    out = tmp_path / "staleness.json"
    assert staleness.main(["--quick", "--out", str(out), "--workdir", str(tmp_path / "run")]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "revision", "parameters", "precise", "approximate"} <= (
        result.keys()
    )
    assert result["benchmark"] == "staleness" and "--quick" in result["command"]
    assert result["machine"]["nproc"] >= 1
    assert result["precise"].keys() == SIGNALS | {"feed_hop_ms"}
    samples = result["parameters"]["samples"]
    for name in SIGNALS:
        assert result["precise"][name].keys() >= STATS | {"missing"}
    for name in ("engine_event_to_index_ms", "send_to_index_ms"):
        assert result["precise"][name]["n"] == samples and result["precise"][name]["missing"] == 0
    assert result["precise"]["feed_hop_ms"]["n"] > 0
    assert result["approximate"] == {"samples": samples, "visible": 0, "visible_at_end": 0}
    assert result["other_cpu_cores"] >= 0
    assert len(result["samples"]) == samples and all(s["blocks"] > 1 for s in result["samples"])
