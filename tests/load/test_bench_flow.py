"""The flow-control overload benchmark (``load.bench.flow``): its load client extensions, its fairness
arithmetic, and a ``--quick`` run writing the documented JSON shape (no figure is asserted)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from load.bench import flow
from load.client import FixedRoute, LoadOptions, RequestRecord, run_load
from load.workloads.session import Session, Turn


@pytest.fixture
async def echo_server() -> AsyncIterator[tuple[str, list[Mapping[str, str]]]]:
    """A chat endpoint on 127.0.0.1 that records each request's headers: a request whose objective is
    ``batch`` gets 429 ``queue_full`` (an OpenAI error body), any other one token streamed."""
    seen: list[Mapping[str, str]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        await request.read()
        if request.headers.get(flow.OBJECTIVE_HEADER) == "batch":
            error = {"message": "queue full", "type": "rate_limit_error", "param": None, "code": "queue_full"}
            return web.json_response({"error": error}, status=429)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"delta": {"content": "hi"}}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
        for data in (chunk, usage):
            await resp.write(b"data: " + orjson.dumps(data) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


def _session(key: str, start_s: float = 0.0) -> Session:
    return Session(key, key, start_s, (), (Turn(({"role": "user", "content": "q"},), 4),))


async def test_client_sends_per_request_headers_and_records_the_error_code(
    echo_server: tuple[str, list[Mapping[str, str]]],
) -> None:
    url, seen = echo_server
    options = LoadOptions("m", duration_s=1.0, drain_s=10.0, progress=False, headers=flow.headers_for)
    result = await run_load([_session("interactive"), _session("batch-b", 0.01)], FixedRoute(url), options)
    by_session = {r.session: r for r in result.records}
    assert by_session["interactive"].ok and by_session["interactive"].error_code is None
    assert by_session["batch-b"].status == "429"
    assert by_session["batch-b"].error_code == "queue_full"
    sent = sorted((h.get(flow.OBJECTIVE_HEADER), h.get(flow.FAIRNESS_HEADER)) for h in seen)
    assert sent == [("batch", "batch-b"), ("interactive", None)]
    assert all(h["Content-Type"] == "application/json" for h in seen)


async def test_client_without_headers_sends_only_its_own(
    echo_server: tuple[str, list[Mapping[str, str]]],
) -> None:
    url, seen = echo_server
    options = LoadOptions("m", duration_s=1.0, drain_s=10.0, progress=False)
    result = await run_load([_session("batch-a")], FixedRoute(url), options)
    assert [r.ok for r in result.records] == [True]
    assert flow.OBJECTIVE_HEADER not in seen[0]


def test_max_min_shares_give_a_light_flow_all_it_asked() -> None:
    assert flow.max_min_shares([100, 10], 60) == [50, 10]
    assert flow.max_min_shares([100, 100], 60) == [30, 30]
    assert flow.max_min_shares([10, 20], 100) == [10, 20]


def test_jain_index() -> None:
    assert flow.jain([1.0, 1.0]) == 1.0
    assert flow.jain([1.0, 0.0]) == 0.5
    assert flow.jain([4.0, 1.0]) == round(25 / 34, 4)


def test_class_metrics_count_sheds_by_code_and_other_failures_as_lost() -> None:
    def rec(status: str, ttft_s: float | None = None, code: str | None = None) -> RequestRecord:
        r = RequestRecord("s", 0, "interactive", 0.0, status=status, ttft_s=ttft_s, e2e_s=1.0)
        r.completion_tokens = 10 if status == "ok" else 0
        r.error_code = code
        return r

    records = [
        rec("ok", 0.1),
        rec("ok", 2.0),
        rec("429", code="queue_full"),
        rec("429", code="slo_unattainable"),
        rec("503"),
    ]
    m = flow.class_metrics(records, "interactive", wall_s=2.0, ttft_ms=1000)
    assert m["goodput"] == 0.2  # one of five met 1 s; sheds and errors are misses
    assert m["shed"] == {"queue_full": 1, "slo_unattainable": 1}
    assert m["errors"] == {"503": 1} and m["lost"] == 1
    assert m["output_tok_s"] == 10.0
    assert flow.class_metrics(records, "batch", wall_s=2.0, ttft_ms=1000)["goodput"] == 0.4


def test_flow_overlay_sets_limits_and_deadlines_only_for_the_flow_target() -> None:
    config = flow.FlowConfig()
    with_limits, without = flow.flow_overlay(config, True), flow.flow_overlay(config, False)
    assert with_limits["objectives"]["interactive"] == {"priority": 1, "ttft_ms": config.ttft_ms}
    assert without["objectives"] == {"interactive": {"priority": 1}, "batch": {"priority": 0}}
    assert with_limits["flow"]["saturation"] == {"max_in_flight": config.max_num_seqs}
    assert "flow" not in without


def test_the_priority_target_tells_engines_the_band_and_lets_batch_fill_every_slot() -> None:
    """kvgate-flow-priority: batch headroom ``priority_batch_headroom`` (0), interactive past the limit,
    the band written in the engines' order; kvgate-flow keeps its kept slot. The fleet schedules by
    priority (as vLLM: no preemption flag with ``engine_preemption`` off) only when the target runs."""
    config = flow.FlowConfig(engine_preemption=False)
    told = flow.flow_overlay(config, True, engine_priority=True)["flow"]
    assert told["bands"]["0"]["headroom"] == 0.0
    assert told["bands"]["1"] == {"headroom": -config.interactive_overcommit}
    assert told["engine_priority"] == {"order": "low_first", "scale": 1}
    kept = flow.flow_overlay(config, True)["flow"]
    assert kept["bands"]["0"]["headroom"] == config.batch_headroom and "engine_priority" not in kept
    assert "--scheduling-policy" not in config.sim_args()
    fleet = config.sim_args(priority_fleet=True)
    assert fleet[fleet.index("--scheduling-policy") + 1] == "priority"
    assert "--priority-preemption" not in fleet
    preempting = flow.FlowConfig().sim_args(priority_fleet=True)
    assert "--priority-preemption" in preempting
    # SGLang's default threshold on the fleet, the bands spread past it by the gateway.
    threshold = int(preempting[preempting.index("--priority-preemption-threshold") + 1])
    assert threshold == flow.SGLANG_PREEMPTION_THRESHOLD == 10
    spread = flow.flow_overlay(flow.FlowConfig(engine_priority=True), True)["flow"]["engine_priority"]
    assert spread == {"order": "low_first", "scale": threshold + 1}


@pytest.mark.e2e
def test_flow_quick(tmp_path: Path) -> None:
    out = tmp_path / "flow.json"
    assert flow.main(["--quick", "--no-progress", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {
        "benchmark",
        "command",
        "machine",
        "revision",
        "config",
        "sim",
        "capacity",
        "targets",
        "goals",
    } <= (result.keys())
    assert set(flow.SIM_SOURCES) <= result["sim"]["sources"].keys()
    assert result["capacity"]["measured_req_s"] > 0
    assert set(result["targets"]) == {"kvgate-flow", "kvgate-no-flow", "round-robin"}
    for row in result["targets"].values():
        assert row["sent"] == result["requests"] > 0
        assert set(row["classes"]) == set(flow.CLASSES)
        for klass in row["classes"].values():
            assert klass["ttft_ms"].keys() >= {"p50", "p90", "p99"}
            assert {"goodput", "output_tok_s", "shed", "errors", "lost"} <= klass.keys()
        assert {"jain", "jain_raw", "served_tokens", "demand_tokens", "shed_by_flow"} <= row[
            "fairness"
        ].keys()
    assert {
        "interactive_goodput_flow",
        "interactive_goodput_no_flow",
        "output_tok_s_flow_over_no_flow",
        "jain_flow",
        "lost_all_targets",
    } == result["goals"].keys()
    assert all(isinstance(g["met"], bool) for g in result["goals"].values())


def test_help_exits_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        flow.main(["--help"])
    assert exc.value.code == 0
    assert "--quick" in capsys.readouterr().out
