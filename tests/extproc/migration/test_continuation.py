"""Continuation requests: the client's request continued from what it already got."""

from __future__ import annotations

from typing import Any

import pytest

from contracts.handoff import HANDOFF_FIELDS
from extproc.migration.continuation import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    continuation,
    migratable,
    stream_body,
    without_handoff,
)

CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 10,
}


def test_chat_gets_an_assistant_message_to_continue() -> None:
    body = continuation(CHAT_PATH, CHAT, "Hello wor", 3)
    assert body is not None
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello wor"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 7
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert CHAT["messages"] == [{"role": "user", "content": "hi"}] and CHAT["max_tokens"] == 10  # untouched


def test_a_client_continuation_is_appended_to() -> None:
    client = {
        **CHAT,
        "messages": [*CHAT["messages"], {"role": "assistant", "content": "Sure: "}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_completion_tokens": 5,
    }
    body = continuation(CHAT_PATH, client, "ok", 1)
    assert body is not None
    assert body["messages"][-1]["content"] == "Sure: ok" and len(body["messages"]) == 2
    assert body["max_completion_tokens"] == 4


def test_completions_extend_the_prompt() -> None:
    body = continuation(
        COMPLETIONS_PATH, {"model": "m", "prompt": "Once", "max_tokens": 4, "echo": True}, " upon", 1
    )
    assert (
        body is not None
        and body["prompt"] == "Once upon"
        and body["echo"] is False
        and body["max_tokens"] == 3
    )


def test_nothing_left_to_generate() -> None:
    assert continuation(CHAT_PATH, CHAT, "x" * 10, 10) is None


def test_first_try_asks_for_usage() -> None:
    assert stream_body(CHAT)["stream_options"]["continuous_usage_stats"] is True


@pytest.mark.parametrize(
    ("path", "extra", "reason"),
    [
        (CHAT_PATH, {}, None),
        ("/v1/embeddings", {}, "route"),
        (CHAT_PATH, {"n": 2}, "several_choices"),
        (CHAT_PATH, {"response_format": {"type": "json_object"}}, "structured"),
        (CHAT_PATH, {"tools": [{"type": "function"}], "tool_choice": "auto"}, "tools"),
        (CHAT_PATH, {"messages": []}, "messages"),
        (COMPLETIONS_PATH, {"prompt": ["a", "b"]}, "prompt"),
        (COMPLETIONS_PATH, {"prompt": "a"}, None),
        (COMPLETIONS_PATH, {"prompt": "a", "echo": True}, "echo"),  # the echo would count as answer text
        (COMPLETIONS_PATH, {"prompt": "a", "echo": False}, None),
        (CHAT_PATH, {"echo": True}, "echo"),
    ],
)
def test_what_can_migrate(path: str, extra: dict[str, Any], reason: str | None) -> None:
    assert migratable(path, {**CHAT, **extra}) == reason


HANDOFF: dict[str, Any] = {
    "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_host": "10.0.0.1"},
    "bootstrap_host": "10.0.0.1",
    "bootstrap_port": 8998,
    "bootstrap_room": 7,
}


@pytest.mark.parametrize(
    ("path", "body"),
    [(CHAT_PATH, CHAT), (COMPLETIONS_PATH, {"model": "m", "prompt": "Once", "max_tokens": 4})],
)
def test_a_continuation_carries_no_handoff_fields(path: str, body: dict[str, Any]) -> None:
    """They paired the first host with its prefill (an SGLang room serves once): the next host serves the
    continuation aggregated."""
    sent = continuation(path, {**body, **HANDOFF}, " upon", 1)
    assert sent is not None and not HANDOFF_FIELDS & set(sent)
    assert sent == continuation(path, body, " upon", 1)


def test_without_handoff() -> None:
    assert without_handoff({**CHAT, **HANDOFF}) == CHAT
    assert without_handoff(CHAT) is CHAT
