"""The output options of a chat or completion body, checked the way vLLM 0.33 checks them, so a value every
engine would refuse is answered by the gateway (400 ``invalid_request_error``, ``param`` the field,
``code`` null) before it is routed.

Only fields present in the body are read, and nothing needs the tokenizer or the model. Limits an operator
can change on the engine are left to the engine: the most stop strings (``VLLM_MAX_STOP_STRINGS``, 4),
choices (``VLLM_MAX_N_SEQUENCES``, 16384) and logprobs (``--max-logprobs``, 20), an output limit above
``max_model_len``, a ``min_tokens`` above what the prompt leaves of the context. Types are JSON's: a
number is a JSON number and an integer a JSON integer (vLLM's pydantic also takes ``"9"`` and ``9.0``).
JSON cannot carry infinities or NaN (the body parser refuses them), so vLLM's finiteness checks never
apply. With ``use_beam_search`` vLLM builds no ``SamplingParams``, so its checks are not made.

The checks (``*``: not made with beam search), and what vLLM 0.33 answers (``sampling_params.py``
``_verify_args``; the request models' validators in ``entrypoints/openai/*/protocol.py``)::

    max_tokens, max_completion_tokens < 0, or   max_tokens must be at least 1, got 0.
      0 where it is the output limit * (chat:     (a completion with echo and max_tokens 0 answers
      max_completion_tokens first)                with its prompt alone)
    n < 1 (completions: also null)              n must be at least 1, got 0.
    n > 1 with temperature < 1e-5 *             n must be 1 when using greedy sampling, got 2.
    temperature outside [0, 2] *                temperature must be non-negative, got -1.0. / ...
                                                must be in [0, 2], got 3.0.
    top_p outside (0, 1] *                      top_p must be in (0, 1], got 0.0.
    top_k < -1 *                                top_k must be 0 (disable), or at least 1, got -2.
    min_p outside [0, 1] *                      min_p must be in [0, 1], got 2.0.
    presence_penalty, frequency_penalty         presence_penalty must be in [-2, 2], got 3.0.
      outside [-2, 2] *
    repetition_penalty <= 0 *                   repetition_penalty must be greater than zero, got 0.0.
    min_tokens < 0 *, or above the request's    min_tokens must be greater than or equal to 0, got -1.
      own output limit *                          / ... less than or equal to max_tokens=5, got 6.
    seed outside int64                          (pydantic) Input should be less than or equal to ...
    stop not a string or strings, or with "" *  stop cannot contain an empty string.
    stop_token_ids not integers                 (pydantic) Input should be a valid integer
    bad_words not strings, or with "" *         bad_words cannot contain an empty string. ...
    stream_options set without stream           Stream options can only be defined when `stream=True`.
    top_logprobs < 0 but not -1 (chat)          `top_logprobs` must be a positive value or -1.
    top_logprobs set without logprobs (chat)    when using `top_logprobs`, `logprobs` must be set to true.
    logprobs < 0 but not -1 (completions),      `logprobs` must be a positive value or -1.
      prompt_logprobs < 0 but not -1
    prompt_logprobs with stream                 `prompt_logprobs` are not available when `stream=True`.
    response_format json_schema without         When response_format type is 'json_schema', the
      json_schema                                 'json_schema' field must be provided.
    echo with suffix (completions)              Echo is unsupported with suffix.
    use_beam_search with stream (completions)   Streaming is not currently supported with beam search
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extproc.errors import BadRequest

#: vLLM's completion default for ``max_tokens`` (chat has none: the rest of the context).
COMPLETION_MAX_TOKENS = 16
#: Below this temperature vLLM samples greedily (``_SAMPLING_EPS``).
GREEDY_TEMPERATURE = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(slots=True)  # not frozen: a frozen dataclass sets each field through object.__setattr__
class _Sampling:
    """The typed values that ``SamplingParams`` checks (``None``: absent). ``limit``: the output limit vLLM
    uses (``None``: the rest of the context), named ``limit_key``; ``echo_only``: a completion that echoes
    its prompt without generating (vLLM runs it with an output limit of 1)."""

    n: int
    limit: int | None
    limit_key: str
    echo_only: bool
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    penalties: dict[str, float | None]
    repetition_penalty: float | None
    min_tokens: int | None
    stop: list[str]
    bad_words: list[str]


#: Every field the checks read. A body with none of them but the output limits can only be refused for
#: those (a plain chat: model, messages, max_tokens), so it skips the rest (a test holds this set to
#: what :func:`_check_all` reads).
READ_FIELDS = frozenset(
    {
        "stream_options",
        "use_beam_search",
        "echo",
        "suffix",
        "seed",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "response_format",
        "stop_token_ids",
        "max_completion_tokens",
        "max_tokens",
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "stop",
        "bad_words",
    }
)
_LIMIT_FIELDS = frozenset({"max_completion_tokens", "max_tokens"})


def check_sampling(body: Mapping[str, Any], *, chat: bool, stream: bool) -> None:
    """Raise :class:`BadRequest` naming an output option of ``body`` that vLLM would refuse (the table
    above); ``chat`` tells a chat body from a completion body, ``stream`` is its checked ``stream``."""
    if READ_FIELDS.intersection(body) <= _LIMIT_FIELDS:
        # Only the output limits are set (or nothing): no echo, so a limit of 0 is refused as _verify does.
        limit, key = _output_limit(body, chat)
        if limit == 0:
            raise BadRequest(f"'{key}' must be at least 1.", param=key)
        return
    _check_all(body, chat=chat, stream=stream)


def _check_all(body: Mapping[str, Any], *, chat: bool, stream: bool) -> None:
    """:func:`check_sampling`'s every check."""
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object.", param="stream_options")
    if options and not stream:
        raise BadRequest("'stream_options' can only be set with 'stream': true.", param="stream_options")
    beam = _flag(body, "use_beam_search")
    if beam and stream and not chat:
        raise BadRequest(
            "'use_beam_search' cannot be combined with 'stream' on completions.", param="use_beam_search"
        )
    if not chat and _flag(body, "echo") and body.get("suffix") is not None:
        raise BadRequest("'echo' cannot be combined with 'suffix'.", param="suffix")
    seed = _integer(body, "seed")
    if seed is not None and not INT64_MIN <= seed <= INT64_MAX:
        raise BadRequest("'seed' must fit in a signed 64-bit integer.", param="seed")
    _logprobs(body, chat, stream)
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and fmt.get("json_schema") is None:
        raise BadRequest(
            "A 'response_format' of type 'json_schema' needs its 'json_schema'.", param="response_format"
        )
    _integers(body, "stop_token_ids")
    sampling = _read(body, chat)
    if not beam:  # beam search builds no SamplingParams
        _verify(sampling)


