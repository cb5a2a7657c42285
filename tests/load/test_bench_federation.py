"""The federation benchmark (``load.bench.federation``): its workload, its goal arithmetic, and a
``--quick`` run writing the documented JSON shape (no figure is asserted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from load.bench import federation


def test_the_workload_splits_groups_across_regions() -> None:
    config = federation.FederationBenchConfig(duration_s=20.0)
    warm, requests = federation.make_workload(config)
    assert [region for region, _ in warm] == ["a", "b"] * (config.groups // 2)
    kinds = {r.kind for r in requests}
    assert kinds == {"cross", "local", "unshared"}
    for r in requests:
        if r.kind in ("cross", "local"):
            home = federation.REGIONS[int(r.session.key[1:]) % 2]
            assert (home == r.region) == (r.kind == "local")


def row(target: str, rtt: float | None, cross: float, unshared: float, egress_rq: float) -> dict[str, Any]:
    return {
        "target": target,
        "rtt_ms": rtt,
        "ttft_ms": {"cross": {"n": 1, "p90": cross}, "unshared": {"n": 1, "p90": unshared}},
        "egress_requests_per_s": {"a": egress_rq, "b": 0.0},
        "egress_bytes_per_s": {"a": 0.0, "b": 0.0},
    }


def test_goals() -> None:
    config = federation.FederationBenchConfig()
    got = federation.goals(
        [
            row("isolated", None, 400, 100, 0),
            row("federated-20ms", 20, 150, 104, 1.0),
            row("federated-80ms", 80, 300, 120, 99),
        ],
        config,
    )
    assert got["cross_shared_ttft_p90_isolated_over_federated_20ms"] == {
        "value": 2.667,
        "goal": ">= 2",
        "met": True,
    }
    assert got["unshared_ttft_p90_federated_over_isolated_20ms"]["met"] is True
    assert got["unshared_ttft_p90_federated_over_isolated_80ms"]["met"] is False
    assert got["egress_within_budget_20ms"]["met"] is True
    assert got["egress_within_budget_80ms"]["met"] is False
    assert got["cross_shared_ttft_p90_isolated_over_federated_80ms"]["met"] is None  # reported only


@pytest.mark.e2e
def test_federation_quick(tmp_path: Path) -> None:
    out = tmp_path / "federation.json"
    assert federation.main(["--quick", "--no-progress", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "revision", "config", "targets", "goals"} <= set(result)
    assert [t["target"] for t in result["targets"]] == ["isolated", "federated-20ms"]
    assert all(t["errors"] == 0 for t in result["targets"])


def test_repeats_are_summarised_by_per_figure_medians() -> None:
    repeats = [
        [row("isolated", None, 400, 100, 0), row("federated-20ms", 20, 150, 104, 1.0)],
        [row("isolated", None, 300, 120, 0), row("federated-20ms", 20, 250, 90, 3.0)],
        [row("isolated", None, 350, 110, 0), row("federated-20ms", 20, 100, 95, 2.0)],
    ]
    medians = federation.median_rows(repeats)
    assert [m["target"] for m in medians] == ["isolated", "federated-20ms"]
    iso, fed = medians
    assert iso["ttft_ms"]["cross"]["p90"] == 350 and iso["rtt_ms"] is None and iso["repeats"] == 3
    assert fed["ttft_ms"]["cross"]["p90"] == 150 and fed["ttft_ms"]["unshared"]["p90"] == 95
    assert fed["egress_requests_per_s"] == {"a": 2.0, "b": 0.0}
    two = federation.median_rows(repeats[:2])
    assert two[1]["ttft_ms"]["cross"]["p90"] == 200  # an even count: the middle two's mean
    assert type(federation.median_rows([[{"target": "t", "errors": 0}]] * 2)[0]["errors"]) is int
