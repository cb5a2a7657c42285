"""The synthetic workloads: shared-prefix, multi-turn chat and agentic tool loops.

Every length is in tokens of the served model's tokenizer (see :mod:`load.workloads.text`); the chat
template adds a few tokens per message on top. Content is a pure function of the parameters and the
seed, so every target of a benchmark gets byte-identical requests in the same order.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from load.workloads.session import Message, Session, Turn, chat_messages
from load.workloads.text import TokenText


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """``groups`` x a ``prefix``-token system prompt per group, ``users`` per group each with a fixed
    ``question``-token question, ``output`` tokens out: the inference-perf ``shared_prefix`` / llm-d
    shape. Each request picks a (group, user) uniformly, so a full prompt recurs and the group prefix
    recurs ``users`` times as often. One request per session; the oracle key is the group."""

    name: ClassVar[str] = "shared-prefix"
    groups: int = 32
    prefix: int = 1536
    users: int = 4
    question: int = 384
    output: int = 32

    def working_set_tokens(self, sessions: int = 0) -> int:
        """Distinct prompt tokens: every group's prefix and every user's question."""
        return self.groups * (self.prefix + self.users * self.question)

    def largest_request_tokens(self) -> int:
        return self.prefix + self.question + self.output + 16

    def sessions(self, text: TokenText, arrivals: Sequence[float], seed: int) -> list[Session]:
        prefixes = [text.block(self.prefix, f"{seed}-group-{g}") for g in range(self.groups)]
        questions = [
            [text.block(self.question, f"{seed}-group-{g}-user-{u}") for u in range(self.users)]
            for g in range(self.groups)
        ]
        rng = random.Random(f"{seed}-shared-prefix")
        out = []
        for i, at in enumerate(arrivals):
            g, u = rng.randrange(self.groups), rng.randrange(self.users)
            system, user = chat_messages(prefixes[g], questions[g][u])
            turn = Turn((user,), self.output)
            out.append(Session(f"sp-{i}", f"group-{g}", at, (system,), (turn,)))
        return out


@dataclass(frozen=True, slots=True)
class MultiTurn:
    """Chat sessions that grow turn by turn: a ``system``-token prompt shared by every session, then
    ``turns`` user messages of ``question`` tokens, each answered with ``output`` tokens; every turn
    resends the whole history (with the assistant's actual answers). ``think_s``: mean pause (seconds,
    exponential) before each later turn. The oracle key is the session."""

    name: ClassVar[str] = "multi-turn"
    system: int = 256
    turns: int = 5
    question: int = 192
    output: int = 48
    think_s: float = 1.0

    def working_set_tokens(self, sessions: int) -> int:
        return self.system + sessions * self.turns * (self.question + self.output)

    def largest_request_tokens(self) -> int:
        return self.system + self.turns * (self.question + self.output + 8) + 16

    def sessions(self, text: TokenText, arrivals: Sequence[float], seed: int) -> list[Session]:
        system = text.block(self.system, f"{seed}-chat-system")
        rng = random.Random(f"{seed}-multi-turn")
        out = []
        for i, at in enumerate(arrivals):
            turns = tuple(
                Turn(
                    ({"role": "user", "content": text.words(self.question, rng)},),
                    self.output,
                    rng.expovariate(1 / self.think_s) if t and self.think_s > 0 else 0.0,
                )
                for t in range(self.turns)
            )
            sid = f"chat-{i}"
            out.append(Session(sid, sid, at, ({"role": "system", "content": system},), turns, True))
        return out


@dataclass(frozen=True, slots=True)
class Agentic:
    """Tool-calling agent loops. Every session starts with the same long system prompt (``system``
    tokens) and the same tools list (about ``tools`` tokens of JSON schemas, written into the system
    message: SmolLM2's chat template has no tools section), then its own ``task`` (tokens). Each of
    ``steps`` requests produces ``output`` tokens (the model's tool call), after which a tool result of
    ``tool_result`` tokens is appended and the whole history is resent after ``tool_s`` seconds (mean,
    exponential: the tool running). The shared part is common to ALL sessions: a router matching
    prefixes without weighing load sends every session to whichever replica saw it first.
    The oracle key is the session."""

    name: ClassVar[str] = "agentic"
    system: int = 1024
    tools: int = 1024
    task: int = 128
    steps: int = 5
    output: int = 48
    tool_result: int = 160
    tool_s: float = 0.5

    def working_set_tokens(self, sessions: int) -> int:
        per_session = self.task + self.steps * (self.output + self.tool_result)
        return self.system + self.tools + sessions * per_session

    def largest_request_tokens(self) -> int:
        return self.system + self.tools + 64 + self.task + self.steps * (self.output + self.tool_result + 16)

    def sessions(self, text: TokenText, arrivals: Sequence[float], seed: int) -> list[Session]:
        system: Message = {
            "role": "system",
            "content": text.block(self.system, f"{seed}-agent-system")
            + "\n\n# Tools\n"
            + self._tools(text, seed),
        }
        rng = random.Random(f"{seed}-agentic")
        out = []
        for i, at in enumerate(arrivals):
            steps = [Turn(({"role": "user", "content": text.words(self.task, rng)},), self.output)]
            for step in range(1, self.steps):
                result = {
                    "role": "tool",
                    "tool_call_id": f"call_{step}",
                    "content": text.words(self.tool_result, rng),
                }
                steps.append(
                    Turn((result,), self.output, rng.expovariate(1 / self.tool_s) if self.tool_s else 0)
                )
            sid = f"agent-{i}"
            out.append(Session(sid, sid, at, (system,), tuple(steps), True))
        return out

    def _tools(self, text: TokenText, seed: int) -> str:
        """JSON schemas of made-up tools, added one by one until they reach ``tools`` tokens."""
        rng = random.Random(f"{seed}-agent-tools")
        tools: list[dict[str, object]] = []
        rendered = "[]"
        while text.count(rendered) < self.tools:
            n = len(tools)
            tools.append(
                {
                    "type": "function",
                    "function": {
                        "name": f"tool_{n}",
                        "description": text.words(40, rng).strip(),
                        "parameters": {
                            "type": "object",
                            "properties": {
                                f"arg_{k}": {"type": "string", "description": text.words(12, rng).strip()}
                                for k in range(3)
                            },
                            "required": ["arg_0"],
                        },
                    },
                }
            )
            rendered = json.dumps(tools, indent=1)
        return rendered
