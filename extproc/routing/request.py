"""OpenAI request understanding: the body is parsed once, here, into a :class:`ParsedRequest`.

Only what routing needs is kept, but every field the gateway reads is type-checked so a malformed
request is refused with a 400 before it can reach an engine. Fields the gateway does not read are passed
through untouched for the engine to validate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import orjson

from extproc.errors import BadRequest, NotFound


class Kind(Enum):
    CHAT = "chat"
    COMPLETION = "completion"


#: Routed API paths (query strings are ignored) -> request kind.
ROUTES: dict[str, Kind] = {"/v1/chat/completions": Kind.CHAT, "/v1/completions": Kind.COMPLETION}
MODELS_PATH = "/v1/models"


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated OpenAI request.

    ``messages``/``tools``/``template_kwargs`` are set for chat; ``prompt`` (text or token ids) for
    completions. ``cache_salt`` (vLLM's per-tenant cache isolation) and ``lora`` separate digest chains.
    """

    kind: Kind
    model: str
    body: Mapping[str, Any]
    stream: bool
    messages: Sequence[Mapping[str, Any]] = ()
    tools: Sequence[Mapping[str, Any]] | None = None
    template_kwargs: Mapping[str, Any] | None = None
    add_generation_prompt: bool = True
    prompt: str | Sequence[int] | None = None
    cache_salt: str | None = None


def route_kind(path: str) -> Kind | None:
    """The request kind for a ``:path`` (query string ignored), or ``None`` if not a routed API."""
    return ROUTES.get(path.split("?", 1)[0])


def parse_body(kind: Kind, raw: bytes) -> ParsedRequest:
    """Decode and validate a request body; raises :class:`BadRequest` with the offending field."""
    if not raw:
        raise BadRequest("The request body is empty; expected a JSON object.")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "UTF-8" in str(exc):
            raise BadRequest("The request body is not valid UTF-8.") from None
        raise BadRequest("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    model = body.get("model")
    if model is None:
        raise BadRequest("you must provide a model parameter", param="model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string.", param="model")
    stream = _opt(body, "stream", bool, False)
    _opt(body, "stream_options", dict, None)
    for key in ("max_tokens", "max_completion_tokens", "n"):
        value = _opt(body, key, int, None)
        if value is not None and value < 0:
            raise BadRequest(f"'{key}' must be >= 0.", param=key)
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _opt(body, key, (int, float), None)
    cache_salt = _opt(body, "cache_salt", str, None)
    if kind is Kind.CHAT:
        return _chat(body, model, stream, cache_salt)
    return _completion(body, model, stream, cache_salt)


def _chat(body: dict[str, Any], model: str, stream: bool, cache_salt: str | None) -> ParsedRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array.", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"'messages[{i}]' must be an object.", param=f"messages[{i}]")
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"'messages[{i}].role' must be a string.", param=f"messages[{i}].role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(
                f"'messages[{i}].content' must be a string or an array of parts.",
                param=f"messages[{i}].content",
            )
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise BadRequest(
                        f"'messages[{i}].content' parts must be objects with a 'type'.",
                        param=f"messages[{i}].content",
                    )
    tools = _opt(body, "tools", list, None)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise BadRequest("'tools' must be an array of objects.", param="tools")
    return ParsedRequest(
        kind=Kind.CHAT,
        model=model,
        body=body,
        stream=stream,
        messages=messages,
        tools=tools,
        template_kwargs=_opt(body, "chat_template_kwargs", dict, None),
        add_generation_prompt=_opt(body, "add_generation_prompt", bool, True),
        cache_salt=cache_salt,
    )


def _completion(body: dict[str, Any], model: str, stream: bool, cache_salt: str | None) -> ParsedRequest:
    prompt = body.get("prompt")
    # A batch (list of strings or of token lists) is routed on its first prompt.
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise BadRequest(
                "'prompt' must be a string, an array of strings or of token ids.", param="prompt"
            )
    elif not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string, an array of strings or of token ids.", param="prompt")
    return ParsedRequest(
        kind=Kind.COMPLETION, model=model, body=body, stream=stream, prompt=prompt, cache_salt=cache_salt
    )


def _opt(body: Mapping[str, Any], key: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise BadRequest(f"'{key}' has the wrong type.", param=key)
    if not isinstance(value, kinds):
        raise BadRequest(f"'{key}' has the wrong type.", param=key)
    return value


def rewrite_model(request: ParsedRequest, model: str) -> tuple[ParsedRequest, bytes]:
    """The request for ``model`` instead (EPP ``x-gateway-model-name-rewrite``) and its re-encoded body."""
    body = {**request.body, "model": model}
    return replace(request, model=model, body=body), orjson.dumps(body)


def unknown_path(path: str) -> NotFound:
    return NotFound(f"Unknown path {path.split('?', 1)[0][:200]}; kvgate routes {', '.join(ROUTES)}.")
