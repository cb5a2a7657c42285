"""BENCHMARKS.md's pictures: the committed records agree with its tables, the images it embeds exist and
are what ``python -m load.bench.plots`` draws from the records, and a routing run writes a summary the
same command draws."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib
import pytest
from PIL import Image

from load.bench import plots, report, routing
from load.bench import targets as tg
from load.client import RequestRecord, RunResult

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "BENCHMARKS.md"
RECORDS = ROOT / "docs" / "bench"
IMAGES = ROOT / "docs" / "images"
ROUTING = RECORDS / "routing-r5b.json"
OVERHEAD = RECORDS / "overhead-bd51a50.json"

# The table's row labels -> the record's (workload, load) and target names.
WORKLOADS = {
    "shared-prefix @24 req/s": ("shared-prefix", 24),
    "shared-prefix closed @64": ("shared-prefix-closed", 64),
    "agentic @2 sessions/s": ("agentic", 2),
}
TARGETS = {"kvgate (approximate)": "kvgate"}
GOALS = {
    "shared-prefix @24: TTFT p90 <= 0.5x best peer": "shared_prefix_ttft_p90_vs_best_peer",
    "shared-prefix @24: round robin >= 10x slower": "shared_prefix_round_robin_ttft_p90_over_kvgate",
    "closed @64: output >= 1.2x best peer": "shared_prefix_output_tok_s_vs_best_peer",
    "agentic: hit ratio >= 0.9x oracle": "agentic_hit_ratio_vs_oracle",
    "agentic: busiest/mean <= 1.5": "agentic_busiest_replica_over_mean",
    "success 100 %": "success_100pct_every_run",
}
# Half the last digit the table prints the rounds with: their median may differ from the stated one by that.
ROUNDING = {"ttft_p90_s": 0.005, "output_tok_s": 0.0}


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def section(heading: str) -> str:
    """BENCHMARKS.md's text from the heading (##... ``heading``) to the next heading of any level."""
    text = BENCHMARKS.read_text()
    match = re.search(rf"^#+ {re.escape(heading)}\n(.*?)(?=^#+ )", text, re.S | re.M)
    assert match, f"BENCHMARKS.md has no section {heading!r}"
    return match.group(1)


