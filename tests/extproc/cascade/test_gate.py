"""The logprob gate's statistics (mean, min, first_k) and verdicts, over the chat and completions shapes."""

from __future__ import annotations

import math
from typing import Any

import pytest

from extproc.cascade.gate import Verdict, choice_logprobs, judge, statistic
from extproc.cascade.spec import CascadeSpec

LPS = [-0.1, -0.2, -3.0, -0.1]


@pytest.mark.parametrize(
    ("stat", "k", "expected"),
    [
        ("mean", None, -0.85),
        ("min", None, -3.0),
        ("first_k", 2, -0.15),
        ("first_k", 3, -1.1),
        ("first_k", 10, -0.85),  # fewer tokens than k: the mean of all
    ],
)
def test_statistics(stat: str, k: int | None, expected: float) -> None:
    value = statistic(LPS, stat, k)
    assert value is not None and math.isclose(value, expected)


@pytest.mark.parametrize("values", [[], [-0.1, float("-inf")], [float("nan")]])
def test_no_statistic(values: list[float]) -> None:
    assert statistic(values, "mean") is None


def chat(*choices: list[float] | None) -> dict[str, Any]:
    return {
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": "x"},
                "logprobs": None if lps is None else {"content": [{"token": "x", "logprob": v} for v in lps]},
            }
            for i, lps in enumerate(choices)
        ]
    }


def test_completions_shape() -> None:
    answer = {"choices": [{"text": "ab", "logprobs": {"token_logprobs": [-0.5, -1.5], "tokens": ["a", "b"]}}]}
    assert choice_logprobs(answer) == [[-0.5, -1.5]]


@pytest.mark.parametrize(
    "answer",
    [
        {},
        {"choices": []},
        chat(None),
        chat([-0.1], None),
        {"choices": [{"logprobs": {"content": [{"logprob": "x"}]}}]},
        {"choices": [{"logprobs": {"something": []}}]},
        {"choices": ["x"]},
    ],
)
def test_no_logprobs(answer: dict[str, Any]) -> None:
    assert choice_logprobs(answer) is None
    assert judge(CascadeSpec(("a", "b"), -1.0), answer) == Verdict(None, False, "no_logprobs")


def test_verdicts() -> None:
    spec = CascadeSpec(("a", "b"), -0.5)
    assert judge(spec, chat([-0.1, -0.3])) == Verdict(pytest.approx(-0.2), True, "pass")
    assert judge(spec, chat([-0.5])).passed  # at the threshold passes
    assert judge(spec, chat([-0.1, -2.0])) == Verdict(pytest.approx(-1.05), False, "gate")
    # several choices: the worst one decides
    assert judge(spec, chat([-0.1], [-0.9])) == Verdict(pytest.approx(-0.9), False, "gate")
    assert judge(spec, chat([])).reason == "no_logprobs"  # an empty answer judges nothing
    minimum = CascadeSpec(("a", "b"), -0.5, "min")
    assert not judge(minimum, chat([-0.01, -0.01, -0.6])).passed
    first = CascadeSpec(("a", "b"), -0.5, "first_k", 2)
    assert judge(first, chat([-0.01, -0.01, -5.0])).passed


def test_null_entries_are_skipped_and_an_unreadable_entry_is_no_statistic() -> None:
    """One rule with the streamed gate (tests/extproc/cascade/test_stream.py): a null entry (a token the
    engine gave no log-probability) is skipped; a choice of nulls alone, or an entry that is neither a number
    nor null, has no statistic."""
    first_k = CascadeSpec(("s", "l"), -0.5, "first_k", 2)

    def chat(*entries: object) -> dict[str, object]:
        return {"choices": [{"index": 0, "logprobs": {"content": list(entries)}}]}

    passing = chat({"logprob": None}, {"logprob": -0.01}, {"logprob": -0.01}, {"logprob": -5.0})
    assert judge(first_k, passing) == Verdict(pytest.approx(-0.01), True, "pass")
    completions = {"choices": [{"index": 0, "logprobs": {"token_logprobs": [None, -0.01, -0.01]}}]}
    assert judge(first_k, completions) == Verdict(pytest.approx(-0.01), True, "pass")
    assert judge(first_k, chat({"logprob": None}, {"token": "x"})) == Verdict(None, False, "no_logprobs")
    assert judge(first_k, chat({"logprob": "-0.1"}, {"logprob": -0.1})) == Verdict(None, False, "no_logprobs")
    assert judge(first_k, chat(-0.1, {"logprob": -0.1})) == Verdict(None, False, "no_logprobs")
