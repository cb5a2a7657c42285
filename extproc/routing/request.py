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

SGLang's ``lora_path`` and ``extra_key`` are refused (:data:`ENGINE_SELECTORS`): they would choose an
adapter or a cache key past what the gateway admits and routes on. Other fields are passed through
untouched for the engine to validate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import orjson

from contracts.digest import MAX_TOKEN_ID
from contracts.handoff import HANDOFF_FIELDS
from extproc.errors import BadRequest, NotFound
from extproc.routing.sampling import check_sampling


class Kind(Enum):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"
    RESPONSES = "responses"
    SCORE = "score"
    RERANK = "rerank"


#: Kinds whose prompt is a chat (rendered with the model's chat template).
CHAT_KINDS = frozenset({Kind.CHAT, Kind.RESPONSES})
#: Kinds a prefill/decode pair can serve (vLLM's ``kv_transfer_params`` ride on these two routes).
GENERATIVE_KINDS = frozenset({Kind.CHAT, Kind.COMPLETION})
#: Kinds served by pooling models (no output tokens: no sampling options, no output budget).
POOLING_KINDS = frozenset({Kind.EMBEDDING, Kind.SCORE, Kind.RERANK})

#: Routed API paths (query strings are ignored) -> request kind: OpenAI's, and vLLM's score/rerank
#: (``/score``, ``/v1/score``; ``/rerank``, ``/v1/rerank``, ``/v2/rerank``).
ROUTES: dict[str, Kind] = {
    "/v1/chat/completions": Kind.CHAT,
    "/v1/completions": Kind.COMPLETION,
    "/v1/embeddings": Kind.EMBEDDING,
    "/v1/responses": Kind.RESPONSES,
    "/score": Kind.SCORE,
    "/v1/score": Kind.SCORE,
    "/rerank": Kind.RERANK,
    "/v1/rerank": Kind.RERANK,
    "/v2/rerank": Kind.RERANK,
}
MODELS_PATH = "/v1/models"
#: Body fields by which a client would choose, at the engine, what the gateway admits and routes on
#: (SGLang's OpenAI server reads both): refused with a 400 naming the field. ``lora_path`` picks an
#: adapter beside the ``model`` a tenant is allowed, budgeted and routed on; ``extra_key`` is joined to
#: ``cache_salt`` as the engine's prefix-cache key, so a client's own could name an isolated tenant's
#: salt (``"kvg"`` + ``"ate-..."``) past the ``reserved_cache_salt`` check and split the cache from the
#: router's digests.
ENGINE_SELECTORS = {
    "lora_path": "choose a LoRA adapter by its model name.",
    "extra_key": "use 'cache_salt' to separate a prefix cache.",
}
#: The longest ``cache_salt`` vLLM takes, in characters, and the characters it refuses in one.
MAX_CACHE_SALT = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")
#: The deepest nesting of arrays and objects orjson encodes (it decodes 1024): the gateway encodes a body
#: again when it rewrites it (model, cache_salt, priority) or hashes it as bytes, so a deeper one is a 400.
MAX_BODY_DEPTH = 254


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated OpenAI request.

    ``messages``/``tools``/``template_kwargs`` are set for chat and responses (``input`` and
    ``instructions`` as chat messages); a chat's ``continue_final_message`` and ``documents`` go to its
    template and ``add_special_tokens`` adds the tokenizer's own (a BOS) to the render, as in vLLM;
    ``prompt`` (text or token ids) for completions, and for embeddings (the first ``input``), score (the
    first query) and rerank (the query), the text the prefix index routes on. ``cache_salt`` (vLLM's
    per-tenant cache isolation) and the adapter named as ``model`` separate digest chains.
    """

    kind: Kind
    model: str
    body: Mapping[str, Any]
    stream: bool
    messages: Sequence[Mapping[str, Any]] = ()
    tools: Sequence[Mapping[str, Any]] | None = None
    template_kwargs: Mapping[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: Sequence[Any] | None = None
    add_special_tokens: bool = False
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
    if raw.count(b"[") + raw.count(b"{") > MAX_BODY_DEPTH:  # only then can it be that deep
        try:
            orjson.dumps(body)
        except orjson.JSONEncodeError:
            raise BadRequest("The request body is nested too deeply.") from None
    model = body.get("model")
    if model is None:
        raise BadRequest("you must provide a model parameter", param="model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string.", param="model")
    for field, why in ENGINE_SELECTORS.items():
        if field in body:
            raise BadRequest(f"'{field}' is not accepted by this gateway: {why}", param=field)
    stream = _opt(body, "stream", bool, False)
    cache_salt = _cache_salt(body)
    if kind in POOLING_KINDS:
        return _pooling(kind, body, model, cache_salt)
    if kind is Kind.RESPONSES:
        return _responses(body, model, stream, cache_salt)
    check_sampling(body, chat=kind is Kind.CHAT, stream=stream)
    if kind is Kind.CHAT:
        return _chat(body, model, stream, cache_salt)
    return _completion(body, model, stream, cache_salt)


def _chat(body: dict[str, Any], model: str, stream: bool, cache_salt: str | None) -> ParsedRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array.", param="messages")
    for i, message in enumerate(messages):
        if type(message) is dict and type(message.get("role")) is str and type(message.get("content")) is str:
            continue  # the common message passes every check below
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
    continue_final_message = _opt(body, "continue_final_message", bool, False)
    if continue_final_message and body.get("add_generation_prompt"):
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
        continue_final_message=continue_final_message,
        documents=_opt(body, "documents", list, None),
        add_special_tokens=_opt(body, "add_special_tokens", bool, False),
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


def _pooling(kind: Kind, body: dict[str, Any], model: str, cache_salt: str | None) -> ParsedRequest:
    """Embeddings (``input``: a string, token ids, or a non-empty array of either), vLLM's score (a query
    and documents: ``queries``/``documents``, ``data_1``/``data_2`` or ``text_1``/``text_2``, each a string
    or a non-empty array of strings) and rerank (``query`` a string, ``documents`` a non-empty array of
    strings or ``{"text": ...}`` objects). Routed on the first input or the query."""
    if kind is Kind.EMBEDDING:
        prompt = _first_prompt(body.get("input"), "input")
    elif kind is Kind.SCORE:
        pairs = [("queries", "documents"), ("data_1", "data_2"), ("text_1", "text_2")]
        given = [(a, b) for a, b in pairs if a in body or b in body]
        if len(given) != 1:
            raise BadRequest(
                "A score request needs one pair of 'queries' and 'documents' (or 'text_1' and 'text_2').",
                param="queries",
            )
        first, second = given[0]
        prompt = _texts(body.get(first), first)
        _texts(body.get(second), second)
    else:
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise BadRequest("'query' must be a non-empty string.", param="query")
        documents = body.get("documents")
        if not isinstance(documents, list) or not documents:
            raise BadRequest("'documents' must be a non-empty array.", param="documents")
        for i, doc in enumerate(documents):
            if not isinstance(doc, str) and not (isinstance(doc, dict) and isinstance(doc.get("text"), str)):
                raise BadRequest(
                    f"'documents[{i}]' must be a string or an object with a 'text' string.",
                    param=f"documents[{i}]",
                )
        top_n = body.get("top_n")
        if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
            raise BadRequest("'top_n' must be an integer >= 0.", param="top_n")
        prompt = query
    return ParsedRequest(
        kind=kind, model=model, body=body, stream=False, prompt=prompt, cache_salt=cache_salt
    )


def _first_prompt(value: object, key: str) -> str | Sequence[int]:
    """An embeddings ``input``: its (first) string or token-id array."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and _is_token_ids(value):
        return [int(t) for t in value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) and v for v in value):
            return str(value[0])
        if all(_is_token_ids(v) for v in value):
            return [int(t) for t in value[0]]
    raise BadRequest(
        f"'{key}' must be a non-empty string, token ids, or an array of strings or of token-id arrays.",
        param=key,
    )


