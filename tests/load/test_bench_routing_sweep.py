"""The routing benchmark's 2x sweep: its variants, kvgate's standings against the peer routers and the
ranking verdict (pure functions; the runs are stand-ins)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from load.bench import ranking_holds_all, routing
from load.sim.timing import TimingModel


def test_the_default_step_model_is_the_simulators() -> None:
    """The main run's fleet is the one it ran before the sweep existed: the simulator's defaults."""
    config, timing = routing.default_config(), TimingModel()
    assert config.step_base_ms == timing.base_s * 1e3
    assert config.decode_ms_per_seq == pytest.approx(timing.decode_s_per_seq * 1e3)
    assert config.prefill_tokens_per_s == 1 / timing.prefill_s_per_token
    assert config.kv_fraction_scale == 1.0


def test_the_variants_halve_then_double_each_key_parameter() -> None:
    config = routing.smoke_config()
    variants = routing.sweep_variants(config)
    assert [(p.split()[0], f) for p, f, _ in variants] == [
        ("prefill_tokens_per_s", 0.5), ("decode_step", 0.5), ("kv_fraction_scale", 0.5),
        ("prefill_tokens_per_s", 2.0), ("decode_step", 2.0), ("kv_fraction_scale", 2.0),
    ]  # fmt: skip
    prefill, decode, kv = (v for _, _, v in variants[:3])
    assert prefill.prefill_tokens_per_s == 10_000 and prefill.step_base_ms == 6.0
    assert (decode.step_base_ms, decode.decode_ms_per_seq) == (3.0, 0.075)
    assert decode.prefill_tokens_per_s == 20_000 and kv.kv_fraction_scale == 0.5
    # the simulator gets the varied values; the recorded parameters are the varied ones
    args = routing.fleet_spec(config.scenarios[0], decode).sim_args
    assert args[args.index("--step-base-ms") + 1] == "3.0"
    assert args[args.index("--decode-ms-per-seq") + 1] == "0.075"
    assert routing.sim_section(prefill)["parameters"]["prefill_tokens_per_s"] == 10_000
    # KV per replica follows kv_fraction x the scale (the full config: no replica at its minimum)
    full = routing.default_config()
    sp = full.scenarios[0]
    blocks = {s: routing.fleet_spec(sp, replace(full, kv_fraction_scale=s)).kv_blocks for s in (0.5, 1, 2)}
    assert blocks[1] == 538  # ROUTING.md's table
    assert abs(blocks[0.5] - 269) <= 1 and abs(blocks[2] - 1076) <= 1


def _row(workload: str, target: str, load: float = 24.0, **metrics: float) -> dict[str, Any]:
    values = {"ttft_p90_s": 1.0, "output_tok_s": 500.0, "hit_ratio": 0.8, "max_over_mean": 1.2}
    values.update(success=1.0, sessions_aborted=0)
    return {"workload": workload, "load": load, "target": target, "metrics": {**values, **metrics}}


ROWS = [
    _row("shared-prefix", "kvgate", ttft_p90_s=1.0, output_tok_s=900),
    _row("shared-prefix", "sglang-router", ttft_p90_s=2.0, output_tok_s=100),
    _row("shared-prefix", "round-robin", ttft_p90_s=9.0),
    _row("shared-prefix", "oracle", ttft_p90_s=0.5),  # a reference, not ranked
    _row("shared-prefix", "vllm-router", ttft_p90_s=float("nan"), output_tok_s=0),  # served nothing
    _row("shared-prefix", "kvgate", load=12.0, ttft_p90_s=5.0),  # not the highest load
    {"workload": "shared-prefix", "load": 24.0, "target": "least-loaded", "skipped": "x"},
    _row("shared-prefix-closed", "kvgate", load=64.0, output_tok_s=600),
    _row("shared-prefix-closed", "sglang-router", load=64.0, output_tok_s=700),
    _row("agentic", "kvgate", 2.0, hit_ratio=0.9, max_over_mean=2.0),
    _row("agentic", "round-robin", 2.0, hit_ratio=0.8, max_over_mean=1.0),
    _row("agentic", "sglang-router", 2.0, hit_ratio=0.9, max_over_mean=8.0),
]


def test_standings_rank_kvgate_against_each_peer_router_on_each_goals_metric() -> None:
    got = routing.standings(ROWS)
    assert got == {
        "kvgate": {
            "shared-prefix ttft_p90_s": {"round-robin": "better", "sglang-router": "better"},
            # the closed loop's output/s, as the goal (the open loop's 900 vs 100 is not it)
            "shared-prefix-closed output_tok_s": {"sglang-router": "worse"},
            "agentic hit_ratio": {"round-robin": "better", "sglang-router": "equal"},
            "agentic max_over_mean": {"round-robin": "worse", "sglang-router": "better"},
        }
    }
    open_only = [r for r in ROWS if r["workload"] != "shared-prefix-closed"]
    assert routing.standings(open_only)["kvgate"]["shared-prefix output_tok_s"] == {
        "round-robin": "better",
        "sglang-router": "better",
        "vllm-router": "better",  # no TTFT (served nothing), but an output rate (0): ranked on it
    }
    precise = [{**r, "target": "kvgate-precise"} for r in ROWS if r["target"] == "kvgate"]
    assert routing.standings(ROWS + precise)["kvgate-precise"] == got["kvgate"]


def test_the_ranking_holds_only_when_every_standing_is_the_references() -> None:
    reference = routing.standings(ROWS)
    assert routing.ranking_changes(reference, reference) == []
    flipped = [
        _row("shared-prefix", "round-robin", ttft_p90_s=0.9) if r["target"] == "round-robin" else r
        for r in ROWS
        if r["workload"] == "shared-prefix"
    ] + [r for r in ROWS if r["workload"] != "shared-prefix"]
    assert routing.ranking_changes(reference, routing.standings(flipped)) == [
        "kvgate/shared-prefix ttft_p90_s/round-robin: better -> worse"
    ]
    gone = [r for r in ROWS if not (r["workload"] == "agentic" and r["target"] == "sglang-router")]
    assert routing.ranking_changes(reference, routing.standings(gone)) == [
        "kvgate/agentic hit_ratio/sglang-router: equal -> not measured",
        "kvgate/agentic max_over_mean/sglang-router: better -> not measured",
    ]


def test_the_sweep_records_each_variant_and_judges_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ran: list[routing.BenchConfig] = []

    def measure(config: routing.BenchConfig, workdir: Path, progress: bool) -> Any:
        ran.append(config)
        rows = ROWS
        if config.prefill_tokens_per_s > 20_000:  # the doubled prefill rate flips one standing
            rows = [
                _row("agentic", "round-robin", 2.0, hit_ratio=0.95) if r["target"] == "round-robin" else r
                for r in ROWS
                if r["workload"] == "agentic"
            ] + [r for r in ROWS if r["workload"] != "agentic"]
        return rows, rows, {"shared-prefix": {"kv_blocks": 1}}

    monkeypatch.setattr(routing, "measure", measure)
    config = replace(routing.smoke_config(), repeats=2)
    out = routing.sweep(config, ROWS, tmp_path, False)
    assert len(out) == 6 and [c.repeats for c in ran] == [2] * 6
    assert [v["ranking_holds"] for v in out] == [True, True, True, False, True, True]
    assert out[3]["ranking_changes"] == ["kvgate/agentic hit_ratio/round-robin: better -> worse"]
    assert out[2]["kv_fractions"] == {"shared-prefix": 0.35, "shared-prefix-closed": 0.35, "agentic": 1.5}
    assert out[1]["sim"]["step_base_ms"] == 3.0 and out[0]["sim"]["prefill_tokens_per_s"] == 10_000
    assert out[0]["goals"]["shared_prefix_ttft_p90_vs_best_peer"]["value"] == 0.5
    assert out[0]["fleets"] and out[0]["runs"] is ROWS and out[0]["standings"]["kvgate"]
    assert not ranking_holds_all(out) and ranking_holds_all(out[:3])
    # nothing to rank (no peer router ran): the ranking is not shown to hold
    alone = [r for r in ROWS if r["target"] in ("kvgate", "oracle")]
    assert not any(v["ranking_holds"] for v in routing.sweep(config, alone, tmp_path, False))


def test_sweep_only_runs_its_reference_first_and_writes_the_json(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ran: list[Path] = []

    def measure(config: routing.BenchConfig, workdir: Path, progress: bool) -> Any:
        ran.append(workdir)
        return ROWS, ROWS, {}

    monkeypatch.setattr(routing, "measure", measure)
    result = routing.run(routing.smoke_config(), tmp_path, progress=False, sweeping="only")
    assert [p.name for p in ran] == ["sweep-reference", *(f"sweep-{i}" for i in range(6))]
    assert result["sweep_ranking_holds_all"] and "runs" not in result and "goals" not in result
    assert result["sweep_reference"]["standings"] == routing.standings(ROWS)
    assert (tmp_path / "routing.json").exists() and not (tmp_path / "routing.md").exists()
    with pytest.raises(SystemExit):
        routing.main(["--sweep", "--sweep-only", "--out", str(tmp_path)])


def test_the_command_line_chooses_the_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    chosen: list[tuple[str, int]] = []

    def run(config: routing.BenchConfig, out: Path, progress: bool, command: str, sweeping: str) -> Any:
        chosen.append((sweeping, config.repeats))
        main_run: dict[str, Any] = {} if sweeping == "only" else {"runs": [], "goals": {}}
        return {**main_run, "sweep": [{"parameter": "p", "factor": 2.0, "ranking_holds": True}]}

    monkeypatch.setattr(routing, "run", run)
    for flags in ([], ["--sweep"], ["--sweep-only", "--repeats", "3"]):
        assert routing.main(["routing", "--smoke", "--out", str(tmp_path), *flags]) == 0
    assert chosen == [("no", 1), ("also", 1), ("only", 3)]


def test_vary_runs_one_variant_of_the_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--vary kv=2 --vary prefill=0.5``: the run at those parameters, as the sweep's variants scale them."""
    configs: list[routing.BenchConfig] = []

    def run(config: routing.BenchConfig, out: Path, progress: bool, command: str, sweeping: str) -> Any:
        configs.append(config)
        return {"runs": [], "goals": {}}

    monkeypatch.setattr(routing, "run", run)
    base = routing.smoke_config()
    argv = ["routing", "--smoke", "--out", str(tmp_path), "--vary", "kv=2", "--vary", "prefill=0.5"]
    assert routing.main(argv) == 0
    assert configs[0].kv_fraction_scale == 2.0
    assert configs[0].prefill_tokens_per_s == base.prefill_tokens_per_s * 0.5
    step = (configs[0].step_base_ms, configs[0].decode_ms_per_seq)
    assert step == (base.step_base_ms, base.decode_ms_per_seq)
    short = {field: name for name, field in routing.VARY.items()}
    for parameter, factor, expected in routing.sweep_variants(base):  # each variant, as the sweep runs it
        assert routing.varied(base, f"{short[parameter]}={factor:g}") == expected
    for bad in ("kv=0", "kv=x", "ttft=2", "kv=inf"):
        with pytest.raises(SystemExit):
            routing.main(["routing", "--smoke", "--out", str(tmp_path), "--vary", bad])
