"""The cascade benchmark (``load.bench.cascade``): its workload, its cost model's arithmetic, its goal, and
a ``--quick`` run writing the documented JSON shape (no figure is asserted but the step each request was
answered by, which the workload fixes)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from load.bench import cascade


def test_requests_mix_easy_and_hard_prompts_deterministically() -> None:
    config = cascade.CascadeConfig()
    requests = cascade.make_requests(config)
    assert requests == cascade.make_requests(config)
    hard = [r for r in requests if r.hard]
    assert 0.2 < len(hard) / len(requests) < 0.4
    assert all(r.prompt.startswith("[hard]") for r in hard)
    assert all(r.prompt.startswith("[easy]") for r in requests if not r.hard)
    assert len({r.prompt for r in requests}) == len(requests)
    assert all(0 < r.at < config.duration_s for r in requests)


def test_the_small_model_costs_the_stated_ratio_less() -> None:
    config = cascade.CascadeConfig()
    small, large = config.sim_args("small"), config.sim_args("large")

    def flag(args: tuple[str, ...], name: str) -> float:
        return float(args[args.index(name) + 1])

    assert flag(large, "--step-base-ms") == 8 * flag(small, "--step-base-ms") == 6.0
    assert flag(large, "--decode-ms-per-seq") == 8 * flag(small, "--decode-ms-per-seq")
    assert flag(small, "--prefill-tokens-per-s") == 8 * flag(large, "--prefill-tokens-per-s")
    assert flag(small, "--time-scale") == flag(large, "--time-scale")
    assert config.policy()["models"]["auto"]["cascade"]["steps"] == ["small", "large"]


def test_work_counts_both_steps_of_an_escalated_request() -> None:
    config = cascade.CascadeConfig(time_scale=1.0)
    easy = cascade.Record(False, prompt_tokens=2000, completion_tokens=100, step="1")
    hard = cascade.Record(True, prompt_tokens=2000, completion_tokens=100, step="2")
    large = 2000 / 20_000 + 100 * 0.15e-3  # 0.115 s
    assert cascade.work_seconds(config, [easy, hard], "all-large") == pytest.approx(2 * large)
    assert cascade.work_seconds(config, [easy, hard], "cascade") == pytest.approx(2 * large / 8 + large)


def test_the_per_token_reading_counts_the_step_base_and_preroutes_skip_the_small_step() -> None:
    config = cascade.CascadeConfig(time_scale=1.0, stat="first_k", k=4)
    easy = cascade.Record(False, prompt_tokens=2000, completion_tokens=100, step="1")
    hard = cascade.Record(True, prompt_tokens=2000, completion_tokens=100, step="2")
    large = 2000 / 20_000 + 100 * (0.15e-3 + 6e-3)
    small_cut = (2000 / 20_000 + 4 * (0.15e-3 + 6e-3)) / 8
    assert cascade.work_seconds(config, [hard], "all-large", lone=True) == pytest.approx(large)
    got = cascade.work_seconds(config, [easy, hard, hard], "cascade", lone=True)
    assert got == pytest.approx(large / 8 + 2 * (small_cut + large))
    skipped = cascade.work_seconds(config, [easy, hard, hard], "cascade", lone=True, preroutes=1)
    assert skipped == pytest.approx(large / 8 + small_cut + 2 * large)


def test_replay_charges_what_the_small_step_answers_its_cut_first_attempt() -> None:
    config = cascade.CascadeConfig(time_scale=1.0, stat="first_k", k=4, replay=True)
    assert config.policy()["models"]["auto"]["cascade"]["replay"] is True
    easy = cascade.Record(False, prompt_tokens=2000, completion_tokens=100, step="1")
    hard = cascade.Record(True, prompt_tokens=2000, completion_tokens=100, step="2")
    small = (2000 / 20_000 + 100 * 0.15e-3) / 8
    cut = 4 * 0.15e-3 / 8  # the first attempt's k tokens; its prompt is the replay's cache hit
    plain = replace(config, replay=False)
    assert cascade.work_seconds(config, [easy], "cascade") == pytest.approx(small + cut)
    assert cascade.work_seconds(config, [hard], "cascade") == cascade.work_seconds(plain, [hard], "cascade")
    rows = {"cascade": {"served": 100, "preroutes": 0, "prompt_tokens_mean": 339.0}}
    got = cascade.cost_model(config, rows)
    assert got["this_run_policy"] == {"recall": 0.0, "cut_at": 4, "replay": True}
    plain_run = cascade.cost_model(plain, rows)["ratios"]["this_run"]["per_token"]
    assert got["ratios"]["this_run"]["per_token"] > plain_run
    with pytest.raises(SystemExit):
        cascade.main(["--replay", "--out", "/dev/null"])


def test_the_cost_model_section_uses_the_runs_parameters_and_recall() -> None:
    config = cascade.CascadeConfig(stat="first_k", k=4, preroute=True)
    assert config.policy()["models"]["auto"]["cascade"]["preroute"] == {}
    rows = {"cascade": {"served": 100, "preroutes": 15, "prompt_tokens_mean": 339.0}}
    got = cascade.cost_model(config, rows)
    assert got["this_run_policy"] == {"recall": 0.5, "cut_at": 4, "replay": False}
    assert got["params"]["prompt_tokens"] == 339.0 and got["params"]["lam"] == 3.0
    assert got["ratios"]["perfect"]["per_token"] == pytest.approx(0.3 + 0.7 / 8, abs=1e-3)
    assert got["ratios"]["perfect"]["busy_time"] > 0.6  # out of reach at the default load (README)
    assert len(got["sweep"]) == 16 and "published_sources" in got["sources"]


def test_goal_and_penalty() -> None:
    def row(cost: float, hard: float, easy: float) -> dict[str, object]:
        return {
            "cost_per_request_engine_s": cost,
            "ttft_ms": {"hard": {"p50": hard, "p90": hard}, "easy": {"p50": easy, "p90": easy}},
        }

    got = cascade.goals({"all-large": row(1.0, 100, 100), "cascade": row(0.4, 350, 120)})
    assert got["cost_per_request_over_all_large"] == {"value": 0.4, "goal": "<= 0.5", "met": True}
    assert got["ttft_penalty"]["escalated_ttft_p50_added_ms"] == 250
    assert got["ttft_penalty"]["small_answered_ttft_p90_added_ms"] == 20
    missed = cascade.goals({"all-large": row(1.0, 1, 1), "cascade": row(0.6, 1, 1)})
    assert missed["cost_per_request_over_all_large"]["met"] is False


@pytest.mark.e2e
def test_quick_run_writes_both_targets(tmp_path: Path) -> None:
    out = tmp_path / "cascade.json"
    assert cascade.main(["--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["targets"]) == {"all-large", "cascade"}
    assert doc["sim"]["sources"]["cost_ratio"] and doc["sim"]["sources"]["step_base_ms"]
    hard = doc["hard_requests"]
    rows = doc["targets"]
    assert rows["all-large"]["answered_by_step"] == {"-": doc["requests"]}
    assert rows["cascade"]["answered_by_step"] == {"1": doc["requests"] - hard, "2": hard}
    assert rows["cascade"]["models"] == (["large", "small"] if hard else ["small"])
    assert set(rows["cascade"]["engine_seconds"]) == {"small", "large"}
    assert rows["cascade"]["replicas"] == {"small": 1, "large": 1} and rows["all-large"]["replicas"] == {
        "large": 1
    }
    assert rows["cascade"]["work_engine_s"] > 0 and "work_per_request_over_all_large" in doc["goals"]
    assert "cost_per_request_over_all_large" in doc["goals"]
    assert "per_token_cost_over_all_large" in doc["goals"] and doc["cost_model"]["ratios"]["perfect"]


def test_the_warm_up_phase_has_the_same_mix_and_other_prompts() -> None:
    config = cascade.CascadeConfig(warm_s=40.0)
    warm, measured = cascade.warm_requests(config), cascade.make_requests(config)
    assert warm == cascade.warm_requests(config) and all(0 < r.at < 40 for r in warm)
    assert 0.2 < sum(r.hard for r in warm) / len(warm) < 0.4
    assert not {r.prompt for r in warm} & {r.prompt for r in measured}
    assert all(r.prompt.split()[1] == "Warm-up" for r in warm)
