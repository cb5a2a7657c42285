"""Smoke run of ``python -m load.bench.soak --quick``: it runs a whole stack (etcd, agents with their
simulated engines, kvcached, ext_proc, Envoy) for a few seconds and writes the documented JSON shape.

A benchmark is not a test: nothing here asserts the growth goal, only that the results file is complete
(every process of the stack sampled, the load counted).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    assert set(result["goals"]) == {
        "rss_growth_below",
        "worst_rss_growth",
        "worst_process",
        "processes_gone",
        "processes_unjudged",
        "rss_met",
        "request_success",
        "met",
    }
    assert result["parameters"]["ext_caches"] == soak.SMALL_EXT_CACHES  # the ext_proc's small bounds


class _FakeStack:
    """Stands in for :class:`kvgate.dev.up.Stack`: no process is started."""

    url = "http://127.0.0.1:1"
    etcd = None

    def __init__(self, options: object) -> None:
        self.children: list[object] = []

    def __enter__(self) -> _FakeStack:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _series(name: str, rss: list[int], gone_at: float | None = None) -> soak.Series:
    return soak.Series(name, 1, "x", [(float(t), r, 10) for t, r in enumerate(rss)], gone_at)


def _stats(sent: int, ok: int) -> soak.LoadStats:
    stats = soak.LoadStats()
    stats.sent["chat"], stats.ok["chat"] = sent, ok
    if sent > ok:
        stats.failed["chat ClientConnectorError"] = sent - ok
    return stats


FLAT = [100] * 10


@pytest.mark.parametrize(
    ("series", "stats", "met"),
    [
        ([_series("extproc", FLAT), _series("envoy", FLAT)], _stats(10, 10), True),
        # half the requests never got an answer: a failure, not a smaller sample
        ([_series("extproc", FLAT), _series("envoy", FLAT)], _stats(10, 5), False),
        # nothing answered at all
        ([_series("extproc", FLAT)], _stats(10, 0), False),
        # an engine that died after two samples (no growth to judge) does not drop out of the goal
        (
            [_series("extproc", FLAT), _series("node-0/python-9", [100, 100], gone_at=2.0)],
            _stats(10, 10),
            False,
        ),
        # a process gone before the end, judged on the samples it had, fails it too
        ([_series("extproc", FLAT), _series("envoy", FLAT, gone_at=9.0)], _stats(10, 10), False),
        ([_series("extproc", [100] * 5 + [110] * 5)], _stats(10, 10), False),  # +10 % RSS
    ],
)
def test_goals_count_every_request_and_process(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    series: list[soak.Series],
    stats: soak.LoadStats,
    met: bool,
) -> None:
    """The goal verdict in the results file (the whole of ``main`` with the stack, sampler and load
    faked): every request sent is in the success goal's denominator and every process sampled in the
    growth goal, so a soak where requests or processes died early cannot read better than one where
    they did not."""

    class FakeSampler:
        def __init__(self, roots: object, interval_s: float) -> None:
            self.series = {s.name: s for s in series}

        def start(self) -> None:
            pass

        def stop(self) -> None:
            pass

    async def ready(url: str, timeout_s: float) -> None:
        pass

    async def load(*args: object) -> soak.LoadStats:
        return stats

    monkeypatch.setattr(soak, "Stack", _FakeStack)
    monkeypatch.setattr(soak, "Sampler", FakeSampler)
    monkeypatch.setattr(soak, "_ready", ready)
    monkeypatch.setattr(soak, "run_load", load)
    monkeypatch.setattr(soak, "revision", lambda: "test")
    out = tmp_path / "soak.json"
    argv = ["--duration", "10", "--interval", "1", "--warmup", "2", "--window", "2", "--out", str(out)]
    assert soak.main(argv) == 0
    goals = json.loads(out.read_text())["goals"]
    assert goals["met"] is met
