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


def test_repeats_take_the_median_of_each_metric() -> None:
    def run(ttft: float, itl: float, errors: dict[str, int]) -> dict[str, object]:
        return {
            "target": "kvgate-aggregated",
            "served": 10,
            "errors": errors,
            "replicas": {"sim-0": 10},
            "ttft_ms": {"n": 10, "p50": ttft / 2, "p90": ttft},
            "itl_ms": {"n": 90, "p90": itl},
        }

    row = disagg.median_row([run(300, 40, {}), run(100, 10, {"503": 1}), run(200, 90, {"503": 2})])
    assert row["target"] == "kvgate-aggregated" and row["repeats"] == 3 and len(row["runs"]) == 3
    assert (row["ttft_ms"]["p90"], row["ttft_ms"]["p50"], row["itl_ms"]["p90"]) == (200, 100, 40)
    assert (row["errors"], row["replicas"]) == ({"503": 3}, {"sim-0": 30})
    skipped = {"target": "x", "skipped": "no wheel"}
    assert disagg.median_row([skipped, skipped])["skipped"] == "no wheel"
    assert disagg.median_row([skipped, run(100, 10, {})])["repeats"] == 1


def test_repeats_interleave_the_targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    order: list[str] = []

    def fake(name: str, config: object, sessions: object, workdir: Path, progress: bool) -> dict[str, object]:
        order.append(f"{name}@{workdir.name}")
        p90 = {"kvgate-aggregated": 100.0, "kvgate-conditional": 110.0 + len(order)}[name]
        return {"target": name, "ttft_ms": {"n": 1, "p90": p90}, "itl_ms": {"n": 1, "p90": 10.0}}

    monkeypatch.setattr(disagg, "run_target", fake)
    rows, rounds = disagg.run_targets(
        disagg.SWEEP_TARGETS, disagg.quick_config(), [], tmp_path, False, repeats=3
    )
    assert order == [f"{t}@round-{r}" for r in range(3) for t in disagg.SWEEP_TARGETS]
    assert len(rounds) == 3 and rows["kvgate-conditional"]["ttft_ms"]["p90"] == 114.0  # 112, 114, 116
    assert disagg.goals(rows)["conditional_ttft_p90_over_aggregated"]["value"] == 1.14
    with pytest.raises(SystemExit):
        disagg.main(["--repeats", "0"])


def test_the_sweep_with_peers_judges_the_peer_ranking(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    p90s = {
        "kvgate-aggregated": (100.0, 120.0),
        "kvgate-conditional": (110.0, 40.0),
        "kvgate-disaggregated-sglang": (150.0, 40.0),
        "sglang-router-pd": (300.0, 40.0),
    }
    ran: list[str] = []

    def fake(name: str, config: object, sessions: object, workdir: Path, progress: bool) -> dict[str, object]:
        ran.append(name)
        ttft, itl = p90s[name]
        return {"target": name, "ttft_ms": {"n": 1, "p90": ttft}, "itl_ms": {"n": 1, "p90": itl}}

    monkeypatch.setattr(disagg, "run_target", fake)
    out = disagg.sweep(disagg.quick_config(), tmp_path, False, peers=True)
    assert len(out) == 6 and set(ran) == set(disagg.SWEEP_TARGETS + disagg.SWEEP_PEERS)
    assert all(v["peer_ranking_holds"] and v["peer_goal_met"] for v in out)
    assert {v["disaggregated_ttft_p90_over_sglang_pd"] for v in out} == {0.5}
    ran.clear()
    assert "peer_ranking_holds" not in disagg.sweep(disagg.quick_config(), tmp_path, False)[0]
    assert set(ran) == set(disagg.SWEEP_TARGETS)


def test_a_target_that_loses_requests_fails_the_success_goal() -> None:
    """The ratio goals are over served requests: a conditional target that lost half its requests reads a
    better ITL and TTFT p90 than the aggregated one, so the success goal (routing's rule, shared) is not
    met, naming it; in a median row each run counts (a median of ``lost`` would hide one run's losses)."""

    def row(ttft: float, itl: float, lost: int) -> dict[str, object]:
        p90s = {"ttft_ms": {"n": 1, "p90": ttft}, "itl_ms": {"n": 1, "p90": itl}}
        return {**p90s, "sent": 100, "served": 100 - lost, "lost": lost}

    got = disagg.goals({"kvgate-aggregated": row(100, 40, 0), "kvgate-conditional": row(50, 10, 50)})
    assert got["conditional_itl_p90_over_aggregated"]["met"] is True  # the served requests alone
    assert got["success_100pct_every_run"] == {
        "value": False,
        "failed_runs": ["kvgate-conditional"],
        "met": False,
    }
    clean = disagg.goals({"kvgate-aggregated": row(100, 40, 0), "kvgate-conditional": row(50, 10, 0)})
    assert clean["success_100pct_every_run"]["met"] is True
    runs = [row(50, 10, 0), row(50, 10, 3), row(50, 10, 0)]
    median = disagg.median_row([{"target": "kvgate-conditional", **r} for r in runs])
    assert median["lost"] == 0  # the median hides the run that lost 3
    got = disagg.goals({"kvgate-aggregated": row(100, 40, 0), "kvgate-conditional": median})
    assert got["success_100pct_every_run"]["failed_runs"] == ["kvgate-conditional (run 2)"]
    skipped = {"target": "sglang-router-pd", "skipped": "no wheel"}
    assert disagg.goals({"sglang-router-pd": skipped})["success_100pct_every_run"]["met"] is True


def test_a_sweep_variant_that_loses_requests_does_not_meet_its_goals(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def fake(name: str, config: object, sessions: object, workdir: Path, progress: bool) -> dict[str, object]:
        p90 = {"kvgate-aggregated": (100.0, 120.0), "kvgate-conditional": (100.0, 40.0)}[name]
        lost = 5 if name == "kvgate-conditional" else 0
        return {
            "target": name,
            "ttft_ms": {"n": 1, "p90": p90[0]},
            "itl_ms": {"n": 1, "p90": p90[1]},
            "lost": lost,
        }

    monkeypatch.setattr(disagg, "run_target", fake)
    out = disagg.sweep(disagg.quick_config(), tmp_path, False)
    assert all(v["ranking_holds"] and not v["goals_met"] for v in out)
    assert not any(v["success_100pct_every_run"] for v in out)
