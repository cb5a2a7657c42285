"""Smoke runs of the benchmarks' ``--quick`` modes: they run and write the documented JSON shape.

Benchmarks are not tests: nothing here asserts a figure, only that the results file is complete.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from load.bench import decision, mixed, overhead, peers, smollm2_dir

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


def test_decision_quick_with_an_exported_model_dir(tmp_path: Path) -> None:
    """``--model-dir``: SmolLM2 exported elsewhere (as load/device carries it), used as given."""
    exported = smollm2_dir(None)
    assert (exported / "tokenizer.json").is_file()
    copy = tmp_path / "model"
    shutil.copytree(exported, copy)
    assert smollm2_dir(copy) == copy
    out = tmp_path / "decision.json"
    assert decision.main(["--quick", "--model-dir", str(copy), "--out", str(out)]) == 0
    assert all(c["latency_us"]["n"] > 0 for c in json.loads(out.read_text())["cells"])


def test_decision_quick_tracing_alternate(tmp_path: Path) -> None:
    """``--tracing alternate``: every other decision traced (spans to an in-memory exporter), both halves
    reported; ``--clock cpu`` times them by the thread's CPU time."""
    out = tmp_path / "decision.json"
    assert decision.main(["--quick", "--tracing", "alternate", "--clock", "cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["parameters"]["tracing"] == "alternate" and result["parameters"]["clock"] == "cpu"
    for cell in result["cells"]:
        assert cell["latency_us"]["n"] > 0 and cell["latency_traced_us"]["n"] > 0
    assert result["spans_exported"] > 0
    assert decision.TRACER is None


def test_decision_quick_interleaved_and_cold(tmp_path: Path) -> None:
    """``--interleave-baseline`` (the whole encodes between timed decisions, the earlier method) and
    ``--evict-mb`` (cold caches before every decision) run and are recorded; the exact lengths are
    measured either way."""
    out = tmp_path / "decision.json"
    assert decision.main(["--quick", "--interleave-baseline", "--evict-mb", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["parameters"]["baseline"] == "interleaved"
    assert result["parameters"]["evict_mib_between_decisions"] == 1
    for cell in result["cells"]:
        assert cell["latency_us"]["n"] > 0 and cell["prompt_tokens"]["n"] > 0
    assert decision.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["parameters"]["baseline"] == "after the timed loop"
    assert all(cell["prompt_tokens"]["n"] > 0 for cell in result["cells"])


@pytest.mark.e2e
def test_overhead_quick(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    assert overhead.main(["--quick", "--no-peers", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {
        "benchmark",
        "command",
        "machine",
        "revision",
        "parameters",
        "cells",
        "cpu_at_saturation",
        "goals",
        "ratios",
        "skipped",
    } <= result.keys()
    targets = {"direct", "envoy_rr", "empty", "gateway", "gateway_2w"}
    assert result["parameters"]["targets"] == [t for t in overhead.TARGETS if t in targets]
    assert result["skipped"] == {}
    assert set(result["cells"]) == {"non_stream/c1", "non_stream/c4", "stream/c1", "stream/c4"}
    for cell in result["cells"].values():
        assert set(cell["targets"]) == targets
        for target in cell["targets"].values():
            assert target["latency_us"].keys() >= STATS
            assert target["completed"] > 0
            assert target["errors"] == 0
        assert {"p50_us", "p99_us", "p50_ratio", "p99_ratio"} <= cell["added"]["gateway_vs_direct"].keys()
        assert {"empty_vs_direct", "gateway_2w_vs_direct", "gateway_vs_empty"} <= cell["added"].keys()
    cpu = result["cpu_at_saturation"]
    assert "extproc_net_ms_per_req" in cpu["gateway"]
    # The floor and the two workers: their ext_procs did work for the requests (CPU summed over both).
    for target in ("empty", "gateway", "gateway_2w"):
        assert cpu[target]["extproc_total_ms_per_req"] > 0
        assert cpu[target]["router_ms_per_req"] >= cpu[target]["extproc_total_ms_per_req"]
    assert cpu["gateway_2w"]["extproc_2w_ms_per_req"] == cpu["gateway_2w"]["extproc_total_ms_per_req"]
    assert {
        "extproc",
        "envoy",
        "sim",
        "envoy_rr",
        "empty_extproc",
        "empty_envoy",
        "extproc_2w",
        "envoy_2w",
    } == (result["idle_cpu_ms_per_s"].keys())
    assert {
        "added_p50_us_c1",
        "added_p99_us_c1",
        "rps_vs_envoy_rr_c4",
        "extproc_cpu_ms_per_req",
        "own_added_p50_us_c1",
        "own_cpu_ms_per_req",
    } == result["goals"].keys()
    assert all(isinstance(g["met"], bool) for g in result["goals"].values())
    assert {"own_share", "rps_vs_envoy_rr_c4", "rps_vs_gateway_c4", "rps_2w_over_1w_c4"} == (
        result["ratios"].keys()
    )


def test_overhead_targets_flag() -> None:
    assert overhead.parse_targets("", no_peers=False) == list(overhead.TARGETS)
    assert overhead.parse_targets("", no_peers=True) == [
        "direct",
        "envoy_rr",
        "empty",
        "gateway",
        "gateway_2w",
    ]
    assert overhead.parse_targets("gateway, empty,vllm-router", no_peers=False) == [
        "empty",
        "gateway",
        "vllm-router",
    ]
    assert overhead.parse_targets("gateway,vllm-router", no_peers=True) == ["gateway"]
    with pytest.raises(ValueError, match="nginx"):
        overhead.parse_targets("gateway,nginx", no_peers=False)


def test_overhead_reports_an_unavailable_peer_as_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_network(spec: peers.PeerSpec) -> Path:
        raise peers.PeerUnavailable(f"{spec.requirement}: install failed: no network")

    monkeypatch.setattr(peers, "install", no_network)
    stack = SimpleNamespace(extproc=object(), envoy=object(), engines=[{"address": "127.0.0.1:9"}])
    with contextlib.ExitStack() as later:
        started, skipped = overhead.start_targets(
            ["direct", "vllm-router"],
            stack,  # type: ignore[arg-type]
            tmp_path,
            1,
            later,
        )
    assert list(started) == ["direct"]
    assert skipped == {"vllm-router": "vllm-router==0.1.17: install failed: no network"}


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
    assert long["long_extproc_cpu_ms_est"] is not None
    assert {"p50", "p99", "p99_rounds"} == agg["ratio_with_long_over_alone"].keys()


def test_load_client_refuses_other_hosts() -> None:
    with pytest.raises(SystemExit):
        overhead.client_main(["--url", "http://example.com/v1", "--concurrency", "1", "--requests", "1"])


def test_overhead_rps_median_of_an_even_count_of_rounds() -> None:
    """``--rounds 2`` (or 4): the requests/s median is the mean of the middle two, not the upper one."""

    def round_(target: str, rps: float) -> dict[str, object]:
        return {
            "stream": False,
            "concurrency": 1,
            "target": target,
            "latencies_us": [100.0],
            "rps": rps,
            "latency_us": {"p50": 100.0},
            "errors": 0,
        }

    rounds = [
        round_("direct", 100.0),
        round_("direct", 300.0),
        round_("gateway", 50.0),
        round_("gateway", 250.0),
    ]
    cell = overhead.aggregate(rounds, ["direct", "gateway"])["non_stream/c1"]
    assert cell["targets"]["direct"]["rps_median"] == 200.0
    assert cell["targets"]["gateway"]["rps_median"] == 150.0
    assert cell["added"]["gateway_vs_direct"]["rps_ratio"] == 0.75


def test_decision_gc_pause_p50_of_an_even_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two gen-0 pauses of 10 and 30 us: their p50 is 20 us, not the longer one."""
    monkeypatch.setattr(decision, "_GC_PAUSES", [(0, 10_000), (0, 30_000)])
    assert decision._gc_summary() == {"gen0": {"n": 2, "pause_p50_us": 20.0, "pause_max_us": 30.0}}
