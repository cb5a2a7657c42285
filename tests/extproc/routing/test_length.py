"""extproc.routing.length: the verdict from byte bounds, the limit, and vLLM's words in OpenAI's body."""

from __future__ import annotations

import orjson
import pytest

from extproc.errors import BadRequest, ContextLengthExceeded
from extproc.models.context import ByteBounds
from extproc.routing.length import ContextLimit, Verdict, triage, verdict


@pytest.mark.parametrize(
    ("fewest", "most", "allowed", "expected"),
    [
        (0, 10, 10, Verdict.FITS),
        (5, 10, 10, Verdict.FITS),
        (5, 11, 10, Verdict.COUNT),
        (10, 11, 10, Verdict.COUNT),
        (11, 12, 10, Verdict.TOO_LONG),
        (0, 0, 0, Verdict.FITS),  # a one-token context: only an empty prompt
        (0, 1, 0, Verdict.COUNT),
        (1, 1, 0, Verdict.TOO_LONG),
    ],
)
def test_verdict(fewest: int, most: int, allowed: int, expected: Verdict) -> None:
    assert verdict(fewest, most, allowed) is expected


SMALL = ByteBounds(max_token_bytes=4, edge_tokens=1)


@pytest.mark.parametrize(
    ("text", "allowed", "special", "expected"),
    [
        ("abcd", 4, False, (Verdict.FITS, 0)),  # at most 4 tokens: nothing counted
        ("abcd", 4, True, (Verdict.COUNT, 2)),  # the edge token makes it 2..5
        ("abcd" * 4, 3, False, (Verdict.TOO_LONG, 4)),  # at least 16 / 4 tokens
        ("abcd" * 4, 4, False, (Verdict.COUNT, 4)),
        ("é" * 4, 7, False, (Verdict.COUNT, 2)),  # 8 UTF-8 bytes, not 4 characters
        ("é" * 4, 8, False, (Verdict.FITS, 0)),
    ],
)
def test_triage_reads_utf8_bytes(
    text: str, allowed: int, special: bool, expected: tuple[Verdict, int]
) -> None:
    assert triage(text, allowed, SMALL, special) == expected


def test_triage_without_bounds_only_counting_tells() -> None:
    assert triage("x" * 10_000, 5, None, False) == (Verdict.COUNT, 0)
    assert triage("", 0, None, True) == (Verdict.COUNT, 0)


def test_the_limit_leaves_room_for_one_output_token() -> None:
    assert ContextLimit.of(100, chat=True) == ContextLimit(100, "messages")
    assert ContextLimit.of(100, chat=False) == ContextLimit(100, "prompt")
    assert ContextLimit.of(None, chat=True) is None
    limit = ContextLimit(100, "prompt")
    assert limit.allowed == 99
    limit.check(99)
    for tokens in (100, 101, 10_000):
        with pytest.raises(ContextLengthExceeded):
            limit.check(tokens)


def test_the_error_is_openais_with_vllms_words() -> None:
    with pytest.raises(ContextLengthExceeded) as info:
        ContextLimit(8192, "messages").check(8193)
    exc = info.value
    assert isinstance(exc, BadRequest) and exc.status == 400
    message = (
        "This model's maximum context length is 8192 tokens. However, your prompt contains at least 8193"
        " input tokens, which exceeds this limit even without any output tokens. Please reduce the length of"
        " the input prompt."
    )
    assert orjson.loads(exc.body()) == {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    full = ContextLimit(8192, "prompt").exceeded(8192)  # vLLM: "max_tokens must be at least 1, got 0."
    assert (full.param, full.code) == ("prompt", "context_length_exceeded")
    assert full.message == (
        "This model's maximum context length is 8192 tokens. However, your prompt contains at least 8192"
        " input tokens, which leaves no room for output tokens. Please reduce the length of the input prompt."
    )
