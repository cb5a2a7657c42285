"""The output options vLLM 0.33 refuses are refused by the gateway's parser (extproc/routing/sampling.py):
each bad value is a 400 ``invalid_request_error`` naming its field, and each value at the edge of what vLLM
takes passes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from extproc.errors import BadRequest
from extproc.routing.request import Kind, parse_body
from extproc.routing.sampling import READ_FIELDS, _check_all, check_sampling

MESSAGES = [{"role": "user", "content": "hi"}]


def body(kind: Kind, fields: dict[str, Any]) -> bytes:
    prompt = {"messages": MESSAGES} if kind is Kind.CHAT else {"prompt": "hi"}
    return orjson.dumps({"model": "m", **prompt, **fields})


CHAT, COMPLETION = Kind.CHAT, Kind.COMPLETION
BOTH = (CHAT, COMPLETION)


def cases(kinds: tuple[Kind, ...], fields: dict[str, Any], *rest: str) -> list[Any]:
    """One case per kind: (kind, fields, *rest), with an id naming them."""
    return [pytest.param(k, fields, *rest, id=f"{k.value}-{fields}") for k in kinds]


REFUSED = [
    *cases(BOTH, {"max_tokens": 0}, "max_tokens"),
    *cases(BOTH, {"max_tokens": -1}, "max_tokens"),
    *cases(BOTH, {"max_tokens": 1.5}, "max_tokens"),
    *cases((CHAT,), {"max_completion_tokens": 0}, "max_completion_tokens"),
    *cases((CHAT,), {"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),
    *cases((CHAT,), {"max_completion_tokens": 5, "max_tokens": -1}, "max_tokens"),
    *cases(BOTH, {"n": 0}, "n"),
    *cases(BOTH, {"n": -1}, "n"),
    *cases(BOTH, {"n": "2"}, "n"),
    *cases((COMPLETION,), {"n": None}, "n"),
    *cases(BOTH, {"n": 2, "temperature": 0}, "n"),
    *cases(BOTH, {"n": 2, "temperature": 0.000001}, "n"),
    *cases(BOTH, {"temperature": -0.1}, "temperature"),
    *cases(BOTH, {"temperature": 2.01}, "temperature"),
    *cases(BOTH, {"temperature": "hot"}, "temperature"),
    *cases(BOTH, {"top_p": 0}, "top_p"),
    *cases(BOTH, {"top_p": 1.01}, "top_p"),
    *cases(BOTH, {"top_p": -0.5}, "top_p"),
    *cases(BOTH, {"top_k": -2}, "top_k"),
    *cases(BOTH, {"top_k": 1.5}, "top_k"),
    *cases(BOTH, {"min_p": -0.1}, "min_p"),
    *cases(BOTH, {"min_p": 1.1}, "min_p"),
    *cases(BOTH, {"presence_penalty": 2.5}, "presence_penalty"),
    *cases(BOTH, {"presence_penalty": -2.01}, "presence_penalty"),
    *cases(BOTH, {"frequency_penalty": -3}, "frequency_penalty"),
    *cases(BOTH, {"frequency_penalty": 2.01}, "frequency_penalty"),
    *cases(BOTH, {"repetition_penalty": 0}, "repetition_penalty"),
    *cases(BOTH, {"repetition_penalty": -1.0}, "repetition_penalty"),
    *cases(BOTH, {"repetition_penalty": True}, "repetition_penalty"),
    *cases(BOTH, {"min_tokens": -1}, "min_tokens"),
    *cases(BOTH, {"min_tokens": 6, "max_tokens": 5}, "min_tokens"),
    *cases((CHAT,), {"min_tokens": 6, "max_completion_tokens": 5, "max_tokens": 10}, "min_tokens"),
    *cases((COMPLETION,), {"min_tokens": 17}, "min_tokens"),  # vLLM's completion default is 16
    *cases((COMPLETION,), {"echo": True, "max_tokens": 0, "min_tokens": 2}, "min_tokens"),
    *cases(BOTH, {"seed": 2**63}, "seed"),
    *cases(BOTH, {"seed": "7"}, "seed"),
    *cases(BOTH, {"stop": ""}, "stop"),
    *cases(BOTH, {"stop": ["a", ""]}, "stop"),
    *cases(BOTH, {"stop": 5}, "stop"),
    *cases(BOTH, {"stop": ["a", 1]}, "stop"),
    *cases(BOTH, {"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    *cases(BOTH, {"stop_token_ids": 5}, "stop_token_ids"),
    *cases(BOTH, {"bad_words": [""]}, "bad_words"),
    *cases(BOTH, {"bad_words": "x"}, "bad_words"),
    *cases(BOTH, {"stream_options": {"include_usage": True}}, "stream_options"),
    *cases(BOTH, {"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
    *cases(BOTH, {"stream_options": "usage", "stream": True}, "stream_options"),
    *cases((CHAT,), {"top_logprobs": -2, "logprobs": True}, "top_logprobs"),
    *cases((CHAT,), {"top_logprobs": 2}, "top_logprobs"),
    *cases((CHAT,), {"top_logprobs": -1, "logprobs": False}, "top_logprobs"),
    *cases((CHAT,), {"top_logprobs": "2", "logprobs": True}, "top_logprobs"),
    *cases((CHAT,), {"logprobs": "yes"}, "logprobs"),
    *cases((COMPLETION,), {"logprobs": -2}, "logprobs"),
    *cases((COMPLETION,), {"logprobs": True}, "logprobs"),
    *cases(BOTH, {"prompt_logprobs": -2}, "prompt_logprobs"),
    *cases(BOTH, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    *cases(BOTH, {"prompt_logprobs": -1, "stream": True}, "prompt_logprobs"),
    *cases(BOTH, {"response_format": {"type": "json_schema"}}, "response_format"),
    *cases(BOTH, {"use_beam_search": "yes"}, "use_beam_search"),
    *cases(BOTH, {"use_beam_search": True, "temperature": "hot"}, "temperature"),
    *cases(BOTH, {"use_beam_search": True, "n": 0}, "n"),
    *cases((COMPLETION,), {"use_beam_search": True, "stream": True}, "use_beam_search"),
    *cases((COMPLETION,), {"echo": True, "suffix": "x"}, "suffix"),
    *cases((COMPLETION,), {"echo": 1}, "echo"),
]


@pytest.mark.parametrize(("kind", "fields", "param"), REFUSED)
def test_refused_with_the_field_named(kind: Kind, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_body(kind, body(kind, fields))
    err = caught.value
    assert (err.status, err.param, err.code) == (400, param, None)
    assert f"'{param}'" in err.message
    assert orjson.loads(err.body())["error"]["type"] == "invalid_request_error"


ACCEPTED = [
    *cases(BOTH, {"max_tokens": 1}),
    *cases(BOTH, {"max_tokens": None}),
    *cases((CHAT,), {"max_completion_tokens": 1}),
    *cases((CHAT,), {"max_completion_tokens": 1, "max_tokens": 0}),  # vLLM reads only the first
    *cases((COMPLETION,), {"max_tokens": 0, "echo": True}),  # vLLM answers with the prompt alone
    *cases((COMPLETION,), {"max_tokens": 0, "echo": True, "min_tokens": 1}),
    *cases(BOTH, {"n": 1}),
    *cases((CHAT,), {"n": None}),
    *cases(BOTH, {"n": 2, "temperature": 0.00001}),
    *cases(BOTH, {"n": 20000}),  # VLLM_MAX_N_SEQUENCES is the engine's to enforce
    *cases(BOTH, {"temperature": 0}),
    *cases(BOTH, {"temperature": 2}),
    *cases(BOTH, {"top_p": 1}),
    *cases(BOTH, {"top_p": 1e-9}),
    *cases(BOTH, {"top_k": -1}),
    *cases(BOTH, {"top_k": 0}),
    *cases(BOTH, {"top_k": 1}),
    *cases(BOTH, {"min_p": 0}),
    *cases(BOTH, {"min_p": 1}),
    *cases(BOTH, {"presence_penalty": -2, "frequency_penalty": 2}),
    *cases(BOTH, {"presence_penalty": 2, "frequency_penalty": -2}),
    *cases(BOTH, {"repetition_penalty": 1e-9}),
    *cases(BOTH, {"min_tokens": 0}),
    *cases(BOTH, {"min_tokens": 5, "max_tokens": 5}),
    *cases((CHAT,), {"min_tokens": 1000}),  # no output limit: vLLM's is the rest of the context
    *cases((COMPLETION,), {"min_tokens": 16}),
    *cases(BOTH, {"seed": -(2**63)}),
    *cases(BOTH, {"seed": 2**63 - 1}),
    *cases(BOTH, {"stop": "x"}),
    *cases(BOTH, {"stop": ["a", "b", "c", "d", "e"]}),  # VLLM_MAX_STOP_STRINGS is the engine's
    *cases(BOTH, {"stop": []}),
    *cases(BOTH, {"stop_token_ids": [0, 2]}),
    *cases(BOTH, {"bad_words": ["x"]}),
    *cases(BOTH, {"stream_options": {}}),
    *cases(BOTH, {"stream_options": {"include_usage": True}, "stream": True}),
    *cases((CHAT,), {"top_logprobs": 0}),
    *cases((CHAT,), {"top_logprobs": None}),
    *cases((CHAT,), {"top_logprobs": -1, "logprobs": True}),
    *cases((CHAT,), {"top_logprobs": 50, "logprobs": True}),  # --max-logprobs is the engine's
    *cases((COMPLETION,), {"logprobs": -1}),
    *cases((COMPLETION,), {"logprobs": 0}),
    *cases(BOTH, {"prompt_logprobs": 0, "stream": True}),
    *cases(BOTH, {"prompt_logprobs": -1}),
    *cases(BOTH, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
    *cases(BOTH, {"response_format": {"type": "json_object"}}),
    # Beam search builds no SamplingParams: vLLM does not range-check them.
    *cases(BOTH, {"use_beam_search": True, "max_tokens": 0, "top_p": 5, "n": 2, "temperature": 0}),
    *cases((CHAT,), {"use_beam_search": True, "stream": True}),
    *cases((COMPLETION,), {"suffix": "x"}),
]


@pytest.mark.parametrize(("kind", "fields"), ACCEPTED)
def test_values_vllm_takes_pass(kind: Kind, fields: dict[str, Any]) -> None:
    assert parse_body(kind, body(kind, fields)).body == {**orjson.loads(body(kind, {})), **fields}


class _Recording(dict[str, Any]):
    """A body that notes every field the checks look up."""

    def __init__(self, fields: dict[str, Any]) -> None:
        super().__init__(fields)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


@pytest.mark.parametrize("kind", BOTH)
def test_the_fast_path_skips_only_fields_the_checks_never_read(kind: Kind) -> None:
    """``READ_FIELDS`` is every field the full checks read (a body without them takes the fast path)."""
    recording = _Recording({})
    _check_all(recording, chat=kind is CHAT, stream=False)
    _check_all(recording, chat=kind is CHAT, stream=True)
    assert recording.read <= READ_FIELDS


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"max_tokens": 1},
        {"max_tokens": 0},
        {"max_tokens": -1},
        {"max_tokens": True},
        {"max_tokens": None},
        {"max_completion_tokens": 0},
        {"max_completion_tokens": 0, "max_tokens": 3},
        {"max_completion_tokens": 3, "max_tokens": 0},
        {"max_completion_tokens": "x"},
        {"user": "u"},
    ],
)
@pytest.mark.parametrize("kind", BOTH)
def test_the_fast_path_answers_as_the_full_checks(kind: Kind, fields: dict[str, Any]) -> None:
    """Bodies with no field but the output limits: the same refusal (or none) either way."""
    full = {"model": "m", **fields}

    def outcome(check: Any) -> tuple[str, str | None] | None:
        try:
            check(full, chat=kind is CHAT, stream=False)
        except BadRequest as exc:
            return exc.message, exc.param
        return None

    assert outcome(check_sampling) == outcome(_check_all)