def table_rows(text: str, columns: int) -> list[list[str]]:
    """The cells of every markdown table row of ``text`` with ``columns`` cells (separator rows left out)."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or set(line) <= {"|", "-", " "}:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == columns:
            rows.append(cells)
    return rows


def decimals(text: str) -> int:
    return len(text.split(".", 1)[1]) if "." in text else 0


def test_each_stated_median_is_the_median_of_its_rounds() -> None:
    record = load(ROUTING)
    checked = 0
    for row in record["rows"]:
        for key, tolerance in ROUNDING.items():
            metric = row["metrics"][key]
            assert len(metric["rounds"]) == record["repeats"]
            median = statistics.median(metric["rounds"])
            assert abs(median - metric["median"]) <= tolerance + 1e-9, (row["workload"], row["target"], key)
            checked += 1
    assert checked == 2 * 21


def test_the_routing_record_is_the_benchmarks_table() -> None:
    record = load(ROUTING)
    assert record["source"] == "transcribed from the BENCHMARKS.md table of this run; raw results not kept"
    assert (record["commit"], record["date"], record["repeats"]) == ("5ddc502", "2026-11-22", 5)
    text = section(record["benchmarks_section"])
    assert f"`{record['command']}`" in text and f"commit `{record['commit']}`" in text
    assert f"It took {record['wall_s']:,} s" in text

    rows = {(r["workload"], r["load"], r["target"]): r["metrics"] for r in record["rows"]}
    table = [cells for cells in table_rows(text, 9) if cells[0] in WORKLOADS]
    assert len(table) == len(rows) == 21
    for workload, target, ttft, ttft_median, tput, tput_median, hit, busiest, moves in table:
        m = rows[(*WORKLOADS[workload], TARGETS.get(target, target))]
        assert m["ttft_p90_s"]["rounds"] == [float(x) for x in ttft.split(" / ")]
        assert m["ttft_p90_s"]["median"] == float(ttft_median)
        assert m["output_tok_s"]["rounds"] == [int(x) for x in tput.split(" / ")]
        assert m["output_tok_s"]["median"] == int(tput_median)
        for key, cell in (("hit_ratio", hit), ("max_over_mean", busiest), ("key_moves", moves)):
            assert m[key] == {"median": float(cell)}

    goals = record["goals"]
    table = [cells for cells in table_rows(text, 3) if cells[0] in GOALS]
    assert len(table) == len(GOALS)
    for label, precise, approximate in table:
        name = GOALS[label]
        for cell, suffix in ((precise, "_precise"), (approximate, "")):
            if name == "success_100pct_every_run":
                assert cell == "met" and goals[name]["met"] and goals[name]["value"] is True
                continue
            match = re.fullmatch(r"\**([\d.]+)x? (met|missed)\**(?: \((.*)\))?", cell)
            assert match, cell
            goal = goals[name + suffix]
            assert goal["value"] == float(match.group(1)) and goal["met"] == (match.group(2) == "met")
            rounds = match.group(3)
            assert goal.get("rounds") == ([float(x) for x in rounds.split(" / ")] if rounds else None)


def test_the_goals_follow_from_the_records_medians() -> None:
    """``report.goals`` over the record's medians gives the goals table's values, to its rounding."""
    record = load(ROUTING)
    runs = [
        {
            "workload": r["workload"],
            "load": r["load"],
            "target": r["target"],
            "metrics": {
                **{key: value["median"] for key, value in r["metrics"].items()},
                "success": 1.0,
                "sessions_aborted": 0,
            },
        }
        for r in record["rows"]
    ]
    computed = report.goals(runs)
    for name, stated in record["goals"].items():
        if isinstance(stated["value"], bool):
            assert computed[name]["value"] is stated["value"]
            continue
        places = decimals(repr(stated["value"]))
        assert round(computed[name]["value"], places) == stated["value"], name
        assert computed[name]["met"] == stated["met"], name
        for key in ("best_peer", "measured", "goal"):
            assert computed[name].get(key) == stated.get(key), (name, key)


def test_the_overhead_record_is_the_benchmarks_table() -> None:
    record = load(OVERHEAD)
    assert record["source"] == "transcribed from the BENCHMARKS.md table of this run; raw results not kept"
    text = section(record["benchmarks_section"])
    assert f"\n{record['command']}  " in text  # its code block
    assert f"commit `{record['commit']}`" in section("Benchmarks")  # stated once, for both headlines
    table = [cells for cells in table_rows(text, 5) if "req/s" in cells[2]]
    assert len(table) == len(record["cells"]) == 4
    for requests, concurrency, *targets in table:
        key = f"{'stream' if requests == 'streamed' else 'non_stream'}/c{concurrency}"
        cell = record["cells"][key]
        assert (cell["stream"], cell["concurrency"]) == (requests == "streamed", int(concurrency))
        for name, text_cell in zip(("direct", "envoy_rr", "gateway"), targets, strict=True):
            numbers = [int(x.replace(",", "")) for x in re.findall(r"[\d,]+", text_cell)]
            got = cell["targets"][name]
            assert numbers == [*got["latency_us"].values(), got["rps_median"]], (key, name)


def test_every_image_benchmarks_embeds_exists_and_every_committed_image_is_embedded() -> None:
    embedded = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", BENCHMARKS.read_text())
    assert embedded
    missing = [path for path in embedded if not (ROOT / path).is_file()]
    assert not missing, f"BENCHMARKS.md embeds missing images: {missing}"
    committed = {str(p.relative_to(ROOT)) for p in IMAGES.glob("*.png")}
    assert committed == set(embedded)


def test_the_plot_command_redraws_every_committed_image(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same files, same pixel size, small; the same bytes where the committed image was drawn by this
    matplotlib version (its ``Software`` chunk says which)."""
    records = sorted(RECORDS.glob("*.json"))
    assert plots.main([*map(str, records), "--out", str(tmp_path)]) == 0
    drawn = sorted(Path(line) for line in capsys.readouterr().out.split())
    assert [p.name for p in drawn] == sorted(p.name for p in IMAGES.glob("*.png"))
    version = f"matplotlib {matplotlib.__version__}"
    for new in drawn:
        old = IMAGES / new.name
        assert old.stat().st_size < 100_000, old
        with Image.open(old) as a, Image.open(new) as b:
            assert a.size == b.size, old
            assert b.info.get("Software") == version
            same_version = a.info.get("Software") == version
        if same_version:
            assert old.read_bytes() == new.read_bytes(), f"{old} is not what the command draws: redraw it"


def test_the_plot_command_refuses_other_json(tmp_path: Path) -> None:
    other = tmp_path / "decision.json"
    other.write_text(json.dumps({"benchmark": "decision"}))
    with pytest.raises(SystemExit) as exc:
        plots.main([str(other), "--out", str(tmp_path)])
    assert exc.value.code == 2


def test_an_overhead_result_as_the_benchmark_writes_it_is_drawn(tmp_path: Path) -> None:
    """``load.bench.overhead``'s own JSON (revision, more statistics, no plain Envoy) draws too."""

    def target(p50: float) -> dict[str, Any]:
        stats = {"n": 400, "p50": p50, "p90": p50 * 1.5, "p99": p50 * 3, "max": p50 * 4, "mean": p50}
        return {"latency_us": stats, "rps_median": 1e6 / p50, "rps_rounds": [1.0], "errors": 0}

    cells = {
        f"{'stream' if stream else 'non_stream'}/c{c}": {
            "stream": stream,
            "concurrency": c,
            "targets": {"direct": target(500.0 * c), "gateway": target(2000.0 * c)},
            "added": {},
        }
        for stream in (False, True)
        for c in (1, 4)
    }
    path = tmp_path / "overhead.json"
    result = {"benchmark": "overhead", "revision": {"commit": "0" * 40}, "parameters": {"rounds": 3}}
    path.write_text(json.dumps({**result, "cells": cells}))
    (written,) = plots.draw(path, tmp_path / "out")
    assert written.name == "overhead.png"
    with Image.open(written) as image:
        assert image.size == (900, 360)