def _read(body: Mapping[str, Any], chat: bool) -> _Sampling:
    """The sampling values of ``body``, type-checked (``n`` and the output limits range-checked too)."""
    limit, key = _output_limit(body, chat)
    return _Sampling(
        n=_choices(body, chat),
        limit=limit,
        limit_key=key,
        echo_only=not chat and limit == 0 and _flag(body, "echo"),
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        top_k=_integer(body, "top_k"),
        min_p=_number(body, "min_p"),
        penalties={k: _number(body, k) for k in ("presence_penalty", "frequency_penalty")},
        repetition_penalty=_number(body, "repetition_penalty"),
        min_tokens=_integer(body, "min_tokens"),
        stop=_strings(body, "stop", single=True),
        bad_words=_strings(body, "bad_words", single=False),
    )


def _verify(s: _Sampling) -> None:
    """``SamplingParams``' range checks."""
    if s.limit == 0 and not s.echo_only:
        raise BadRequest(f"'{s.limit_key}' must be at least 1.", param=s.limit_key)
    if s.temperature is not None:
        _within("temperature", s.temperature, 0.0, 2.0)
        if s.temperature < GREEDY_TEMPERATURE and s.n > 1:
            raise BadRequest(
                f"'n' must be 1 with greedy sampling ('temperature' {s.temperature:g}), got {s.n}.", param="n"
            )
    if s.top_p is not None and not 0.0 < s.top_p <= 1.0:
        raise BadRequest(f"'top_p' must be above 0 and at most 1, got {s.top_p}.", param="top_p")
    if s.top_k is not None and s.top_k < -1:
        raise BadRequest(
            f"'top_k' must be at least 1, or 0 or -1 to disable it, got {s.top_k}.", param="top_k"
        )
    if s.min_p is not None:
        _within("min_p", s.min_p, 0.0, 1.0)
    for key, penalty in s.penalties.items():
        if penalty is not None:
            _within(key, penalty, -2.0, 2.0)
    if s.repetition_penalty is not None and s.repetition_penalty <= 0.0:
        raise BadRequest(
            f"'repetition_penalty' must be above 0, got {s.repetition_penalty}.", param="repetition_penalty"
        )
    if s.min_tokens is not None:
        _min_tokens(s.min_tokens, 1 if s.echo_only else s.limit)
    if "" in s.stop:
        raise BadRequest("'stop' cannot contain an empty string.", param="stop")
    if "" in s.bad_words:
        raise BadRequest("'bad_words' cannot contain an empty string.", param="bad_words")


