"""The OpenAI/vLLM request side: body parsing and validation, as vLLM 0.33 does it. No IO.

vLLM validates a body with pydantic in lax mode (:mod:`load.sim.fields`; unknown fields are ignored),
then with its request models' validators and ``SamplingParams``' checks; the sim does the same for
every field it reads and for the sampling fields whose ranges vLLM checks, failing with vLLM's errors
(:mod:`load.sim.errors`). The field-by-field comparison with vLLM, with the vLLM file each behaviour
comes from, is the table in README.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from load.sim.errors import SimError, invalid, refused, validation_error
from load.sim.fields import lax_bool, lax_float, lax_int, opt, strict_dict, strict_list, strict_str

DEFAULT_MAX_TOKENS = 16  # CompletionRequest.max_tokens; chat's default is documented in README.md
MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
MAX_STOP_STRINGS = 4  # VLLM_MAX_STOP_STRINGS
MAX_N = 16384  # VLLM_MAX_N_SEQUENCES
MAX_PROMPTS = 1024  # VLLM_MAX_COMPLETION_PROMPTS
_INT64 = 2**63
_GREEDY_EPS = 1e-5


# -- bodies -----------------------------------------------------------------------------------------


def parse_body(raw: bytes) -> dict[str, Any]:
    """A JSON object body; FastAPI's errors otherwise."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:  # FastAPI decodes with the standard library: its message and position are what vLLM shows
            json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            pos, reason = (exc.pos, exc.msg) if isinstance(exc, json.JSONDecodeError) else (0, str(exc))
            raise validation_error(str(pos), "json_invalid", "JSON decode error", {}, error=reason) from None
        raise validation_error("0", "json_invalid", "JSON decode error", {}, error="Invalid JSON") from None
    if not isinstance(body, dict):
        msg = "Input should be a valid dictionary or object to extract fields from"
        raise validation_error("", "model_attributes_type", msg, body)
    return body


def check_model(body: dict[str, Any], served: str, adapters: Sequence[str] = ()) -> str | None:
    """404 unless ``model`` is absent, empty, the served name or a LoRA adapter's; returns the adapter
    (``None``: the base model)."""
    model = opt(body, "model", strict_str, "")
    if model and model != served and model not in adapters:
        raise SimError(404, f"The model `{model}` does not exist. Valid aliases: {served}.", param="model")
    return model if model and model != served else None


@dataclass(frozen=True, slots=True)
class Sampling:
    """What shapes the output of a generate request.

    ``max_tokens``: the requested output length (``None``: the default), named ``max_tokens_param`` in
    errors; ``n`` choices per prompt; ``logprobs``: top alternatives per token (``None``: no logprobs);
    ``stop`` strings and ``stop_token_ids`` end a choice early; ``continuous_usage``: usage on every
    streamed chunk."""

    max_tokens: int | None
    max_tokens_param: str
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    include_stop_str: bool
    logprobs: int | None
    echo: bool


def parse_sampling(body: dict[str, Any], *, chat: bool) -> Sampling:
    """The output options of a chat or completion body, with the checks of vLLM's request models
    (``protocol.py`` validators) and of ``SamplingParams._verify_args``."""
    stream = opt(body, "stream", lax_bool, False)
    options = opt(body, "stream_options", strict_dict, None) or {}
    if options and not stream:
        raise invalid("Stream options can only be defined when `stream=True`.", "stream_options")
    include_usage = opt(options, "include_usage", lax_bool, False)
    continuous = include_usage and opt(options, "continuous_usage_stats", lax_bool, False)
    n = opt(body, "n", lax_int, 1) if chat else _completion_n(body)
    seed = opt(body, "seed", lax_int, None)
    if seed is not None and not -_INT64 <= seed < _INT64:
        raise validation_error(
            "seed",
            "less_than_equal" if seed > 0 else "greater_than_equal",
            "Input should be in the int64 range",
            seed,
        )
    echo = opt(body, "echo", lax_bool, False)
    logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body)
    stop = _stop(body)
    raw_ids = opt(body, "stop_token_ids", strict_list, None) or []
    stop_ids = tuple(lax_int(t, f"stop_token_ids.{i}") for i, t in enumerate(raw_ids))
    include_stop = opt(body, "include_stop_str_in_output", lax_bool, False)
    max_tokens, param = _max_tokens(body, chat=chat)
    _sampling_ranges(body, n)
    return Sampling(
        max_tokens,
        param,
        n,
        stream,
        include_usage,
        continuous,
        seed,
        stop,
        stop_ids,
        include_stop,
        logprobs,
        echo,
    )


def _completion_n(body: dict[str, Any]) -> int:
    if "n" in body and body["n"] is None:  # CompletionRequest.n is a plain int
        raise validation_error("n", "int_type", "Input should be a valid integer", None)
    return opt(body, "n", lax_int, 1)