def _records(ttft: float) -> list[RequestRecord]:
    return [
        RequestRecord(f"s{i}", 0, f"g{i % 2}", 0.1 * i, "ok", ttft, 2 * ttft, [0.01], 100, 50, 8, f"r{i % 2}")
        for i in range(10)
    ]


def test_a_routing_run_writes_a_summary_the_plot_command_draws(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``routing.run`` writes ``routing-summary.json`` (medians and each round, the goals with each
    round's values); the targets and fleet are stand-ins, the summary code is the run's own."""
    ttfts = {"kvgate": (0.5, 0.9), "round-robin": (5.0, 6.0), "oracle": (0.4, 0.4)}

    class Fleet:
        ids = ("r0", "r1")

        def __init__(self, *_: object) -> None:
            pass

        def stop(self) -> None:
            pass

    def run_one(
        sc: routing.Scenario,
        load_: float,
        target: str,
        fleet: Fleet,
        config: routing.BenchConfig,
        workdir: Path,
        progress: bool,
        repeat: int = 0,
    ) -> dict[str, Any]:
        row: dict[str, Any] = {"workload": sc.name, "load": load_, "load_label": f"{load_:g} requests/s"}
        row.update(load_unit="requests/s", mode=sc.mode, target=target)
        if target == "oracle" and repeat == 1:
            row["skipped"] = "stand-in: not measured"
            return row
        result = RunResult(_records(ttfts[target][repeat]), 1.0, 10, 0)
        return {**row, "metrics": report.summarize(result, Fleet.ids), "run_s": 1.0}

    monkeypatch.setattr(tg, "Fleet", Fleet)
    monkeypatch.setattr(routing, "run_one", run_one)
    smoke = routing.smoke_config()
    config = replace(smoke, scenarios=smoke.scenarios[:1], repeats=2)
    out = tmp_path / "routing-x"
    routing.run(config, out, progress=False, command="kvgate bench routing --smoke")

    summary = load(out / "routing-summary.json")
    assert summary["benchmark"] == "routing-summary" and summary["name"] == "routing-x"
    assert summary["command"] == "kvgate bench routing --smoke" and summary["repeats"] == 2
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", summary["date"]) and len(summary["commit"]) == 40
    by_target = {r["target"]: r for r in summary["rows"]}
    assert [r["target"] for r in summary["rows"]] == ["kvgate", "round-robin", "oracle"]
    kv = by_target["kvgate"]["metrics"]
    assert kv.keys() == {key for key, _ in report.PLOTTED}
    assert kv["ttft_p90_s"] == {"median": 0.7, "rounds": [0.5, 0.9]}
    assert by_target["oracle"]["metrics"]["ttft_p90_s"]["rounds"] == [0.4]  # the round it ran
    assert by_target["round-robin"]["metrics"]["ttft_p90_s"]["median"] == 5.5
    goal = summary["goals"]["shared_prefix_round_robin_ttft_p90_over_kvgate"]
    assert goal["value"] == round(5.5 / 0.7, 3) and goal["rounds"] == [10.0, round(6.0 / 0.9, 3)]

    assert plots.main([str(out / "routing-summary.json"), "--out", str(tmp_path / "img")]) == 0
    (image,) = (tmp_path / "img").iterdir()
    assert image.name == "routing-x-shared-prefix-8.png"


def test_a_single_run_summary_has_one_round_and_skipped_targets_stay_out_of_the_picture(
    tmp_path: Path,
) -> None:
    metrics = report.summarize(RunResult(_records(0.3), 1.0, 10, 0), ["r0", "r1"])
    where = {"workload": "agentic", "load": 2.0, "load_unit": "sessions/s"}
    runs: Sequence[Mapping[str, Any]] = [
        {**where, "target": "kvgate", "metrics": metrics},
        {**where, "target": "vllm-router", "skipped": "x"},
    ]
    result = {"runs": runs, "goals": report.goals(runs), "repeats": 1}
    summary = report.summary(result, "one", "2026-01-01")
    assert summary["rows"][0]["metrics"]["ttft_p90_s"] == {"median": 0.3, "rounds": [0.3]}
    assert summary["rows"][1] == {**where, "target": "vllm-router", "skipped": "x"}
    assert all("rounds" not in g for g in summary["goals"].values())
    (image,) = plots.draw_routing(summary, tmp_path)
    assert image.name == "one-agentic-2.png"
