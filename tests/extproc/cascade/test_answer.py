"""What a gated step is asked and what the client gets back from it: JSON or a valid SSE stream, the
model field of the step, log-probabilities only when the client asked for them."""

from __future__ import annotations

from typing import Any

import orjson

from extproc.cascade.answer import JSON, SSE, client_answer, sse, step_body

CHAT_ANSWER: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 7,
    "model": "engine-name",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello there", "tool_calls": None},
            "logprobs": {"content": [{"token": "Hello", "logprob": -0.1}]},
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
}


def events(body: bytes) -> list[Any]:
    """The SSE body's events, each ``data:`` line decoded (``[DONE]`` as the string)."""
    assert body.endswith(b"data: [DONE]\n\n")
    out: list[Any] = []
    for block in body.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: "), block
        data = block[len(b"data: ") :]
        out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


def test_step_body_asks_for_logprobs_and_no_stream() -> None:
    client = {"model": "auto", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
    assert orjson.loads(step_body(client, "small", chat=True)) == {
        "model": "small",
        "messages": [],
        "stream": False,
        "logprobs": True,
    }
    kept = orjson.loads(step_body({"model": "auto", "logprobs": True, "top_logprobs": 3}, "s", chat=True))
    assert kept["top_logprobs"] == 3
    assert orjson.loads(step_body({"model": "auto", "prompt": "x"}, "s", chat=False))["logprobs"] == 1
    assert orjson.loads(step_body({"model": "auto", "logprobs": 4}, "s", chat=False))["logprobs"] == 4
    # the gate judges the answer: echo would put the prompt's tokens (the first with a null logprob) first
    assert "echo" not in orjson.loads(
        step_body({"model": "auto", "prompt": "x", "echo": True}, "s", chat=False)
    )


def test_json_answer_without_logprobs_unless_asked() -> None:
    body, kind = client_answer(CHAT_ANSWER, {"model": "auto"}, "small", chat=True)
    doc = orjson.loads(body)
    assert kind == JSON and doc["model"] == "small" and doc["choices"][0]["logprobs"] is None
    assert doc["usage"] == CHAT_ANSWER["usage"] and doc["choices"][0]["message"]["content"] == "Hello there"
    body, _ = client_answer(CHAT_ANSWER, {"model": "auto", "logprobs": True}, "small", chat=True)
    assert orjson.loads(body)["choices"][0]["logprobs"] == CHAT_ANSWER["choices"][0]["logprobs"]


def test_chat_stream() -> None:
    client = {"model": "auto", "stream": True, "stream_options": {"include_usage": True}}
    body, kind = client_answer(CHAT_ANSWER, client, "small", chat=True)
    assert kind == SSE
    got = events(body)
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "small" for c in chunks)
    assert all(c["id"] == "chatcmpl-1" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "Hello there"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [None, None, "stop"]
    assert all(c["choices"][0]["logprobs"] is None for c in chunks if c["choices"])
    assert chunks[-1] == {
        **{k: chunks[0][k] for k in ("id", "object", "created", "model")},
        "choices": [],
        "usage": CHAT_ANSWER["usage"],
    }


def test_stream_without_usage_and_tool_calls_indexed() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    answer = {**CHAT_ANSWER, "model": "small"}
    answer["choices"] = [
        {
            "index": 0,
            "message": {"role": "assistant", "content": None, "tool_calls": [call]},
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ]
    got = events(sse(answer, chat=True, include_usage=False))
    assert all(e == "[DONE]" or e["choices"] for e in got)  # no usage chunk
    assert got[1]["choices"][0]["delta"] == {"tool_calls": [{"index": 0, **call}]}


def test_completions_stream() -> None:
    answer = {
        "id": "cmpl-1",
        "created": 1,
        "model": "x",
        "choices": [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
    }
    body, kind = client_answer(answer, {"model": "auto", "stream": True}, "small", chat=False)
    got = events(body)
    assert kind == SSE and got[-1] == "[DONE]"
    assert [c["object"] for c in got[:-1]] == ["text_completion", "text_completion"]
    assert "".join(c["choices"][0]["text"] for c in got[:-1]) == "abc"
