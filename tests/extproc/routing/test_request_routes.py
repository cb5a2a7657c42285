"""Parsing of the routes besides chat and completions (issue 21 part 4): embeddings, responses, score,
rerank. Every bad body is a 400 naming the field."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from extproc.admission.gate import max_output_tokens
from extproc.errors import BadRequest
from extproc.routing.request import Kind, parse_body, route_kind


def parse(kind: Kind, **fields: Any) -> Any:
    return parse_body(kind, orjson.dumps({"model": "m", **fields}))


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/embeddings", Kind.EMBEDDING),
        ("/v1/responses", Kind.RESPONSES),
        ("/v1/responses?x=1", Kind.RESPONSES),
        ("/score", Kind.SCORE),
        ("/v1/score", Kind.SCORE),
        ("/rerank", Kind.RERANK),
        ("/v1/rerank", Kind.RERANK),
        ("/v2/rerank", Kind.RERANK),
        ("/v1/audio/speech", None),
    ],
)
def test_routes(path: str, kind: Kind | None) -> None:
    assert route_kind(path) is kind


@pytest.mark.parametrize(
    ("value", "prompt"),
    [("hello", "hello"), (["a", "b"], "a"), ([1, 2, 3], [1, 2, 3]), ([[4, 5], [6]], [4, 5])],
)
def test_embeddings_route_on_the_first_input(value: object, prompt: object) -> None:
    req = parse(Kind.EMBEDDING, input=value, cache_salt="s")
    assert req.prompt == prompt and req.cache_salt == "s" and not req.stream
    assert max_output_tokens(req) == 0


def test_responses_become_chat_messages() -> None:
    req = parse(
        Kind.RESPONSES,
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Rules."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "there"}],
            },
            {"type": "function_call_output", "call_id": "c", "output": "42"},
        ],
        max_output_tokens=7,
        stream=True,
    )
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Hi there"},
    ]
    assert req.stream and max_output_tokens(req) == 7
    assert parse(Kind.RESPONSES, input="Hello").messages == [{"role": "user", "content": "Hello"}]


def test_score_and_rerank_route_on_the_query() -> None:
    assert parse(Kind.SCORE, text_1="q", text_2=["a", "b"]).prompt == "q"
    assert parse(Kind.SCORE, queries=["q1", "q2"], documents=["a", "b"]).prompt == "q1"
    assert parse(Kind.SCORE, data_1="q", data_2="a").prompt == "q"
    req = parse(Kind.RERANK, query="q", documents=["a", {"text": "b"}], top_n=1)
    assert req.prompt == "q" and max_output_tokens(req) == 0


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        (Kind.EMBEDDING, {}, "input"),
        (Kind.EMBEDDING, {"input": ""}, "input"),
        (Kind.EMBEDDING, {"input": []}, "input"),
        (Kind.EMBEDDING, {"input": [1, "a"]}, "input"),
        (Kind.EMBEDDING, {"input": [-1]}, "input"),
        (Kind.EMBEDDING, {"input": "x", "cache_salt": ""}, "cache_salt"),
        (Kind.RESPONSES, {}, "input"),
        (Kind.RESPONSES, {"input": []}, "input"),
        (Kind.RESPONSES, {"input": 3}, "input"),
        (Kind.RESPONSES, {"input": ["x"]}, "input[0]"),
        (Kind.RESPONSES, {"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        (Kind.RESPONSES, {"input": [{"role": "user", "content": 3}]}, "input[0].content"),
        (
            Kind.RESPONSES,
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content",
        ),
        (Kind.RESPONSES, {"input": "x", "instructions": 3}, "instructions"),
        (Kind.RESPONSES, {"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        (Kind.RESPONSES, {"input": "x", "temperature": "hot"}, "temperature"),
        (Kind.RESPONSES, {"input": "x", "stream": "yes"}, "stream"),
        (Kind.SCORE, {}, "queries"),
        (Kind.SCORE, {"text_1": "q"}, "text_2"),
        (Kind.SCORE, {"text_1": "q", "text_2": []}, "text_2"),
        (Kind.SCORE, {"text_1": 1, "text_2": "a"}, "text_1"),
        (Kind.SCORE, {"text_1": "q", "text_2": "a", "queries": "q", "documents": "a"}, "queries"),
        (Kind.RERANK, {"documents": ["a"]}, "query"),
        (Kind.RERANK, {"query": "q"}, "documents"),
        (Kind.RERANK, {"query": "q", "documents": [3]}, "documents[0]"),
        (Kind.RERANK, {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        (Kind.RERANK, {"query": "q", "documents": ["a"], "top_n": True}, "top_n"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(kind: Kind, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse(kind, **fields)
    assert caught.value.param == param


@pytest.mark.parametrize("kind", [Kind.EMBEDDING, Kind.RESPONSES, Kind.SCORE, Kind.RERANK])
def test_a_model_is_required(kind: Kind) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_body(kind, orjson.dumps({"input": "x"}))
    assert caught.value.param == "model"
