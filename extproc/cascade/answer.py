"""The bodies of a cascade (sans IO): what a gated step is asked, and what the client gets when a gated
step's answer passes.

* :func:`step_body`: the client's body for step model ``model``, with the step's token log-probabilities
  requested (chat ``logprobs: true``, the client's ``top_logprobs`` kept; completions ``logprobs`` at
  least 1; ``echo`` dropped: the gate judges the answer's tokens, not the prompt's, and a cascade refuses
  ``echo: true``, :meth:`~extproc.cascade.plan.Cascader.start`) and not streamed (``stream`` false,
  ``stream_options`` dropped): the gate reads the whole answer; a ``first_k`` gate streams it instead
  (``include_usage``) and decides after ``k`` tokens (:mod:`extproc.cascade.stream`). A ``replay`` run's
  ``seed`` is set in it (the replayed step gets the same one).
* :func:`client_answer`: the step's answer as the client asked for it: its ``model`` field the step's
  model, the log-probabilities removed unless the client asked for them, and for a streaming client a
  Server-Sent Events stream (:func:`sse`) instead of one JSON object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

SSE = "text/event-stream"
JSON = "application/json"


def step_body(
    client: Mapping[str, Any], model: str, *, chat: bool, stream: bool = False, seed: int | None = None
) -> bytes:
    """The gated step's request body (module docstring); ``stream``: streamed with its usage (a
    ``first_k`` gate reads the first tokens as they come); ``seed``: the run's (a ``replay`` cascade)."""
    body = {k: v for k, v in client.items() if k not in ("stream_options", "echo")}
    body["model"] = model
    if seed is not None:
        body["seed"] = seed
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["logprobs"] = True
    else:
        asked = client.get("logprobs")
        body["logprobs"] = max(1, asked) if isinstance(asked, int) and not isinstance(asked, bool) else 1
    return orjson.dumps(body)


def well_shaped(answer: Mapping[str, Any], *, chat: bool) -> bool:
    """Whether a step's (non-streamed) answer can be returned as the client asked (:func:`client_answer`):
    each choice an object; chat: its ``message`` an object (or null), with ``role``, ``content`` and
    ``reasoning_content`` strings or null and ``tool_calls`` a list of objects (or null); completions: its
    ``text`` a string or null. The streamed gate refuses the same shapes (:mod:`extproc.cascade.stream`)."""
    choices = answer.get("choices")
    for c in choices if isinstance(choices, list) else ():  # none: the gate finds no logprobs
        if not isinstance(c, Mapping):
            return False
        if not chat:
            if not isinstance(c.get("text"), str | None):
                return False
            continue
        message = c.get("message")
        if message is None:
            continue
        if not isinstance(message, Mapping):
            return False
        if not all(isinstance(message.get(k), str | None) for k in ("role", "content", "reasoning_content")):
            return False
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(x, Mapping) for x in calls)):
            return False
    return True


def wants_logprobs(client: Mapping[str, Any], *, chat: bool) -> bool:
    """Whether the client itself asked for log-probabilities (chat: ``logprobs`` true; completions: a
    ``logprobs`` count, 0 included)."""
    value = client.get("logprobs")
    return bool(value) if chat else value is not None and value is not False


def client_answer(
    answer: Mapping[str, Any], client: Mapping[str, Any], model: str, *, chat: bool
) -> tuple[bytes, str]:
    """(body, content type) of the answer the client gets from step ``model`` (module docstring)."""
    doc = dict(answer)
    doc["model"] = model
    keep = wants_logprobs(client, chat=chat)
    choices = doc.get("choices")
    if isinstance(choices, list):
        doc["choices"] = [
            {**c, "logprobs": c.get("logprobs") if keep else None} if isinstance(c, Mapping) else c
            for c in choices
        ]
    if client.get("stream") is True:
        options = client.get("stream_options")
        usage = isinstance(options, Mapping) and options.get("include_usage") is True
        return sse(doc, chat=chat, include_usage=usage), SSE
    return orjson.dumps(doc), JSON


def sse(answer: Mapping[str, Any], *, chat: bool, include_usage: bool) -> bytes:
    """A whole (non-streamed) answer as the stream its engine would have sent: per choice a role chunk
    (chat), one chunk with all of its content (and log-probabilities, if kept), a chunk with its
    ``finish_reason``; then, with ``include_usage``, a usage chunk with no choices; then ``[DONE]``."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": answer.get("id"), "object": obj, "created": answer.get("created"), "model": answer["model"]}
    choices = [c for c in answer.get("choices") or [] if isinstance(c, Mapping)]
    events: list[dict[str, Any]] = []

    def chunk(choice: dict[str, Any]) -> None:
        events.append({**head, "choices": [choice]})

    for c in choices:
        index = c.get("index", 0)
        if chat:
            message = c.get("message") or {}
            role = message.get("role", "assistant")
            chunk(
                {
                    "index": index,
                    "delta": {"role": role, "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
            delta = {k: v for k, v in message.items() if k != "role" and v is not None}
            calls = delta.get("tool_calls")
            if isinstance(calls, list):  # a streamed tool call carries its position
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            chunk({"index": index, "delta": delta, "logprobs": c.get("logprobs"), "finish_reason": None})
            chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": c.get("finish_reason")})
        else:
            chunk(
                {
                    "index": index,
                    "text": c.get("text", ""),
                    "logprobs": c.get("logprobs"),
                    "finish_reason": None,
                }
            )
            chunk({"index": index, "text": "", "logprobs": None, "finish_reason": c.get("finish_reason")})
    if include_usage and answer.get("usage") is not None:
        events.append({**head, "choices": [], "usage": answer["usage"]})
    out = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    return out + b"data: [DONE]\n\n"


def listed_with(models_body: bytes, virtual: list[str]) -> bytes:
    """An OpenAI ``/v1/models`` list body with the ``virtual`` model names added (owned by ``kvgate``)."""
    if not virtual:
        return models_body
    doc = orjson.loads(models_body)
    doc["data"] = [
        *doc.get("data", []),
        *({"id": m, "object": "model", "created": 0, "owned_by": "kvgate"} for m in virtual),
    ]
    return orjson.dumps(doc)
