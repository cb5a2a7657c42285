"""Smoke run of ``python -m load.bench.soak --quick``: it runs a whole stack (etcd, agents with their
simulated engines, kvcached, ext_proc, Envoy) for a few seconds and writes the documented JSON shape.

A benchmark is not a test: nothing here asserts the growth goal, only that the results file is complete
(every process of the stack sampled, the load counted).
"""

from __future__ import annotations

import json
from pathlib import Path

from load.bench import soak


def test_soak_quick(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    assert soak.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "revision", "parameters", "load", "processes", "goals"} <= set(
        result
    )
    assert result["benchmark"] == "soak"
    names = {p["name"] for p in result["processes"]}
    # every process the stack started, and each agent's engine (its child)
    assert {"etcd", "envoy", "extproc", "node-0", "node-1", "kvcached-node-0", "kvcached-node-1"} <= names
    assert any(n.startswith("node-0/") for n in names) and any(n.startswith("node-1/") for n in names)
    for process in result["processes"]:
        assert len(process["samples"]) >= 2
        for t, rss, fds in process["samples"]:
            assert t >= 0 and rss > 0 and fds > 0
        assert set(process["rss_kib"]) == {"first", "last", "growth"}
        assert set(process["fds"]) == {"first", "last", "growth", "delta"}
    load = result["load"]
    assert set(load["sent"]) == set(soak.KINDS) and sum(load["sent"].values()) > 0
    assert sum(load["ok"].values()) > 0
    assert set(result["goals"]) == {"rss_growth_below", "worst_rss_growth", "worst_process", "met"}
    assert result["parameters"]["ext_caches"] == soak.SMALL_EXT_CACHES  # the ext_proc's small bounds
