"""The power plugins: the ``power`` scorer (energy per token, headroom under the cap) and the soft
``power-cap`` filter (a node over its power cap, hot or throttled takes no new work while another has room).

Both read the node power readings agents send with their loads (:attr:`EndpointState.power`, expired with
the load's staleness bound) and the node's energy per output token (:attr:`EndpointState.energy_per_token`,
:mod:`extproc.scheduling.energy`). Formulas in README.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from contracts.events import EndpointId, Power
from extproc.fleet import EndpointState
from extproc.scheduling.interface import CycleState, SchedulingRequest

NEUTRAL = 0.5
"""The ``power`` score of a candidate with no power telemetry: neither preferred nor avoided."""


def headroom(power: Sequence[Power]) -> float | None:
    """``1 - watts / limit`` of the tightest cap among the node's readings that give both, in [0, 1]
    (``None``: no reading gives both)."""
    room = [
        1.0 - p.watts / p.limit_w
        for p in power
        if not p.error and p.watts is not None and p.limit_w is not None and p.limit_w > 0
    ]
    return None if not room else min(1.0, max(0.0, min(room)))


@dataclass(frozen=True, slots=True)
class PowerParams:
    """``reserve``: the headroom under the power cap (a fraction of the cap) below which a node's score
    falls, linearly to 0 at the cap; above it headroom does not matter (the node runs at full clocks)."""

    reserve: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 < self.reserve <= 1.0:
            raise ValueError(f"reserve must be in (0, 1], got {self.reserve!r}")


class PowerScorer:
    """``score = efficiency x room`` (formulas in README.md):

    - efficiency ``min_c e(c) / e(id)``, ``e`` the node's energy per output token (J/token): 1 for the most
      efficient candidate, falling as the energy per token grows; unknown: 0.5 (neutral);
    - room ``min(1, headroom / reserve)``, headroom ``1 - watts / limit`` of the node's tightest power cap:
      1 while the node is at least ``reserve`` under its cap, falling to 0 at the cap; unknown: 1.

    No telemetry at all scores 0.5.
    """

    __slots__ = ("name", "params")

    def __init__(self, name: str = "power", params: PowerParams | None = None) -> None:
        self.name = name
        self.params = params or PowerParams()

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> dict[EndpointId, float]:
        energy = {
            c.id: c.energy_per_token
            for c in candidates
            if c.energy_per_token is not None and math.isfinite(c.energy_per_token) and c.energy_per_token > 0
        }
        best = min(energy.values()) if energy else 0.0
        reserve = self.params.reserve
        scores: dict[EndpointId, float] = {}
        for c in candidates:
            e = energy.get(c.id)
            efficiency = NEUTRAL if e is None else best / e
            room = headroom(c.power)
            scores[c.id] = efficiency * (1.0 if room is None else min(1.0, room / reserve))
        return scores


@dataclass(frozen=True, slots=True)
class PowerCapParams:
    """When a node counts as over its limits (any one of them).

    ``cap_margin``: over the power cap when ``watts >= (1 - cap_margin) x limit`` for a reading that gives
    both (a node held at its cap reads just under it). ``max_temperature_c``: over when a reading's
    temperature is at least this (``None``: not checked; GPUs' own slowdown temperatures differ by model,
    and their throttle reasons say when they are reached). ``throttled``: a reading that says power or
    thermal limits hold the clocks down counts as over.
    """

    cap_margin: float = 0.02
    max_temperature_c: float | None = None
    throttled: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.cap_margin < 1.0:
            raise ValueError(f"cap_margin must be in [0, 1), got {self.cap_margin!r}")
        if self.max_temperature_c is not None and not 0 < self.max_temperature_c < math.inf:
            raise ValueError(f"max_temperature_c must be finite and > 0, got {self.max_temperature_c!r}")


class PowerCapFilter:
    """Drops endpoints whose node is over a limit of :class:`PowerCapParams`, unless every candidate is
    (soft: what it drops may still be a fallback). No power telemetry is never over."""

    __slots__ = ("name", "params")
    #: A preference: what it drops may still be a fallback (scheduling/interface.py Filter).
    soft = True

    def __init__(self, name: str = "power-cap", params: PowerCapParams | None = None) -> None:
        self.name = name
        self.params = params or PowerCapParams()

    def over(self, candidate: EndpointState) -> bool:
        """Whether ``candidate``'s node is over its power cap, too hot or throttled (its readings now)."""
        p = self.params
        for reading in candidate.power:
            if reading.error:
                continue
            limit, watts = reading.limit_w, reading.watts
            if (
                limit is not None
                and watts is not None
                and limit > 0
                and watts >= (1.0 - p.cap_margin) * limit
            ):
                return True
            hot = p.max_temperature_c
            if hot is not None and reading.temperature_c is not None and reading.temperature_c >= hot:
                return True
            if p.throttled and reading.throttled:
                return True
        return False

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        kept = [c for c in candidates if not self.over(c)]
        return kept if kept else list(candidates)