def _texts(value: object, key: str) -> str:
    """A score side: a non-empty string or a non-empty array of them; the first."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return str(value[0])
    raise BadRequest(f"'{key}' must be a non-empty string or an array of strings.", param=key)


#: Responses API content part types whose ``text`` the chat template sees.
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _responses(body: dict[str, Any], model: str, stream: bool, cache_salt: str | None) -> ParsedRequest:
    """OpenAI's Responses API: ``input`` a string (one user message) or an array of message items
    (``{"role", "content"}``, ``type`` ``"message"`` or absent; content a string or ``input_text`` /
    ``output_text`` parts), ``instructions`` a system message before them; ``max_output_tokens`` >= 1.
    Items of other types (function calls and their outputs, reasoning) are passed to the engine and left
    out of the prompt the gateway routes on."""
    raw = body.get("input")
    instructions = _opt(body, "instructions", str, None)
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(raw, str) and raw:
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list) and raw:
        for i, item in enumerate(raw):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise BadRequest(f"'{where}' must be an object.", param=where)
            if item.get("type", "message") != "message":
                continue
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(
                    f"'{where}.role' must be one of user, assistant, system, developer.",
                    param=f"{where}.role",
                )
            messages.append(
                {"role": "system" if role == "developer" else role, "content": _item_text(item, where)}
            )
    else:
        raise BadRequest("'input' must be a non-empty string or a non-empty array of items.", param="input")
    limit = body.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise BadRequest("'max_output_tokens' must be an integer >= 1.", param="max_output_tokens")
    for key in ("temperature", "top_p"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
            raise BadRequest(f"'{key}' must be a number >= 0.", param=key)
    _opt(body, "tools", list, None)
    return ParsedRequest(
        kind=Kind.RESPONSES,
        model=model,
        body=body,
        stream=stream,
        messages=messages,
        tools=None,  # Responses tools are shaped differently from chat's: left to the engine
        add_generation_prompt=True,
        cache_salt=cache_salt,
    )


def _item_text(item: Mapping[str, Any], where: str) -> str:
    """A message item's text: its string content, or its text parts joined."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise BadRequest(
                    f"'{where}.content[{j}]' must be an object with a 'type'.", param=f"{where}.content"
                )
            if part["type"] in _TEXT_PARTS:
                text = part.get("text")
                if not isinstance(text, str):
                    raise BadRequest(
                        f"'{where}.content[{j}].text' must be a string.", param=f"{where}.content"
                    )
                texts.append(text)
        return "".join(texts)
    raise BadRequest(f"'{where}.content' must be a string or an array of parts.", param=f"{where}.content")


