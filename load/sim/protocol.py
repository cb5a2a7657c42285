"""The OpenAI/vLLM wire format: request validation and response bodies. No IO.

Requests are checked the way vLLM checks them (types, lengths, the served model name) and every failure
is a :class:`SimError` with an HTTP status, serialised as vLLM's ``{"error": {message, type, param,
code}}``. Fields that only change sampling (``temperature``, ``top_p``, ``stop``, ``ignore_eos``, ...)
are accepted and ignored: output is always ``max_tokens`` tokens long. Features that would change the
shape of a response (``n`` > 1, ``echo``, ``logprobs``, batched prompts, non-text content) are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson

DEFAULT_MAX_TOKENS = 16


class SimError(Exception):
    """A request failure: HTTP ``status``, a message for the client and the offending ``param``."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> bytes:
        """vLLM's error JSON; ``type`` is e.g. ``BadRequestError``, ``code`` the HTTP status."""
        kind = HTTPStatus(self.status).phrase.replace(" ", "").replace("-", "") + "Error"
        return orjson.dumps(
            {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}
        )


def bad(message: str, param: str | None = None) -> SimError:
    """A 400 error."""
    return SimError(400, message, param=param)


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """What renders a chat into prompt tokens (chat completions and ``/tokenize`` with messages)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """A completion prompt: text to tokenize or token ids as given."""

    prompt: str | list[int]
    add_special_tokens: bool


@dataclass(frozen=True, slots=True)
class Generation:
    """Output options: ``max_tokens`` (``None``: the default), streaming, usage in the stream, seed."""

    max_tokens: int | None
    stream: bool
    include_usage: bool
    seed: int | None


def parse_body(raw: bytes) -> dict[str, Any]:
    """A JSON object body."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad(f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object")
    return body


def check_model(body: dict[str, Any], served: str) -> None:
    """404 unless ``model`` is absent or the served name."""
    model = body.get("model")
    if model is None or model == served:
        return
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    raise SimError(404, f"The model `{model}` does not exist.", param="model")


def parse_chat(body: dict[str, Any]) -> ChatPrompt:
    """Messages and template options of a chat request."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise bad("'tools' must be a list of objects", "tools")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return ChatPrompt(
        messages=[_message(m) for m in messages],
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        continue_final_message=_bool(body, "continue_final_message", False),
        add_special_tokens=_bool(body, "add_special_tokens", False),
        tools=tools,
        template_kwargs=kwargs,
    )


def parse_text_prompt(body: dict[str, Any]) -> TextPrompt:
    """The prompt of a completion or ``/tokenize`` request: a string or token ids (a batch of one)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise bad("'prompt' must be a string, a list of token ids, or a batch of one of them", "prompt")
    elif not isinstance(prompt, str):
        raise bad("'prompt' must be a string or a list of token ids (batches are not simulated)", "prompt")
    return TextPrompt(prompt, _bool(body, "add_special_tokens", True))


def parse_generation(body: dict[str, Any], *, chat: bool) -> Generation:
    """Output options of a completion request."""
    max_tokens = _opt_int(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise bad(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    n = _opt_int(body, "n")
    if n not in (None, 1):
        raise bad("n > 1 is not supported by the simulator", "n")
    if _bool(body, "echo", False):
        raise bad("echo is not supported by the simulator", "echo")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad("logprobs are not supported by the simulator", "logprobs")
    _bool(body, "ignore_eos", False)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("Stream options can only be defined when `stream=True`.", "stream_options")
        if not isinstance(options, dict):
            raise bad("'stream_options' must be an object", "stream_options")
    include_usage = options is not None and _bool(options, "include_usage", False)
    return Generation(max_tokens, stream, include_usage, _opt_int(body, "seed"))


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """The output length, or vLLM's context-length errors."""
    if prompt_len >= max_model_len:
        raise bad(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages."
        )
    if requested is None:
        return min(DEFAULT_MAX_TOKENS, max_model_len - prompt_len)
    if prompt_len + requested > max_model_len:
        raise bad(
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum "
            f"context length is {max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({requested} > {max_model_len} - {prompt_len}).",
            "max_tokens",
        )
    return requested


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The ``usage`` object; ``cached_tokens`` are prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_chunk(
    rid: str, created: int, model: str, delta: dict[str, Any], finish: str | None
) -> dict[str, Any]:
    """One ``chat.completion.chunk``."""
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None) -> dict[str, Any]:
    """One streamed ``text_completion``."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, obj: str, created: int, model: str, use: dict[str, Any]) -> dict[str, Any]:
    """The final chunk of a stream with ``include_usage``."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def chat_response(rid: str, created: int, model: str, text: str, use: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed ``chat.completion`` cut at ``max_tokens``."""
    message = {"role": "assistant", "content": text, "tool_calls": []}
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
        "prompt_logprobs": None,
    }


def completion_response(rid: str, created: int, model: str, text: str, use: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed ``text_completion`` cut at ``max_tokens``."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def models_response(model: str, root: str, max_model_len: int, created: int) -> dict[str, Any]:
    """``GET /v1/models``."""
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [],
    }
    return {"object": "list", "data": [card]}


def _message(raw: object) -> dict[str, Any]:
    """A chat message as vLLM hands it to the template: text parts joined by newlines, tool call
    arguments parsed from JSON strings into objects."""
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise bad("each message must be an object with a string 'role'", "messages")
    content = raw.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad("only text content parts are supported by the simulator", "messages")
            parts.append(part["text"])
        text = "\n".join(parts)
    else:
        raise bad("message 'content' must be a string, a list of parts or null", "messages")
    message: dict[str, Any] = {"role": raw["role"], "content": text}
    if isinstance(raw.get("name"), str):
        message["name"] = raw["name"]
    if raw["role"] == "tool" and "tool_call_id" in raw:
        message["tool_call_id"] = raw["tool_call_id"]
    if raw["role"] == "assistant" and isinstance(raw.get("tool_calls"), list):
        message["tool_calls"] = [_tool_call(c) for c in raw["tool_calls"]]
    return message


def _tool_call(raw: object) -> dict[str, Any]:
    if not isinstance(raw, dict) or not isinstance(raw.get("function"), dict):
        raise bad("each tool call must be an object with a 'function' object", "messages")
    function = dict(raw["function"])
    arguments = function.get("arguments")
    if not arguments:
        function["arguments"] = {}
    elif isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise bad(f"tool call arguments are not valid JSON: {exc}", "messages") from exc
    return {**raw, "function": function}


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{key}' must be a boolean", key)
    return value


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(f"'{key}' must be an integer", key)
    return value