def _choices(body: Mapping[str, Any], chat: bool) -> int:
    """``n``: at least 1 (a completion's ``n`` is not nullable)."""
    if not chat and "n" in body and body["n"] is None:
        raise BadRequest("'n' must be an integer.", param="n")
    n = _integer(body, "n")
    if n is None:
        return 1
    if n < 1:
        raise BadRequest(f"'n' must be at least 1, got {n}.", param="n")
    return n


def _output_limit(body: Mapping[str, Any], chat: bool) -> tuple[int | None, str]:
    """(the output limit vLLM uses, its field): chat's ``max_completion_tokens`` wins over ``max_tokens``;
    a completion without one gets :data:`COMPLETION_MAX_TOKENS`. Neither field may be negative."""
    limits = {key: _integer(body, key) for key in ("max_completion_tokens", "max_tokens")}
    for key, value in limits.items():
        if value is not None and value < 0:
            raise BadRequest(f"'{key}' cannot be negative, got {value}.", param=key)
    if chat:
        if limits["max_completion_tokens"] is not None:
            return limits["max_completion_tokens"], "max_completion_tokens"
        return limits["max_tokens"], "max_tokens"
    completion = limits["max_tokens"]
    return (COMPLETION_MAX_TOKENS if completion is None else completion), "max_tokens"


def _min_tokens(least: int, limit: int | None) -> None:
    """``min_tokens``: at least 0 and at most the output limit vLLM runs with (``None``: unknown here)."""
    if least < 0:
        raise BadRequest(f"'min_tokens' must be at least 0, got {least}.", param="min_tokens")
    if limit is not None and least > limit:
        raise BadRequest(
            f"'min_tokens' must be at most the output limit of {limit} tokens, got {least}.",
            param="min_tokens",
        )


def _logprobs(body: Mapping[str, Any], chat: bool, stream: bool) -> None:
    """Chat: ``top_logprobs`` (-1 or more) needs ``logprobs``; completions: ``logprobs`` is -1 or more;
    both: ``prompt_logprobs`` is -1 or more and not streamed."""
    if chat:
        enabled = _flag(body, "logprobs")
        top = _at_least_minus_one(body, "top_logprobs")
        if top not in (None, 0) and not enabled:
            raise BadRequest("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    else:
        _at_least_minus_one(body, "logprobs")
    prompt = _at_least_minus_one(body, "prompt_logprobs")
    if prompt not in (None, 0) and stream:
        raise BadRequest("'prompt_logprobs' cannot be streamed.", param="prompt_logprobs")


def _at_least_minus_one(body: Mapping[str, Any], key: str) -> int | None:
    value = _integer(body, key)
    if value is not None and value < -1:
        raise BadRequest(f"'{key}' must be at least 0, or -1 for all, got {value}.", param=key)
    return value


def _within(key: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise BadRequest(f"'{key}' must be between {low:g} and {high:g}, got {value}.", param=key)


def _strings(body: Mapping[str, Any], key: str, *, single: bool) -> list[str]:
    """A list of strings (``single``: or one string), as a list; ``[]`` when absent."""
    value = body.get(key)
    if value is None:
        return []
    if single and isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        either = "a string or " if single else ""
        raise BadRequest(f"'{key}' must be {either}an array of strings.", param=key)
    return value


def _integers(body: Mapping[str, Any], key: str) -> None:
    value = body.get(key)
    if value is not None and (not isinstance(value, list) or not all(_is_int(t) for t in value)):
        raise BadRequest(f"'{key}' must be an array of integers.", param=key)


def _integer(body: Mapping[str, Any], key: str) -> int | None:
    """``body[key]`` as a JSON integer; ``None`` when absent or null."""
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise BadRequest(f"'{key}' must be an integer.", param=key)
    return int(value)


def _number(body: Mapping[str, Any], key: str) -> float | None:
    """``body[key]`` as a JSON number; ``None`` when absent or null."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"'{key}' must be a number.", param=key)
    return float(value)


def _flag(body: Mapping[str, Any], key: str) -> bool:
    """``body[key]`` as a JSON boolean; ``False`` when absent or null."""
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be a boolean.", param=key)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
