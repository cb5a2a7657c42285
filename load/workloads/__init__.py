"""Benchmark workloads: what clients send, independent of where it goes or how fast.

``shared-prefix``, ``multi-turn``, ``agentic`` (:mod:`load.workloads.shapes`) and ``trace``
(:mod:`load.workloads.trace`) all produce :class:`~load.workloads.session.Session` lists from a seed,
with prompt lengths in tokens of the served model (:mod:`load.workloads.text`). The load generator
(:mod:`load.client`) sends them; the routing benchmark (:mod:`load.bench.routing`) runs them against
each router.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from load.workloads.session import Message, Session, Turn, closed_arrivals, poisson_arrivals
from load.workloads.shapes import Agentic, MultiTurn, SharedPrefix
from load.workloads.text import TokenText, smollm2_text
from load.workloads.trace import Trace, TraceRecord, read_trace, synthesize


class Workload(Protocol):
    """A workload shape: sessions from arrivals and a seed, and its size for capacity planning."""

    @property
    def name(self) -> str: ...

    def sessions(self, text: TokenText, arrivals: Sequence[float], seed: int) -> list[Session]:
        """Sessions starting at ``arrivals`` (seconds), content determined by ``seed``."""
        ...

    def working_set_tokens(self, sessions: int) -> int:
        """Distinct prompt tokens ``sessions`` sessions send (what a fleet's KV would need to hold)."""
        ...

    def largest_request_tokens(self) -> int:
        """An upper bound on prompt + output tokens of one request."""
        ...


__all__ = [
    "Agentic",
    "Message",
    "MultiTurn",
    "Session",
    "SharedPrefix",
    "TokenText",
    "Trace",
    "TraceRecord",
    "Turn",
    "Workload",
    "closed_arrivals",
    "poisson_arrivals",
    "read_trace",
    "smollm2_text",
    "synthesize",
]