def _is_token_ids(prompt: object) -> bool:
    """Whether ``prompt`` is a non-empty array of token ids (integers 0..2^32 - 1: no vocabulary is larger,
    and the digest chain packs each in 32 bits, :data:`contracts.digest.MAX_TOKEN_ID`)."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in prompt)
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


def with_cache_salt(request: ParsedRequest, salt: str) -> tuple[ParsedRequest, bytes]:
    """The request with ``cache_salt`` = ``salt`` (tenant KV isolation, :mod:`extproc.admission.isolation`)
    and its re-encoded body."""
    body = {**request.body, "cache_salt": salt}
    return replace(request, cache_salt=salt, body=body), orjson.dumps(body)


def without_handoff(request: ParsedRequest, body: bytes) -> tuple[ParsedRequest, bytes]:
    """The request without the client's own handoff fields (:data:`contracts.handoff.HANDOFF_FIELDS`) and
    its body, re-encoded only when it had one (the common body is returned as it came)."""
    if HANDOFF_FIELDS.isdisjoint(request.body):
        return request, body
    doc = {k: v for k, v in request.body.items() if k not in HANDOFF_FIELDS}
    return replace(request, body=doc), orjson.dumps(doc)


def rewrite_model(request: ParsedRequest, model: str) -> tuple[ParsedRequest, bytes]:
    """The request for ``model`` instead (EPP ``x-gateway-model-name-rewrite``) and its re-encoded body."""
    body = {**request.body, "model": model}
    return replace(request, model=model, body=body), orjson.dumps(body)


def unknown_path(path: str) -> NotFound:
    return NotFound(f"Unknown path {path.split('?', 1)[0][:200]}; kvgate routes {', '.join(ROUTES)}.")
