"""What a workload is made of: sessions of turns, and when sessions arrive.

A :class:`Session` is one client conversation: leading messages (a system prompt) and one or more
:class:`Turn` requests. With ``keep_history`` each turn resends the whole conversation so far (the
previous turns' messages and the assistant's actual answers) plus its own new messages, as chat clients
and agents do; without it every turn is a fresh request of the leading messages plus its own.

Arrivals are separate from content: :func:`poisson_arrivals` gives open-loop session start times, and a
closed loop ignores them (workers take the next session as soon as theirs ends).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Message = Mapping[str, Any]
"""An OpenAI chat message (``role``, ``content``)."""


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session.

    ``messages``: what this turn appends to the conversation (a user question, a tool result).
    ``max_tokens``: output length in tokens (the simulator always produces exactly this many).
    ``think_s``: seconds between the previous turn's last token and this turn's send (0 for the first).
    """

    messages: tuple[Message, ...]
    max_tokens: int
    think_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Session:
    """A client conversation.

    ``key`` is what an oracle may route on (a shared-prefix group, an agent session): information a
    real router never sees. ``start_s``: open-loop arrival, seconds after the run starts.
    """

    id: str
    key: str
    start_s: float
    system: tuple[Message, ...]
    turns: tuple[Turn, ...]
    keep_history: bool = False
    #: The ``model`` its requests name (a LoRA adapter, say); ``None``: the run's model.
    model: str | None = None

    @property
    def num_requests(self) -> int:
        return len(self.turns)


def poisson_arrivals(rate_per_s: float, duration_s: float, rng: random.Random) -> list[float]:
    """Start times (seconds) of a Poisson process of ``rate_per_s`` over ``[0, duration_s)``."""
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    out: list[float] = []
    t = rng.expovariate(rate_per_s)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


def closed_arrivals(count: int) -> list[float]:
    """``count`` sessions with no arrival time: a closed loop starts each when a worker is free."""
    return [0.0] * count


def chat_messages(system: str, user: str) -> tuple[Message, ...]:
    """A system prompt and a user message."""
    return ({"role": "system", "content": system}, {"role": "user", "content": user})
