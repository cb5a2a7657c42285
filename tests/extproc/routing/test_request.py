from __future__ import annotations

import orjson
import pytest

from extproc.errors import BadRequest
from extproc.routing.request import Kind, parse_body, rewrite_model, route_kind


def chat(**fields: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/chat/completions", Kind.CHAT),
        ("/v1/chat/completions?x=1", Kind.CHAT),
        ("/v1/completions", Kind.COMPLETION),
        ("/v1/models", None),
        ("/v2/chat/completions", None),
    ],
)
def test_route_kind(path: str, kind: Kind | None) -> None:
    assert route_kind(path) is kind


def test_chat_ok() -> None:
    req = parse_body(Kind.CHAT, chat(stream=True, tools=[{"type": "function"}], cache_salt="s"))
    assert req.model == "m" and req.stream and req.cache_salt == "s"
    assert req.tools == [{"type": "function"}]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "empty"),
        (b"{", "not valid JSON"),
        (b'{"model": "\xff"}', "UTF-8"),
        (b"[1]", "JSON object"),
        (b'{"messages": []}', "model"),
        (orjson.dumps({"model": 3, "messages": []}), "model"),
        (orjson.dumps({"model": "m"}), "messages"),
        (orjson.dumps({"model": "m", "messages": "hi"}), "messages"),
        (orjson.dumps({"model": "m", "messages": [1]}), "messages[0]"),
        (orjson.dumps({"model": "m", "messages": [{"content": "x"}]}), "role"),
        (orjson.dumps({"model": "m", "messages": [{"role": "user", "content": 5}]}), "content"),
        (orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [1]}]}), "parts"),
        (chat(stream="yes"), "stream"),
        (chat(max_tokens="10"), "max_tokens"),
        (chat(max_tokens=True), "max_tokens"),
        (chat(max_tokens=-1), "max_tokens"),
        (chat(temperature="hot"), "temperature"),
        (chat(tools={"a": 1}), "tools"),
        (chat(tools=[1]), "tools"),
    ],
)
def test_chat_rejections(raw: bytes, message: str) -> None:
    with pytest.raises(BadRequest) as err:
        parse_body(Kind.CHAT, raw)
    assert message in err.value.message
    body = orjson.loads(err.value.body())
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hello", "hello"), (["a", "b"], "a"), ([1, 2, 3], [1, 2, 3]), ([[4, 5], [6]], [4, 5])],
)
def test_completion_prompts(prompt: object, expected: object) -> None:
    req = parse_body(Kind.COMPLETION, orjson.dumps({"model": "m", "prompt": prompt}))
    assert req.prompt == expected


@pytest.mark.parametrize("prompt", [None, 3, [], [1, "a"], [-1], [True], {"a": 1}])
def test_completion_rejections(prompt: object) -> None:
    with pytest.raises(BadRequest):
        parse_body(Kind.COMPLETION, orjson.dumps({"model": "m", "prompt": prompt}))


def test_rewrite_model_keeps_other_fields() -> None:
    req = parse_body(Kind.CHAT, chat(temperature=0.5))
    rewritten, body = rewrite_model(req, "other")
    assert orjson.loads(body) == {**orjson.loads(chat(temperature=0.5)), "model": "other"}
    assert rewritten.model == "other" and rewritten.messages == req.messages
