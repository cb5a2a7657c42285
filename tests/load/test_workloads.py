"""Workloads: token lengths with the real SmolLM2 tokenizer, determinism, shapes, trace parsing."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from load.workloads import (
    Agentic,
    MultiTurn,
    SharedPrefix,
    TokenText,
    Trace,
    poisson_arrivals,
    read_trace,
    smollm2_text,
    synthesize,
)
from load.workloads.trace import TraceError


@pytest.fixture(scope="module")
def text() -> TokenText:
    return smollm2_text()


@pytest.mark.parametrize("n", [1, 16, 100, 1000])
def test_words_are_exactly_n_tokens(text: TokenText, n: int) -> None:
    assert text.count(text.words(n, random.Random(n))) == n


def test_blocks_keep_their_tokens_when_concatenated(text: TokenText) -> None:
    a, b = text.block(64, "a"), text.block(32, "b")
    assert a == text.block(64, "a") and a != b
    assert text.count(a + b) == 96


def test_shared_prefix_shape(text: TokenText) -> None:
    wl = SharedPrefix(groups=3, prefix=200, users=2, question=50, output=7)
    sessions = wl.sessions(text, [0.1 * i for i in range(40)], seed=5)
    assert len(sessions) == 40 and all(len(s.turns) == 1 and not s.keep_history for s in sessions)
    by_group: dict[str, set[str]] = {}
    for s in sessions:
        assert text.count(s.system[0]["content"]) == 200
        assert text.count(s.turns[0].messages[0]["content"]) == 50
        assert s.turns[0].max_tokens == 7
        by_group.setdefault(s.key, set()).add(s.system[0]["content"])
    assert len(by_group) == 3 and all(len(prefixes) == 1 for prefixes in by_group.values())
    assert wl.working_set_tokens() == 3 * (200 + 2 * 50)
    again = wl.sessions(text, [0.1 * i for i in range(40)], seed=5)
    assert again == sessions
    assert wl.sessions(text, [0.1 * i for i in range(40)], seed=6) != sessions


def test_agentic_shares_system_and_tools_across_all_sessions(text: TokenText) -> None:
    wl = Agentic(system=120, tools=200, task=30, steps=3, output=5, tool_result=20, tool_s=0.1)
    sessions = wl.sessions(text, [0.0, 0.5, 1.0], seed=1)
    systems = {s.system[0]["content"] for s in sessions}
    assert len(systems) == 1
    (system,) = systems
    assert 320 <= text.count(system) <= 400  # the tools' JSON overshoots its budget by at most one tool
    for s in sessions:
        assert s.keep_history and s.key == s.id and len(s.turns) == 3
        assert s.turns[0].messages[0]["role"] == "user" and s.turns[0].think_s == 0
        assert all(t.messages[0]["role"] == "tool" and t.messages[0]["tool_call_id"] for t in s.turns[1:])
    assert len({s.turns[0].messages[0]["content"] for s in sessions}) == 3


def test_multi_turn_sessions(text: TokenText) -> None:
    wl = MultiTurn(system=40, turns=4, question=25, output=9, think_s=0.2)
    (s,) = wl.sessions(text, [2.0], seed=3)
    assert s.start_s == 2.0 and s.keep_history and len(s.turns) == 4
    assert all(text.count(t.messages[0]["content"]) == 25 for t in s.turns)
    assert s.turns[0].think_s == 0 and all(t.think_s > 0 for t in s.turns[1:])


def test_poisson_arrivals_rate() -> None:
    arrivals = poisson_arrivals(20.0, 100.0, random.Random(1))
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0 and arrivals[-1] < 100
    assert 1800 < len(arrivals) < 2200
    with pytest.raises(ValueError):
        poisson_arrivals(0, 1, random.Random(1))


def test_mooncake_trace_replay(text: TokenText, tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 700, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 500, "hash_ids": [1, 2, 3]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    records = read_trace(path)
    assert [r.hash_ids for r in records] == [(1, 2), (1, 2, 3)]
    trace = Trace(tuple(records), trace_block_tokens=512, block_tokens=64, speedup=2.0, max_output=32)
    first, second = trace.sessions(text, [], seed=0)
    assert (first.start_s, second.start_s) == (0.0, 0.25)
    a, b = first.turns[0].messages[0]["content"], second.turns[0].messages[0]["content"]
    assert text.count(a) == round(700 * 64 / 512) and text.count(b) == round(1100 * 64 / 512)
    assert b.startswith(text.block(64, "0-hash-1") + text.block(64, "0-hash-2"))
    assert a == b[: len(a)]  # equal hash ids: equal prefix text
    assert (first.turns[0].max_tokens, second.turns[0].max_tokens) == (1, 32)


def test_trace_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n'
    )
    with pytest.raises(TraceError, match=r"bad\.jsonl:2"):
        read_trace(path)


def test_synthetic_trace_has_mooncake_shape(tmp_path: Path) -> None:
    path = synthesize(tmp_path / "t.jsonl", requests=50, rate_per_s=5, seed=2, block_tokens=512)
    records = read_trace(path)
    assert len(records) == 50
    assert all(512 * (len(r.hash_ids) - 1) < r.input_length <= 512 * len(r.hash_ids) for r in records)
    assert len({r.hash_ids[0] for r in records}) <= 4  # every request starts with one of 4 app prefixes
    assert [r.timestamp_ms for r in records] == sorted(r.timestamp_ms for r in records)
