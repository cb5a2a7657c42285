from __future__ import annotations

import orjson
import pytest

from extproc.errors import BadRequest
from extproc.routing.request import (
    Kind,
    parse_body,
    rewrite_model,
    route_kind,
    without_handoff,
)


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
        (orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "ok"}, 1]}), "messages[1]"),
        (
            orjson.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "ok"}, {"role": "user"}, {}]}
            ),
            "messages[2].role",
        ),
        (
            orjson.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "ok"}, {"role": "u", "content": 5}]}
            ),
            "messages[1].content",
        ),
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


@pytest.mark.parametrize("prompt", [None, 3, [], [1, "a"], [-1], [True], {"a": 1}, [2**32], [[1], [2**32]]])
def test_completion_rejections(prompt: object) -> None:
    with pytest.raises(BadRequest):
        parse_body(Kind.COMPLETION, orjson.dumps({"model": "m", "prompt": prompt}))


def test_rewrite_model_keeps_other_fields() -> None:
    req = parse_body(Kind.CHAT, chat(temperature=0.5))
    rewritten, body = rewrite_model(req, "other")
    assert orjson.loads(body) == {**orjson.loads(chat(temperature=0.5)), "model": "other"}
    assert rewritten.model == "other" and rewritten.messages == req.messages


def test_without_handoff_drops_the_clients_handoff_fields() -> None:
    fields = {"kv_transfer_params": {"remote_host": "h"}, "bootstrap_host": "h", "bootstrap_port": 1}
    raw = chat(temperature=0.5, bootstrap_room=3, **fields)
    req = parse_body(Kind.CHAT, raw)
    stripped, body = without_handoff(req, raw)
    assert orjson.loads(body) == stripped.body == orjson.loads(chat(temperature=0.5))
    assert stripped.messages == req.messages


@pytest.mark.parametrize("field", ["lora_path", "extra_key"])
@pytest.mark.parametrize("kind", [Kind.CHAT, Kind.COMPLETION, Kind.EMBEDDING])
def test_sglangs_engine_selectors_are_refused(kind: Kind, field: str) -> None:
    """SGLang reads ``lora_path`` (an adapter beside the admitted model) and ``extra_key`` (joined to
    ``cache_salt`` as its cache key: ``"kvg"`` + ``"ate-<hex>"`` would name an isolated tenant's salt)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi"}
    for value in ("ate-" + "0" * 32, None, ["a"]):
        with pytest.raises(BadRequest) as refused:
            parse_body(kind, orjson.dumps({**body, "cache_salt": "kvg", field: value}))
        assert refused.value.param == field and "not accepted" in str(refused.value)


def test_without_handoff_keeps_a_body_without_them() -> None:
    raw = chat(temperature=0.5)
    req = parse_body(Kind.CHAT, raw)
    assert without_handoff(req, raw) == (req, raw)
    assert without_handoff(req, raw)[1] is raw  # not re-encoded


TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


def request(kind: Kind, fields: dict[str, object]) -> bytes:
    if kind is Kind.CHAT:
        return chat(**fields)
    return orjson.dumps({"model": "m", "prompt": "hi", **fields})


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        (Kind.CHAT, {"cache_salt": ""}, "cache_salt"),
        (Kind.COMPLETION, {"cache_salt": "s" * 129}, "cache_salt"),
        (Kind.CHAT, {"cache_salt": "tenant/a"}, "cache_salt"),
        (Kind.CHAT, {"cache_salt": "a@b"}, "cache_salt"),
        (Kind.CHAT, {"cache_salt": "a\\b"}, "cache_salt"),
        (Kind.CHAT, {"cache_salt": "a\x00b"}, "cache_salt"),
        (Kind.CHAT, {"cache_salt": 5}, "cache_salt"),
        (Kind.CHAT, {"tools": []}, "tools"),
        (Kind.CHAT, {"tools": [], "tool_choice": "none"}, "tools"),
        (Kind.CHAT, {"tool_choice": "auto"}, "tool_choice"),
        (Kind.CHAT, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        (Kind.CHAT, {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (Kind.CHAT, {"tools": TOOLS, "tool_choice": 1}, "tool_choice"),
        (Kind.CHAT, {"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
        (Kind.CHAT, {"tools": TOOLS, "tool_choice": {"function": {}}}, "tool_choice.function.name"),
        (Kind.CHAT, {"tools": TOOLS, "tool_choice": {"function": {"name": ""}}}, "tool_choice.function.name"),
        (Kind.CHAT, {"tools": TOOLS, "tool_choice": {"function": {"name": "other"}}}, "tool_choice"),
        (
            Kind.CHAT,
            {"continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
        (Kind.CHAT, {"continue_final_message": "yes"}, "continue_final_message"),
        (Kind.COMPLETION, {"prompt": ""}, "prompt"),
        (Kind.COMPLETION, {"prompt": ["a", [1]]}, "prompt"),
        (Kind.COMPLETION, {"prompt": ["a", 1]}, "prompt"),
        (Kind.COMPLETION, {"prompt": [[1], []]}, "prompt"),
        (Kind.COMPLETION, {"prompt": [[1], [2, -1]]}, "prompt"),
    ],
)
def test_values_vllm_refuses(kind: Kind, fields: dict[str, object], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        parse_body(kind, request(kind, fields))
    assert (err.value.status, err.value.param, err.value.code) == (400, param, None)
    assert orjson.loads(err.value.body())["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        (Kind.CHAT, {"cache_salt": "s" * 128}),
        (Kind.COMPLETION, {"cache_salt": "tenant-a_1:+=."}),
        (Kind.CHAT, {"tool_choice": "none"}),
        (Kind.CHAT, {"tool_choice": None}),
        (Kind.CHAT, {"tools": TOOLS, "tool_choice": "none"}),
        (Kind.CHAT, {"tools": TOOLS, "tool_choice": "auto"}),
        (Kind.CHAT, {"tools": TOOLS, "tool_choice": "required"}),
        (
            Kind.CHAT,
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        ),
        (Kind.CHAT, {"continue_final_message": True}),
        (Kind.CHAT, {"continue_final_message": True, "add_generation_prompt": False}),
        (Kind.COMPLETION, {"prompt": "", "prompt_embeds": "AAAA"}),
        (Kind.COMPLETION, {"prompt": ["a", ""]}),
        (Kind.COMPLETION, {"prompt": [[1], [0, 2]]}),
    ],
)
def test_values_vllm_takes(kind: Kind, fields: dict[str, object]) -> None:
    assert parse_body(kind, request(kind, fields)).body == orjson.loads(request(kind, fields))


@pytest.mark.parametrize("kind", [Kind.CHAT, Kind.COMPLETION, Kind.EMBEDDING])
def test_a_body_too_deep_to_encode_again_is_a_400(kind: Kind) -> None:
    # orjson decodes 1024 levels but encodes 254: a body the gateway rewrites (a tenant's cache_salt, the
    # priority, a LoRA or cascade model) or hashes as bytes (a model without a tokenizer) is encoded
    # again, so one it could not encode is refused here rather than failing there (a 500).
    fields = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi"}
    deep = b"[" * 254 + b"]" * 254
    ok = orjson.dumps({"model": "m", **fields})[:-1] + b',"metadata":' + deep[1:-1] + b"}"
    assert orjson.loads(orjson.dumps(parse_body(kind, ok).body)) == orjson.loads(ok)
    too_deep = orjson.dumps({"model": "m", **fields})[:-1] + b',"metadata":' + deep + b"}"
    with pytest.raises(BadRequest, match="nested too deeply") as caught:
        parse_body(kind, too_deep)
    assert caught.value.status == 400
