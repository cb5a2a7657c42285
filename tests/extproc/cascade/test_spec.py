"""The ``cascade`` object of a virtual model's route: what is accepted and what is refused, and why."""

from __future__ import annotations

from typing import Any

import pytest

from contracts.errors import ConfigError
from extproc.cascade.spec import CascadeSpec, parse_cascade

GOOD: dict[str, Any] = {"steps": ["small", "large"], "threshold": -0.5}


def test_defaults() -> None:
    spec = parse_cascade(GOOD, "policy models/auto.cascade", "auto")
    assert spec == CascadeSpec(("small", "large"), -0.5, "mean", None, "logprob", 30.0)
    assert spec.to_json() == {
        "steps": ["small", "large"],
        "gate": "logprob",
        "threshold": -0.5,
        "stat": "mean",
        "timeout_s": 30.0,
    }


def test_first_k_with_k() -> None:
    spec = parse_cascade({**GOOD, "stat": "first_k", "k": 8, "timeout_s": 5}, "w", "auto")
    assert (spec.stat, spec.k, spec.timeout_s) == ("first_k", 8, 5.0)
    assert parse_cascade({**GOOD, "timeout_s": 595}, "w", "auto").timeout_s == 595.0  # + 5 s: Envoy's cap
    three = {**GOOD, "steps": ["s", "m", "l"], "timeout_s": 297.5}  # both gated steps in one extension
    assert parse_cascade(three, "w", "auto").timeout_s == 297.5
    assert spec.to_json()["k"] == 8
    assert not spec.replay and "replay" not in spec.to_json()


def test_replay_with_first_k() -> None:
    spec = parse_cascade({**GOOD, "stat": "first_k", "k": 4, "replay": True}, "w", "auto")
    assert spec.replay and spec.to_json()["replay"] is True
    assert parse_cascade(spec.to_json(), "w", "auto") == spec
    assert not parse_cascade({**GOOD, "replay": False}, "w", "auto").replay


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ([], "expected an object"),
        ({**GOOD, "nope": 1}, "unknown key(s) nope"),
        ({"threshold": -1}, "steps: expected a list of model names"),
        ({**GOOD, "steps": "small"}, "steps: expected a list"),
        ({**GOOD, "steps": ["small", ""]}, "steps: expected a list"),
        ({**GOOD, "steps": ["small"]}, "expected 2 to 4 model names, got 1"),
        ({**GOOD, "steps": ["a", "b", "c", "d", "e"]}, "expected 2 to 4 model names, got 5"),
        ({**GOOD, "steps": ["small", "small"]}, "a model appears twice"),
        ({**GOOD, "steps": ["small", "auto"]}, "cannot be one of its own steps"),
        ({"steps": ["small", "large"]}, "threshold: required"),
        ({**GOOD, "threshold": 0.5}, "threshold must be a log-probability"),
        ({**GOOD, "threshold": "-0.5"}, "threshold: expected a number"),
        ({**GOOD, "threshold": True}, "threshold: expected a number"),
        ({**GOOD, "threshold": float("-inf")}, "threshold must be a log-probability"),
        ({**GOOD, "gate": "entropy"}, "gate must be one of logprob"),
        ({**GOOD, "stat": "median"}, "stat must be one of mean, min, first_k"),
        ({**GOOD, "stat": "first_k"}, "stat first_k needs k"),
        ({**GOOD, "stat": "first_k", "k": 0}, "stat first_k needs k"),
        ({**GOOD, "stat": "first_k", "k": 2.5}, "k: expected an integer"),
        ({**GOOD, "k": 4}, "k applies to stat first_k only"),
        ({**GOOD, "timeout_s": 0}, "timeout_s must be in (0, 595]"),
        ({**GOOD, "timeout_s": 595.5}, "timeout_s must be in (0, 595]"),
        ({**GOOD, "timeout_s": 600}, "timeout_s must be in (0, 595]"),
        ({**GOOD, "timeout_s": 601}, "timeout_s must be in (0, 595]"),
        # Envoy takes one message-timeout extension (capped at 600 s) for every gated step: past it, Envoy
        # ended the request while a later step could still answer or escalate.
        ({**GOOD, "steps": ["s", "m", "l"], "timeout_s": 300}, "2 gated steps x timeout_s must be <= 595"),
        ({**GOOD, "steps": ["s", "m", "x", "l"], "timeout_s": 200}, "3 gated steps x timeout_s must be"),
        ({**GOOD, "replay": True}, "replay applies to stat first_k only"),
        ({**GOOD, "stat": "min", "replay": True}, "replay applies to stat first_k only"),
        ({**GOOD, "stat": "first_k", "k": 4, "replay": 1}, "replay: expected true or false"),
        ({**GOOD, "stat": "first_k", "k": 4, "replay": "yes"}, "replay: expected true or false"),
    ],
)
def test_refused(value: object, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_cascade(value, "policy models/auto.cascade", "auto")
    assert reason in str(info.value) and "policy models/auto.cascade" in str(info.value)
