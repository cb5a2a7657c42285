"""The LoRA churn benchmark (``load.bench.lora``): its workload, its goal arithmetic, and a ``--quick`` run
writing the documented JSON shape (no figure is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from load.bench import lora


def test_zipf_popularity_and_sessions_name_adapters() -> None:
    weights = lora.zipf_weights(4, 1.0)
    assert abs(sum(weights) - 1) < 1e-12 and weights == sorted(weights, reverse=True)
    config = lora.quick_config()
    sessions = lora.make_sessions(config)
    assert sessions and all(s.model == s.key and s.model in config.adapter_names for s in sessions)
    assert "--max-loras" in config.sim_args() and len(lora.LoraConfig().adapter_names) == 32


def test_goals_compare_loads_and_ttft_with_every_peer() -> None:
    def row(loads: float, p90: float) -> dict[str, object]:
        return {"adapter_loads_per_1000": loads, "ttft_ms": {"n": 1, "p90": p90}}

    got = lora.goals({"kvgate": row(100, 50), "round-robin": row(400, 80), "least-loaded": row(250, 40)})
    assert got["loads_vs_round-robin"] == {"value": 0.25, "goal": "<= 1/3", "met": True}
    assert got["ttft_p90_vs_round-robin"]["met"] is True
    assert got["loads_vs_least-loaded"]["met"] is False and got["ttft_p90_vs_least-loaded"]["met"] is False
    assert got["loads_vs_vllm-router"]["met"] is None


@pytest.mark.e2e
def test_lora_quick(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    assert lora.main(["--quick", "--no-progress", "--targets", "kvgate,round-robin", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {
        "benchmark",
        "command",
        "machine",
        "revision",
        "config",
        "sim",
        "targets",
        "goals",
    } <= result.keys()
    assert set(lora.SIM_SOURCES) <= result["sim"]["sources"].keys()
    for row in result["targets"].values():
        assert row["sent"] == result["requests"] > 0 and row["served"] > 0
        assert row["adapter_loads"] >= 1 and row["ttft_ms"].keys() >= {"p50", "p90", "p99"}