def _max_tokens(body: dict[str, Any], *, chat: bool) -> tuple[int | None, str]:
    """The requested output length and the name vLLM gives it in errors (chat: ``max_completion_tokens``
    wins over the deprecated ``max_tokens``)."""
    if chat:
        completion = opt(body, "max_completion_tokens", lax_int, None)
        if completion is not None:
            return completion, "max_completion_tokens"
        return opt(body, "max_tokens", lax_int, None), "max_tokens"
    return opt(body, "max_tokens", lax_int, DEFAULT_MAX_TOKENS), "max_tokens"


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    raw = body.get("stop")
    if raw is None:
        return ()
    if isinstance(raw, str):
        stops = [raw]
    elif isinstance(raw, list):
        stops = [strict_str(s, f"stop.list[str].{i}") for i, s in enumerate(raw)]
        if len(stops) > MAX_STOP_STRINGS:
            raise validation_error(
                "stop.list[str]",
                "too_long",
                f"List should have at most {MAX_STOP_STRINGS} items after validation, not {len(stops)}",
                raw,
            )
    else:
        raise validation_error("stop.str", "string_type", "Input should be a valid string", raw)
    if any(not s for s in stops):
        raise invalid("stop cannot contain an empty string.")
    return tuple(stops)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat: ``logprobs`` (bool) turns them on, ``top_logprobs`` (0-20, -1 = vocabulary) adds
    alternatives; ``None`` when off."""
    top = body.get("top_logprobs")
    if top is not None and not isinstance(top, int | float):
        raise invalid("`top_logprobs` must be an integer.", "top_logprobs", top)
    logprobs = opt(body, "logprobs", lax_bool, False)
    k = opt(body, "top_logprobs", lax_int, 0)
    if k < 0 and k != -1:
        raise invalid("`top_logprobs` must be a positive value or -1.", "top_logprobs", k)
    if k != 0 and not logprobs:
        raise invalid("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    return _check_logprobs(k) if logprobs else None


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    raw = body.get("logprobs")
    if raw is None:
        return None
    if not isinstance(raw, int | float):
        raise invalid("`logprobs` must be an integer.", "logprobs", raw)
    k = lax_int(raw, "logprobs")
    if k < 0 and k != -1:
        raise invalid("`logprobs` must be a positive value or -1.", "logprobs", k)
    return _check_logprobs(k)


def _check_logprobs(k: int) -> int:
    if k == -1 or k > MAX_LOGPROBS:
        n = "the vocabulary size" if k == -1 else k
        raise invalid(
            f"Requested sample logprobs of {n}, which is greater than max allowed: {MAX_LOGPROBS}",
            "logprobs",
            n,
        )
    return k


def _sampling_ranges(body: dict[str, Any], n: int) -> None:
    """``SamplingParams._verify_args`` for the fields the sim does not otherwise use."""
    if n < 1:
        raise invalid(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise invalid(
            f"n must be at most {MAX_N}, got {n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
            "environment variable."
        )
    for key in ("presence_penalty", "frequency_penalty"):
        value = opt(body, key, lax_float, 0.0)
        if not -2.0 <= value <= 2.0:
            raise invalid(f"{key} must be in [-2, 2], got {value}.")
    temperature = opt(body, "temperature", lax_float, 1.0)
    if not math.isfinite(temperature):
        raise invalid(f"temperature must be a finite number, got {temperature}.", "temperature", temperature)
    if temperature < 0.0:
        raise invalid(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)
    if temperature > 2.0:
        raise invalid(f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature)
    top_p = opt(body, "top_p", lax_float, 1.0)
    if not 0.0 < top_p <= 1.0:
        raise invalid(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    top_k = opt(body, "top_k", lax_int, 0)
    if top_k < -1:
        raise invalid(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = opt(body, "min_p", lax_float, 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise invalid(f"min_p must be in [0, 1], got {min_p}.")
    if opt(body, "min_tokens", lax_int, 0) < 0:
        raise invalid(f"min_tokens must be greater than or equal to 0, got {body['min_tokens']}.")
    for key in ("ignore_eos", "skip_special_tokens", "use_beam_search"):
        opt(body, key, lax_bool, False)
    opt(body, "user", strict_str, "")
    if temperature < _GREEDY_EPS and n > 1:
        raise invalid(f"n must be 1 when using greedy sampling, got {n}.")


def check_max_tokens(sampling: Sampling, max_model_len: int) -> None:
    """``TokenizeParams.__post_init__``: an output limit beyond the context is refused up front."""
    if sampling.max_tokens is not None and sampling.max_tokens > max_model_len:
        p = sampling.max_tokens_param
        raise invalid(
            f"{p}={sampling.max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            p,
            sampling.max_tokens,
        )


def check_prompt_len(prompt_len: int, max_model_len: int, *, text: bool) -> None:
    """``TokenizeParams._token_len_check``: a prompt longer than the context is refused. Text prompts
    are tokenized with ``max_length = max_model_len + 1``, so vLLM reports "at least" that many."""
    if prompt_len > max_model_len:
        count = max_model_len + 1 if text else prompt_len
        qualifier = "at least " if text else ""
        raise invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains {qualifier}{count} input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            count,
        )


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """``get_max_tokens``: the request's limit (chat default: :data:`DEFAULT_MAX_TOKENS`, see README)
    clamped to what is left of the context, then ``SamplingParams``' ``max_tokens >= 1``."""
    wanted = DEFAULT_MAX_TOKENS if requested is None else requested
    max_tokens = min(wanted, max_model_len - prompt_len)
    if max_tokens < 1:
        raise invalid(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    return max_tokens


Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class Tools:
    """A chat request's tools: their definitions (``[{"type": "function", "function": {...}}]``), the
    effective ``tool_choice`` and, for ``"named"``, the function to call."""

    tools: list[dict[str, Any]] | None
    mode: Mode
    name: str | None = None

    def function(self) -> dict[str, Any] | None:
        """The function definition a forced or automatic call uses (the named one, else the first)."""
        if not self.tools or self.mode == "none":
            return None
        for tool in self.tools:
            if self.name is None or tool["function"]["name"] == self.name:
                return dict(tool["function"])
        return None


_CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def parse_tools(body: dict[str, Any]) -> Tools:
    """``tools`` and ``tool_choice`` with ``ChatCompletionRequest.check_tool_usage``."""
    raw = body.get("tools")
    if raw == []:
        raise invalid(
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    tools = None if raw is None else [_tool(t, i) for i, t in enumerate(strict_list(raw, "tools"))]
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice is None or choice == "none":
        return Tools(tools, "none")
    if tools is None:
        raise invalid("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice in ("auto", "required"):
        return Tools(tools, choice)
    if not isinstance(choice, dict):
        raise invalid(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" '
            "are supported.",
            "tool_choice",
        )
    function = choice.get("function")
    if not isinstance(function, dict):
        raise invalid(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT_USAGE}",
            "tool_choice.function",
        )
    if "name" not in function:
        raise invalid(
            f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_USAGE}",
            "tool_choice.function.name",
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise invalid(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_USAGE}",
            "tool_choice.function.name",
        )
    if all(t["function"]["name"] != name for t in tools):
        raise invalid(
            "The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice"
        )
    return Tools(tools, "named", name)


def _tool(raw: object, i: int) -> dict[str, Any]:
    tool = strict_dict(raw, f"tools.{i}")
    if tool.get("type", "function") != "function":
        raise validation_error(
            f"tools.{i}.type",
            "literal_error",
            "Input should be 'function'",
            tool["type"],
            expected="'function'",
        )
    function = strict_dict(tool.get("function"), f"tools.{i}.function") if "function" in tool else None
    if function is None:
        raise validation_error(f"tools.{i}.function", "missing", "Field required", tool)
    strict_str(function.get("name"), f"tools.{i}.function.name")
    if function.get("parameters") is not None:
        strict_dict(function["parameters"], f"tools.{i}.function.parameters")
    return {"type": "function", "function": function}


def check_tool_support(tools: Tools, *, auto_tools: bool, parser: str | None) -> None:
    """``OnlineRenderer.render_chat``: tool calls need ``--enable-auto-tool-choice`` and
    ``--tool-call-parser`` (vLLM loads the parser only when both are set)."""
    if tools.mode == "none" or (auto_tools and parser is not None):
        return
    if tools.mode == "auto":
        raise refused(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
    shown = (
        "required"
        if tools.mode == "required"
        else (f"function=ChatCompletionNamedFunction(name='{tools.name}') type='function'")
    )
    raise refused(f'tool_choice="{shown}" requires --tool-call-parser to be set')


def parse_response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """``response_format``: ``None`` for plain text, else ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "schema": {...}}``."""
    raw = body.get("response_format")
    if raw is None:
        return None
    fmt = strict_dict(raw, "response_format")
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema", "structural_tag"):
        raise validation_error(
            "response_format.ResponseFormat.type",
            "literal_error",
            "Input should be 'text', 'json_object' or 'json_schema'",
            kind,
            expected="'text', 'json_object' or 'json_schema'",
        )
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if spec is None:
            raise invalid(
                "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                "response_format",
            )
        spec = strict_dict(spec, "response_format.ResponseFormat.json_schema")
        strict_str(spec.get("name"), "response_format.ResponseFormat.json_schema.name")
        return {"type": "json_schema", "schema": opt(spec, "schema", strict_dict, None) or {}}
    if kind == "json_object":
        return {"type": "json_object"}
    return None  # "text"; a structural tag constrains nothing the sim models


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """What renders a chat into prompt tokens (chat completions and ``/tokenize`` with messages)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any] | None


def parse_chat(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> ChatPrompt:
    """Messages and template options of a chat request; ``tools`` are the validated definitions."""
    if "messages" not in body:
        raise validation_error("messages", "missing", "Field required", body)
    messages = strict_list(body["messages"], "messages")
    kwargs = opt(body, "chat_template_kwargs", strict_dict, None) or {}
    if body.get("chat_template") is not None or kwargs.get("chat_template") is not None:
        raise refused(
            "Chat template is passed with request, but --trust-request-chat-template is not set. "
            "Refused request with untrusted chat template."
        )
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise invalid("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    return ChatPrompt(
        messages=[_message(m, i) for i, m in enumerate(messages)],
        add_generation_prompt=opt(body, "add_generation_prompt", lax_bool, True),
        continue_final_message=opt(body, "continue_final_message", lax_bool, False),
        add_special_tokens=opt(body, "add_special_tokens", lax_bool, False),
        tools=tools,
        template_kwargs=kwargs or None,
    )


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """A completion prompt: text to tokenize or token ids as given."""

    prompt: str | list[int]
    add_special_tokens: bool


def parse_text_prompts(body: dict[str, Any]) -> list[TextPrompt]:
    """The prompts of a completion body: a string, token ids, or a batch of either (up to
    :data:`MAX_PROMPTS`), each answered with its own choices."""
    prompt = body.get("prompt")
    if prompt is None or prompt == "":
        raise invalid("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    special = opt(body, "add_special_tokens", lax_bool, True)
    if isinstance(prompt, str):
        return [TextPrompt(prompt, special)]
    if not isinstance(prompt, list) or not prompt:
        raise validation_error("prompt", "string_type", "Input should be a valid string", prompt)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [TextPrompt(_token_ids(prompt, "prompt"), special)]
    if len(prompt) > MAX_PROMPTS:
        raise invalid(
            f"prompt list length {len(prompt)} exceeds the maximum allowed count of {MAX_PROMPTS}. "
            "To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable.",
            "prompt",
        )
    if all(isinstance(p, str) for p in prompt):
        return [TextPrompt(p, special) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [TextPrompt(_token_ids(p, f"prompt.{i}"), special) for i, p in enumerate(prompt)]
    raise validation_error("prompt", "string_type", "Input should be a valid string", prompt)


def _token_ids(raw: list[Any], loc: str) -> list[int]:
    ids = [lax_int(t, f"{loc}.{i}") for i, t in enumerate(raw)]
    for i, t in enumerate(ids):
        if t < 0:
            raise validation_error(
                f"{loc}.{i}", "greater_than_equal", "Input should be greater than or equal to 0", t, ge=0
            )
    return ids


def parse_detokenize(body: dict[str, Any]) -> list[int]:
    """``DetokenizeRequest.tokens``."""
    if "tokens" not in body:
        raise validation_error("tokens", "missing", "Field required", body)
    return _token_ids(strict_list(body["tokens"], "tokens"), "tokens")


def _message(raw: object, i: int) -> dict[str, Any]:
    """A chat message as vLLM hands it to the template: text parts joined by newlines, tool call
    arguments parsed from JSON strings into objects."""
    loc = f"messages.{i}"
    message = strict_dict(raw, loc)
    if "role" not in message:
        raise validation_error(f"{loc}.role", "missing", "Field required", message)
    role = strict_str(message["role"], f"{loc}.role")
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            part = strict_dict(part, f"{loc}.content.{j}")
            if part.get("type") != "text":  # images, audio, files: the sim serves a text-only model
                raise refused("only text content parts are supported by the simulator")
            parts.append(strict_str(part.get("text"), f"{loc}.content.{j}.text"))
        text = "\n".join(parts)
    else:
        raise validation_error(f"{loc}.content", "string_type", "Input should be a valid string", content)
    out: dict[str, Any] = {"role": role, "content": text}
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    if role == "assistant" and isinstance(message.get("tool_calls"), list):
        out["tool_calls"] = [_tool_call(c, loc) for c in message["tool_calls"]]
    return out


def _tool_call(raw: object, loc: str) -> dict[str, Any]:
    call = strict_dict(raw, f"{loc}.tool_calls")
    function = dict(strict_dict(call.get("function"), f"{loc}.tool_calls.function"))
    arguments = function.get("arguments")
    if not arguments:
        function["arguments"] = {}
    elif isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise refused(f"tool call arguments are not valid JSON: {exc}") from exc
    return {**call, "function": function}
