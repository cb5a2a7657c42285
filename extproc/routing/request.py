"""OpenAI request understanding: the body is parsed once, here, into a :class:`ParsedRequest`.

Only what routing needs is kept, but every field the gateway reads is type-checked so a malformed
request is refused with a 400 before it can reach an engine, and so is every value vLLM 0.33 would refuse
that can be told from the body alone: the output options in :mod:`extproc.routing.sampling` (its table),
and these (vLLM's words on the right)::

    cache_salt "", over 128 characters, or with @ / \\ NUL   Parameter 'cache_salt' must be a non-empty
                                                          string ... / must be at most 128 characters ...
    tools []                                              `tools` must not be an empty array. ...
    tool_choice other than "none" without tools           When using `tool_choice`, `tools` must be set.
    tool_choice not "none"/"auto"/"required"/an object    Invalid value for `tool_choice`: ...
    tool_choice.function not an object / no name /        Invalid value for `function` ... / Expected
      a name no tool has                                  field `name` ... / The tool specified in
                                                          `tool_choice` does not match any of ...
    continue_final_message and add_generation_prompt      Cannot set both `continue_final_message` and
      both true                                           `add_generation_prompt` to True.
    prompt "" (completions, without prompt_embeds)        Either prompt or prompt_embeds must be provided
                                                          and non-empty.
    a prompt batch mixing strings and token ids, or an    pydantic's type errors; The decoder prompt
      empty token-id array                                cannot be empty

Other fields are passed through untouched for the engine to validate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import orjson

from extproc.errors import BadRequest, NotFound
from extproc.routing.sampling import check_sampling


class Kind(Enum):
    CHAT = "chat"
    COMPLETION = "completion"


#: Routed API paths (query strings are ignored) -> request kind.
ROUTES: dict[str, Kind] = {"/v1/chat/completions": Kind.CHAT, "/v1/completions": Kind.COMPLETION}
MODELS_PATH = "/v1/models"
#: The longest ``cache_salt`` vLLM takes, in characters, and the characters it refuses in one.
MAX_CACHE_SALT = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")


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
    check_sampling(body, chat=kind is Kind.CHAT, stream=stream)
    cache_salt = _cache_salt(body)
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
    if tools == []:
        raise BadRequest("'tools' must not be empty: leave it out instead.", param="tools")
    _check_tool_choice(body.get("tool_choice"), tools)
    add_generation_prompt = _opt(body, "add_generation_prompt", bool, True)
    if _opt(body, "continue_final_message", bool, False) and body.get("add_generation_prompt"):
        raise BadRequest(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
            param="continue_final_message",
        )
    return ParsedRequest(
        kind=Kind.CHAT,
        model=model,
        body=body,
        stream=stream,
        messages=messages,
        tools=tools,
        template_kwargs=_opt(body, "chat_template_kwargs", dict, None),
        add_generation_prompt=add_generation_prompt,
        cache_salt=cache_salt,
    )


def _check_tool_choice(choice: object, tools: Sequence[Mapping[str, Any]] | None) -> None:
    """``tool_choice``: ``"none"``, or with ``tools`` also ``"auto"``, ``"required"`` or
    ``{"type": "function", "function": {"name": N}}`` naming one of them."""
    if choice is None or choice == "none":
        return
    if tools is None:
        raise BadRequest("'tool_choice' needs 'tools'.", param="tool_choice")
    if choice in ("auto", "required"):
        return
    if not isinstance(choice, dict):
        raise BadRequest(
            '\'tool_choice\' must be "none", "auto", "required" or a named function.',
            param="tool_choice",
        )
    function = choice.get("function")
    if not isinstance(function, dict):
        raise BadRequest(
            '\'tool_choice.function\' must be an object such as {"name": "my_function"}.',
            param="tool_choice.function",
        )
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(
            "'tool_choice.function.name' must be a non-empty string.", param="tool_choice.function.name"
        )
    if not any(isinstance(t.get("function"), dict) and t["function"].get("name") == name for t in tools):
        raise BadRequest("'tool_choice' names a function that is not among the 'tools'.", param="tool_choice")


def _completion(body: dict[str, Any], model: str, stream: bool, cache_salt: str | None) -> ParsedRequest:
    prompt = body.get("prompt")
    if prompt == "" and not body.get("prompt_embeds"):
        raise BadRequest("'prompt' must not be empty.", param="prompt")
    # A batch (all strings or all token-id arrays) is routed on its first prompt.
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        if not all(_is_token_ids(p) for p in prompt):
            raise BadRequest(_PROMPT, param="prompt")
        prompt = prompt[0]
    elif not isinstance(prompt, str) and not _is_token_ids(prompt):
        raise BadRequest(_PROMPT, param="prompt")
    return ParsedRequest(
        kind=Kind.COMPLETION, model=model, body=body, stream=stream, prompt=prompt, cache_salt=cache_salt
    )


_PROMPT = "'prompt' must be a string, token ids, or an array of strings or of token-id arrays."


def _is_token_ids(prompt: object) -> bool:
    """Whether ``prompt`` is a non-empty array of token ids (integers >= 0)."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    )


def _cache_salt(body: Mapping[str, Any]) -> str | None:
    """``cache_salt``: as vLLM takes it, 1 to 128 characters, none of ``@``, ``/``, ``\\`` or NUL."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise BadRequest("'cache_salt' must be a non-empty string.", param="cache_salt")
    if len(salt) > MAX_CACHE_SALT or any(c in _SALT_FORBIDDEN for c in salt):
        raise BadRequest(
            f"'cache_salt' must be at most {MAX_CACHE_SALT} characters, none of '@', '/', '\\' or NUL.",
            param="cache_salt",
        )
    return salt


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
