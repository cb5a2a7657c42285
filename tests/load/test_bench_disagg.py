"""The prefill/decode disaggregation benchmark (``load.bench.disagg``): its goal arithmetic, its workload,
and a ``--quick`` run writing the documented JSON shape (no figure is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from load.bench import disagg


def test_sessions_share_prefixes_and_fit_the_context() -> None:
    config = disagg.quick_config()
    sessions = disagg.make_sessions(config)
    assert sessions and {s.key for s in sessions} <= {f"prefix-{i}" for i in range(config.prefixes)}
    assert all(s.turns[0].max_tokens == config.output_tokens for s in sessions)
    assert config.prefix_tokens + config.suffix_max + config.output_tokens <= config.max_model_len
    full = disagg.DisaggConfig()
    assert full.prefix_tokens + full.suffix_max + full.output_tokens <= full.max_model_len


def test_every_target_has_the_same_number_of_replicas(tmp_path: Path) -> None:
    config = disagg.DisaggConfig()
    for name in ("kvgate-aggregated", "round-robin"):
        assert disagg.stack_options(name, config, tmp_path).replicas == config.total
    for name, mode, protocol in (
        ("kvgate-disaggregated", "disaggregated", "vllm"),
        ("kvgate-conditional", "conditional", "vllm"),
        ("kvgate-disaggregated-sglang", "disaggregated", "sglang"),
        ("sglang-router-pd", "disaggregated", "sglang"),  # the fleet the router fronts
    ):
        options = disagg.stack_options(name, config, tmp_path)
        assert options.prefill + options.decode == config.total
        assert (options.disaggregation["mode"], options.pd_protocol) == (mode, protocol)
    conditional = disagg.stack_options("kvgate-conditional", config, tmp_path)
    assert conditional.disaggregation["min_uncached_tokens"] == config.min_uncached_tokens


def test_goals_compare_p90s() -> None:
    def row(ttft: float, itl: float) -> dict[str, object]:
        return {"ttft_ms": {"n": 1, "p90": ttft}, "itl_ms": {"n": 1, "p90": itl}}

    got = disagg.goals({"kvgate-aggregated": row(100, 40), "kvgate-conditional": row(110, 10)})
    assert got["conditional_itl_p90_over_aggregated"] == {"value": 0.25, "goal": "<= 0.5", "met": True}
    assert got["conditional_ttft_p90_over_aggregated"]["met"] is True
    assert got["disaggregated_ttft_p90_over_sglang_pd"]["met"] is None  # those targets did not run
    pd = disagg.goals(
        {
            "sglang-router-pd": row(1000, 30),
            "kvgate-disaggregated-sglang": row(500, 30),
            "kvgate-disaggregated": row(700, 30),
        }
    )["disaggregated_ttft_p90_over_sglang_pd"]
    assert (pd["value"], pd["met"], pd["vllm_protocol_ratio"]) == (0.5, True, 0.7)
    missed = disagg.goals({"kvgate-aggregated": row(100, 40), "kvgate-conditional": row(130, 30)})
    assert missed["conditional_itl_p90_over_aggregated"]["met"] is False
    assert missed["conditional_ttft_p90_over_aggregated"]["met"] is False
    assert disagg.goals({})["conditional_itl_p90_over_aggregated"]["met"] is None


@pytest.mark.e2e
def test_disagg_quick(tmp_path: Path) -> None:
    out = tmp_path / "disagg.json"
    assert disagg.main(["--quick", "--no-progress", "--out", str(out)]) == 0
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
    assert set(disagg.SIM_SOURCES) <= result["sim"]["sources"].keys()
    assert set(result["targets"]) == set(disagg.TARGETS)
    # the peer router runs where its wheel installs (load/bench/peers.py); elsewhere it is skipped
    assert set(result["skipped"]) <= {"sglang-router-pd"}
    for name, row in result["targets"].items():
        if name in result["skipped"]:
            continue
        assert row["sent"] == result["requests"] > 0
        for key in ("ttft_ms", "itl_ms"):
            assert row[key].keys() >= {"p50", "p90", "p99"}
        assert {"output_tok_s", "errors", "lost", "replicas"} <= row.keys()
    pd_goal = result["goals"]["disaggregated_ttft_p90_over_sglang_pd"]
    assert pd_goal["met"] is None if result["skipped"] else isinstance(pd_goal["met"], bool)


def test_help_exits_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        disagg.main(["--help"])
    assert exc.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_flags_set_the_fleet_split_and_the_workload() -> None:
    args = disagg.parser().parse_args(
        ["--prefill", "6", "--decode", "2", "--max-num-batched-tokens", "512", "--output-tokens", "128"]
    )
    config = disagg.config_from(args)
    assert (config.prefill, config.decode, config.total) == (6, 2, 8)
    assert (config.max_num_batched_tokens, config.output_tokens) == (512, 128)
    assert "512" in config.sim_args()
    assert disagg.config_from(disagg.parser().parse_args([])) == disagg.DisaggConfig()
