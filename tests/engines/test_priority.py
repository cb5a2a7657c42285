"""engines.priority: what an engine's command line says about its handling of the body's ``priority``."""

from __future__ import annotations

import pytest

from engines.priority import priority_order


@pytest.mark.parametrize(
    ("kind", "argv", "expected"),
    [
        ("vllm", ["vllm", "serve", "m"], None),
        ("vllm", ["vllm", "serve", "m", "--scheduling-policy", "priority"], "low_first"),
        ("vllm", ["vllm", "serve", "m", "--scheduling-policy=priority"], "low_first"),
        ("vllm", ["vllm", "serve", "m", "--scheduling-policy", "fcfs"], None),
        ("vllm", ["--scheduling-policy", "priority", "--scheduling-policy", "fcfs"], None),  # the last wins
        ("vllm", ["--scheduling-policy"], None),  # no value: not priority
        # vLLM's parser reads underscores in flag names as dashes
        ("vllm", ["vllm", "serve", "m", "--scheduling_policy", "priority"], "low_first"),
        ("vllm", ["vllm", "serve", "m", "--scheduling_policy=priority"], "low_first"),
        ("vllm", ["--scheduling_policy", "priority", "--scheduling-policy", "fcfs"], None),
        ("sim", ["python", "-m", "load.sim", "--scheduling-policy", "priority"], "low_first"),
        ("sglang", ["python", "-m", "sglang.launch_server"], None),
        ("sglang", ["--enable-priority-scheduling"], "high_first"),  # SGLang's default order
        ("sglang", ["--enable-priority-scheduling", "--schedule-low-priority-values-first"], "low_first"),
        ("sglang", ["--schedule-low-priority-values-first"], None),  # ignored without the enable flag
        ("llama_cpp", ["llama-server", "--scheduling-policy", "priority"], None),
        ("trtllm", [], None),
        ("openai_compat", [], None),
    ],
)
def test_priority_order(kind: str, argv: list[str], expected: str | None) -> None:
    assert priority_order(kind, argv) == expected
