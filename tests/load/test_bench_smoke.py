"""Smoke runs of the benchmarks' ``--quick`` modes: they run and write the documented JSON shape.

Benchmarks are not tests: nothing here asserts a figure, only that the results file is complete.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from load.bench import decision, mixed, overhead

STATS = {"n", "p50", "p90", "p99", "max", "mean"}


def test_decision_quick(tmp_path: Path) -> None:
    out = tmp_path / "decision.json"
    assert decision.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "parameters", "cells", "breakdowns", "goals"} <= result.keys()
    assert result["machine"]["nproc"] >= 1
    assert {(c["turn"], c["endpoints"]) for c in result["cells"]} == {("first", 4), ("follow_up", 4)}
    for cell in result["cells"]:
        assert cell["latency_us"].keys() >= STATS
        assert cell["latency_us"]["n"] > 0
        assert cell["prompt_tokens"]["p50"] > 0
    assert result["cells"][0]["baseline_encode_whole_us"]["n"] > 0
    (breakdown,) = result["breakdowns"]
    assert set(decision.STAGES) | {"total"} == breakdown["stages_us"].keys()
    assert {"prefix", "max-score"} <= breakdown["plugins_us"].keys()
    assert "schedule_4ep_p99_us" in result["goals"]


@pytest.mark.e2e
def test_overhead_quick(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    assert overhead.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "parameters", "cells", "cpu_at_saturation", "goals"} <= (
        result.keys()
    )
    assert set(result["cells"]) == {"non_stream/c1", "non_stream/c4", "stream/c1", "stream/c4"}
    for cell in result["cells"].values():
        assert set(cell["targets"]) == {"direct", "envoy_rr", "gateway"}
        for target in cell["targets"].values():
            assert target["latency_us"].keys() >= STATS
            assert target["errors"] == 0
        assert {"p50_us", "p99_us", "p50_ratio", "p99_ratio"} <= cell["added"]["gateway_vs_direct"].keys()
    assert "extproc_net_ms_per_req" in result["cpu_at_saturation"]["gateway"]
    assert {"extproc", "envoy", "sim", "envoy_rr"} == result["idle_cpu_ms_per_s"].keys()
    assert {"added_p50_us_c1", "added_p99_us_c1"} == result["goals"].keys()


@pytest.mark.e2e
def test_mixed_quick(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    assert mixed.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "parameters", "aggregate", "rounds"} <= result.keys()
    assert [r["condition"] for r in result["rounds"]] == ["alone", "with_long"]
    agg = result["aggregate"]
    for condition in mixed.CONDITIONS:
        assert {"p50", "p90", "p99"} == agg[condition]["short_us"].keys()
        assert agg[condition]["short_count"] > 0
        assert agg[condition]["short_errors"] == 0
        assert agg[condition]["extproc_cpu_ms_per_req"] > 0
    long = agg["with_long"]
    assert long["long_count"] > 0
    assert long["long_errors"] == 0  # routed and answered, not refused for length
    assert long["long_prompt_tokens_p50"] > 3000
    assert {"p50", "p99", "p99_rounds"} == agg["ratio_with_long_over_alone"].keys()


def test_load_client_refuses_other_hosts() -> None:
    with pytest.raises(SystemExit):
        overhead.client_main(["--url", "http://example.com/v1", "--concurrency", "1", "--requests", "1"])
