"""What a migrated request sends next: the client's request, continued from what it already got.

Pure functions over parsed JSON bodies (no IO). The rules (README.md):

* **chat** (``/v1/chat/completions``): the messages plus one assistant message holding the text already
  sent, with ``continue_final_message: true`` and ``add_generation_prompt: false`` (vLLM's and SGLang's
  OpenAI servers render it without closing the assistant turn, so the engine goes on where the text
  stops). A request that already continued its own last assistant message gets the text appended to it.
* **completions** (``/v1/completions``): the prompt plus the text already sent; ``echo`` off (a request
  with ``echo: true`` is not migratable: its echoed prompt would be counted as answer text).
* **both**: no prefill/decode handoff fields (:data:`contracts.handoff.HANDOFF_FIELDS`; a re-issue drops
  them too);
  ``max_tokens`` / ``max_completion_tokens`` (and ``min_tokens``) lowered by the tokens already
  produced; the engine streams with ``stream_options {include_usage, continuous_usage_stats}`` so the
  proxy knows, chunk by chunk, how many tokens each try produced (the client's own usage choice is
  applied by :mod:`extproc.migration.splice`).

:func:`migratable` says whether a request can be continued at all; one that cannot is still proxied,
and re-issued whole only while nothing reached its client.
"""

from __future__ import annotations

import copy
from typing import Any

from contracts.handoff import HANDOFF_FIELDS

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

#: Body keys that bound the answer's length in tokens, lowered by what was produced.
_LIMITS = ("max_tokens", "max_completion_tokens")


def without_handoff(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without :data:`HANDOFF_FIELDS` (the body of a try after the first)."""
    if HANDOFF_FIELDS.isdisjoint(body):
        return body
    return {k: v for k, v in body.items() if k not in HANDOFF_FIELDS}


def migratable(path: str, body: dict[str, Any]) -> str | None:
    """``None`` when a streamed request on ``path`` with ``body`` can be continued elsewhere, else the
    reason it cannot (a metric label)."""
    if path not in (CHAT_PATH, COMPLETIONS_PATH):
        return "route"
    if body.get("echo") is True:
        return "echo"  # the echoed prompt would be taken for answer text
    if body.get("n", 1) not in (1, None) or body.get("best_of") not in (None, 1):
        return "several_choices"
    if body.get("response_format") not in (None, {"type": "text"}) or any(
        k in body
        for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
    ):
        return "structured"  # a grammar restarted mid-answer would not hold
    if path == CHAT_PATH:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "messages"
        if body.get("tools") and body.get("tool_choice") not in (None, "none"):
            return "tools"  # a tool call cut mid-way cannot be continued as text
    elif not isinstance(body.get("prompt"), str):
        return "prompt"  # batches and token-id prompts: one text prompt only
    return None


def stream_body(body: dict[str, Any]) -> dict[str, Any]:
    """The first try's body: the client's, with per-chunk usage asked of the engine."""
    sent = dict(body)
    sent["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return sent


def continuation(path: str, body: dict[str, Any], text: str, produced: int) -> dict[str, Any] | None:
    """The body that continues ``body`` (the client's, on ``path``) after ``text`` (everything sent to
    the client so far, ``produced`` tokens); ``None`` when nothing is left to generate (the length
    limit was reached: the proxy ends the stream itself)."""
    sent = stream_body(copy.deepcopy(without_handoff(body)))
    for key in _LIMITS:
        limit = sent.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - produced <= 0:
                return None
            sent[key] = limit - produced
    min_tokens = sent.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens:
        sent["min_tokens"] = max(0, min_tokens - produced)
    if path == COMPLETIONS_PATH:
        sent["prompt"] = str(body["prompt"]) + text
        sent["echo"] = False
        return sent
    messages: list[Any] = sent["messages"]
    if body.get("continue_final_message") and _is_assistant(messages[-1]):
        messages[-1] = _appended(messages[-1], text)
    else:
        messages.append({"role": "assistant", "content": text})
    sent["continue_final_message"] = True
    sent["add_generation_prompt"] = False
    sent["echo"] = False
    return sent


def _is_assistant(message: object) -> bool:
    return isinstance(message, dict) and message.get("role") == "assistant"


def _appended(message: dict[str, Any], text: str) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": [*content, {"type": "text", "text": text}]}
    return {**message, "content": (content if isinstance(content, str) else "") + text}
