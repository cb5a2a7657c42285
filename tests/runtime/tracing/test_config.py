"""contracts.tracing: the [tracing] section (strict, validated as the other sections) in each daemon's
config, and the phase timeline; runtime.tracing.tracer: off means no tracer; W3C traceparent in and out."""

from __future__ import annotations

import itertools
import re
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agent.config import parse_node_config
from agent.errors import AgentConfigError
from contracts.errors import ConfigError
from contracts.tracing import Timeline, TracingSettings, parse_tracing
from extproc.config import parse_config
from kvcached.config import parse_kvcached_config
from kvcached.errors import KvcachedConfigError
from runtime.tracing.http import traced
from runtime.tracing.tracer import Tracer, build

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_absent_is_off_with_the_process_name() -> None:
    assert parse_tracing(None, "kvgate-x") == TracingSettings(service_name="kvgate-x")
    assert parse_config({}).tracing == TracingSettings(service_name="kvgate-extproc")
    assert build(parse_config({}).tracing) is None


def test_every_key() -> None:
    raw = {
        "enabled": True,
        "sampling_ratio": 0.25,
        "endpoint": "collector.local:4317",
        "service_name": "edge",
        "flush_interval_s": 2,
    }
    assert parse_tracing(raw, "x") == TracingSettings(True, 0.25, "collector.local:4317", "edge", 2.0)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"enabled": "yes"}, "tracing.enabled"),
        ({"sampling_ratio": 1.5}, "tracing.sampling_ratio"),
        ({"sampling_ratio": -0.1}, "tracing.sampling_ratio"),
        ({"endpoint": "no-port"}, "tracing.endpoint"),
        ({"service_name": ""}, "tracing.service_name"),
        ({"flush_interval_s": 0}, "tracing.flush_interval_s"),
        ({"exporter": "zipkin"}, "unknown key(s) exporter"),
        ("on", "expected a table"),
    ],
)
def test_bad_values_are_refused_naming_the_key(raw: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_tracing(raw, "x")
    with pytest.raises(ConfigError, match="tracing"):
        parse_config({"tracing": raw})


def test_agent_and_kvcached_read_the_same_section() -> None:
    engine = {"kind": "sim", "model": "m", "model_path": "smollm2"}
    node = {"engines": [engine], "tracing": {"enabled": True}}
    assert parse_node_config(node).tracing == TracingSettings(True, service_name="kvgate-agent")
    with pytest.raises(AgentConfigError, match=r"tracing\.sampling_ratio"):
        parse_node_config({**node, "tracing": {"sampling_ratio": 2}})
    kv = {"kvcached": {"ram_bytes": 1024, "listen_unix": "/tmp/x.sock"}, "tracing": {"enabled": True}}
    assert parse_kvcached_config(kv).tracing == TracingSettings(True, service_name="kvgate-kvcached")
    with pytest.raises(KvcachedConfigError, match=r"tracing\.endpoint"):
        parse_kvcached_config({**kv, "tracing": {"endpoint": "x"}})


def test_timeline_marks_consecutive_phases() -> None:
    clock = itertools.count(100, 10)
    timeline = Timeline(lambda: next(clock))  # 100 at creation
    timeline.mark("parse")  # 100 -> 110
    timeline.skip()  # 120
    timeline.mark("render")  # 120 -> 130
    timeline.add("queue_wait", 5, 7)
    assert timeline.spans == [("parse", 100, 110), ("render", 120, 130), ("queue_wait", 5, 7)]


def test_traceparent_in_and_out() -> None:
    tracer = Tracer(TracingSettings(True, 1.0, "127.0.0.1:9", "t", flush_interval_s=60))
    try:
        assert tracer.extract({}) is None
        assert tracer.extract({"traceparent": "garbage"}) is None
        parent = tracer.extract({"traceparent": PARENT})
        assert parent is not None
        span = tracer.start("child", parent=parent)
        out = Tracer.headers(span)["traceparent"]
        assert out.startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-") and "00f067aa0ba902b7" not in out
    finally:
        tracer._provider.shutdown()  # nothing was ended: nothing to export to the closed port


@pytest.mark.parametrize(
    "tracestate",
    [
        "bad key=v\nERROR forged log line",  # a key outside the W3C grammar, with a line break
        "k=v,\x1b[31mred=1",  # a control character
        "k=v,nokey",  # a member without '='
        "K=v",  # upper case key
        "k=" + "v" * 300,  # a value over 256 characters
    ],
)
def test_a_malformed_tracestate_is_dropped_without_logging_it(
    tracestate: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A client's bad ``tracestate`` never reaches a log line (OpenTelemetry's parser would log the
    offending member as sent, line breaks included): the parent is kept, its trace state is empty."""
    caplog.set_level("DEBUG")
    parent = Tracer.extract({"traceparent": PARENT, "tracestate": tracestate})
    assert parent is not None
    context = trace.get_current_span(parent).get_span_context()
    assert context.trace_id == int(PARENT.split("-")[1], 16)
    assert len(context.trace_state) == 0
    assert not [r for r in caplog.records if "forged" in r.getMessage() or "nokey" in r.getMessage()]
    assert not [
        r for r in caplog.records if r.name.startswith("opentelemetry") and "Member" in r.getMessage()
    ]


def test_a_valid_tracestate_is_kept() -> None:
    parent = Tracer.extract(
        {"traceparent": PARENT, "tracestate": "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7,a@b=c"}
    )
    assert parent is not None
    state = trace.get_current_span(parent).get_span_context().trace_state
    assert dict(state.items()) == {"congo": "t61rcWkgMzE", "rojo": "00f067aa0ba902b7", "a@b": "c"}


async def test_an_unknown_http_method_is_traced_as_other() -> None:
    """OpenTelemetry's HTTP conventions: a method outside RFC 9110 and PATCH (WebDAV's, which aiohttp
    parses) is ``_OTHER`` in ``http.request.method``, the one sent in ``http.request.method_original``,
    and the span is named ``HTTP <route>``."""
    exporter = InMemorySpanExporter()
    tracer = Tracer(TracingSettings(True, 1.0, "127.0.0.1:9", "t", flush_interval_s=60), exporter=exporter)

    async def handler(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[traced(tracer)])
    app.router.add_route("*", "/x", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            for method in ("GET", "PROPFIND"):
                async with session.request(method, f"http://127.0.0.1:{port}/x") as resp:
                    assert resp.status == 200
        tracer._provider.force_flush()
        spans = {s.name: dict(s.attributes or {}) for s in exporter.get_finished_spans()}
        assert spans == {
            "GET /x": {"http.request.method": "GET", "http.route": "/x", "http.response.status_code": 200},
            "HTTP /x": {
                "http.request.method": "_OTHER",
                "http.request.method_original": "PROPFIND",
                "http.route": "/x",
                "http.response.status_code": 200,
            },
        }
    finally:
        await runner.cleanup()
        tracer.shutdown()
