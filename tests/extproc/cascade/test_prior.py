"""The preroute learner (extproc/cascade/prior.py): its declaration, features and decisions."""

from __future__ import annotations

import re
import zlib
from typing import Any

import pytest

from contracts.errors import ConfigError
from extproc.cascade.prior import EscalationPrior, PrerouteSpec, features, parse_preroute, request_text
from extproc.cascade.spec import parse_cascade


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({}, PrerouteSpec()),
        ({"above": 0.95, "min_seen": 3, "explore": 0}, PrerouteSpec(0.95, 3, 0.0)),
        ({"above": 0.5}, PrerouteSpec(0.5, 10, 0.1)),
    ],
)
def test_a_preroute_is_parsed(value: dict[str, Any], expected: PrerouteSpec) -> None:
    assert parse_preroute(value, "p") == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "expected an object"),
        ({"above": 1.0}, "above must be in [0.5, 1)"),
        ({"above": 0.4}, "above must be in [0.5, 1)"),
        ({"above": float("nan")}, "expected a number"),
        ({"above": True}, "expected a number"),
        ({"min_seen": 0}, "min_seen must be an integer >= 1"),
        ({"min_seen": 2.5}, "expected an integer"),
        ({"explore": 1}, "explore must be in [0, 1)"),
        ({"explore": -0.1}, "explore must be in [0, 1)"),
        ({"explore": 1e-310}, "explore must be 0 or have a finite 1 / explore"),  # skip() raised, a 500
        ({"warmup": 3}, "unknown key(s) warmup"),
    ],
)
def test_a_bad_preroute_is_refused(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match="^p.*" + re.escape(message)):
        parse_preroute(value, "p")


def test_a_cascade_carries_its_preroute() -> None:
    doc = {"steps": ["s", "l"], "threshold": -0.5, "preroute": {"min_seen": 4}}
    spec = parse_cascade(doc, "models/auto.cascade", "auto")
    assert spec.preroute == PrerouteSpec(min_seen=4)
    assert spec.to_json()["preroute"] == {"above": 0.9, "min_seen": 4, "explore": 0.1}
    with pytest.raises(ConfigError, match=r"models/auto.cascade.preroute: above"):
        parse_cascade({**doc, "preroute": {"above": 2}}, "models/auto.cascade", "auto")
    assert parse_cascade({**doc, "preroute": None}, "w", "auto").preroute is None


@pytest.mark.parametrize(
    ("client", "chat", "text"),
    [
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, True, "a"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"text": "y"}]}]},
            True,
            "x y",
        ),
        ({"messages": [{"role": "system", "content": "s"}]}, True, ""),
        ({"messages": [{"role": "user", "content": None}]}, True, ""),
        ({"prompt": "p q"}, False, "p q"),
        ({"prompt": ["first", "second"]}, False, "first"),
        ({"prompt": [1, 2, 3]}, False, ""),
    ],
)
def test_request_text(client: dict[str, Any], chat: bool, text: str) -> None:
    assert request_text(client, chat=chat) == text


def test_features_are_deterministic_and_case_blind() -> None:
    assert features("Hard Question") == features("hard   question")
    assert features("a b") != features("a c")
    assert len(features(" ".join(f"w{i}" for i in range(500)))) <= 64 + 1  # the first 64 words, a bucket


def learnt(prior: EscalationPrior, hard: int, easy: int) -> None:
    for i in range(hard):
        prior.learn(features(f"[hard] question h{i}"), True)
    for i in range(easy):
        prior.learn(features(f"[easy] question e{i}"), False)


@pytest.mark.parametrize(
    ("spec", "hard", "easy", "p_hard", "skips_hard", "skips_easy"),
    [
        (PrerouteSpec(0.9, 10, 0.0), 0, 0, 0.0, False, False),  # nothing seen: no feature counts
        # [hard] seen 9 times, below min_seen: only "question" and the length bucket count (9 of 39)
        (PrerouteSpec(0.9, 10, 0.0), 9, 30, 10 / 41, False, False),
        (PrerouteSpec(0.9, 10, 0.0), 10, 30, 11 / 12, True, False),  # 10 escalations in a row: 11/12
        (PrerouteSpec(0.95, 10, 0.0), 10, 30, 11 / 12, False, False),  # ... is not 0.95
        # min_seen 1 is not conservative: one verdict on "question" makes every question look hard
        (PrerouteSpec(0.5, 1, 0.0), 1, 0, 2 / 3, True, True),
    ],
)
def test_a_request_is_skipped_once_a_feature_of_it_nearly_always_escalated(
    spec: PrerouteSpec, hard: int, easy: int, p_hard: float, skips_hard: bool, skips_easy: bool
) -> None:
    prior = EscalationPrior(spec)
    learnt(prior, hard, easy)
    x = features("[hard] question new")
    assert prior.p(x) == pytest.approx(p_hard)
    assert prior.skip(x) is skips_hard
    assert prior.skip(features("[easy] question new")) is skips_easy


def test_explore_keeps_one_in_round_one_over_explore_on_the_small_step() -> None:
    prior = EscalationPrior(PrerouteSpec(0.9, 10, 0.25))
    learnt(prior, 20, 0)
    decided = [prior.skip(features("[hard] again")) for _ in range(8)]
    assert decided == [True, True, True, False, True, True, True, False]
    assert prior.skips == 6


def test_a_feature_that_stops_escalating_stops_skipping() -> None:
    prior = EscalationPrior(PrerouteSpec(0.9, 10, 0.1))
    learnt(prior, 20, 0)
    x = features("[hard] question later")
    assert prior.skip(x)
    for _ in range(5):  # what explore sends on: the gate now passes them
        prior.learn(x, False)
    assert not prior.skip(x)


def test_a_word_sharing_one_slot_with_a_hard_feature_is_not_taken_for_it() -> None:
    """``r32w48`` and ``[hard]`` share their hash's low 16 bits (found by the warm-up benchmark run: an easy
    request carrying ``r32w48`` was sent on as hard); the second table's slot tells them apart."""
    hard, word = zlib.crc32(b"[hard]"), zlib.crc32(b"r32w48")
    assert hard in features("[hard]") and word in features("r32w48")
    assert hard & 0xFFFF == word & 0xFFFF and hard >> 16 != word >> 16
    prior = EscalationPrior(PrerouteSpec(0.9, 10, 0.0))
    for _ in range(20):
        prior.learn((hard,), True)
    assert prior.counts(hard) == (20, 20) and prior.counts(word) == (0, 0)
    assert prior.skip((hard,)) and not prior.skip((word,))
