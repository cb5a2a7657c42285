"""The ext_proc's request span carries OpenTelemetry's GenAI attributes (names and values as the semantic
conventions' registry, ``model/gen-ai/registry.yaml``, defines them): the model, the operation and the
prompt's token count when it was counted, never the prompt or its tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from contracts.tracing import TracingSettings
from extproc.models.registry import ModelAssets
from extproc.server import _end_request_span
from runtime.tracing.tracer import Tracer
from tests.extproc.test_processor import MODEL, body, chat, headers, make_router, processor, reply


@pytest.fixture(scope="module")
def assets(model_dir: str) -> ModelAssets:
    return ModelAssets.load("smol", Path(model_dir))


def traced(assets: ModelAssets, path: str, payload: bytes, counted: bool | None = None) -> dict[str, Any]:
    """The attributes of the request span of one routed request to ``path`` (``counted``: whether its
    decision counted the prompt exactly, if set; else as the router decided)."""
    exporter = InMemorySpanExporter()
    tracer = Tracer(TracingSettings(True, 1.0, "127.0.0.1:9", "t", flush_interval_s=60), exporter=exporter)
    try:
        proc = processor(make_router(assets))
        assert proc.handle(headers(path)) == []
        reply(proc.handle(body(payload)))
        assert proc.decision is not None
        if counted is not None:
            proc.decision.counted = counted
        _end_request_span(tracer, tracer.start("extproc.request"), proc, 200)
        tracer._provider.force_flush()
        (span,) = exporter.get_finished_spans()
        return dict(span.attributes or {})
    finally:
        tracer.shutdown()


def test_a_chat_requests_span_has_the_genai_attributes(assets: ModelAssets) -> None:
    attributes = traced(assets, "/v1/chat/completions", chat("a secret prompt"), counted=True)
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == MODEL == attributes["kvgate.model"]
    tokens = attributes["gen_ai.usage.input_tokens"]
    assert isinstance(tokens, int) and tokens == attributes["kvgate.prompt_tokens"] > 0
    assert "secret" not in repr(attributes)


def test_an_estimated_prompt_length_is_no_usage(assets: ModelAssets) -> None:
    """A prompt tokenized only as far as routing needed: its length is an estimate, not reported."""
    attributes = traced(assets, "/v1/chat/completions", chat("hello"), counted=False)
    assert "gen_ai.usage.input_tokens" not in attributes and attributes["gen_ai.operation.name"] == "chat"


def test_a_completions_request_is_a_text_completion(assets: ModelAssets) -> None:
    payload = orjson.dumps({"model": MODEL, "prompt": "one two three", "max_tokens": 4})
    attributes = traced(assets, "/v1/completions", payload)
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.model"] == MODEL
