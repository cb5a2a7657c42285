"""The power plugins: the ``power`` scorer (energy per token, headroom under the cap), the
``marginal-energy`` scorer (what this request adds to the fleet's draw: a busy GPU's increment, an idle
GPU's wake-up; consolidate while the predicted TTFT allows) and the soft ``power-cap`` filter (a node over
its power cap, hot or throttled takes no new work while another has room; with hysteresis).

Both read the node power readings agents send with their loads (:attr:`EndpointState.power`, expired with
the load's staleness bound) and the node's energy per output token (:attr:`EndpointState.energy_per_token`,
:mod:`extproc.scheduling.energy`). Formulas in README.md.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from operator import attrgetter

from contracts.events import EndpointId, Power
from extproc.fleet import EndpointState
from extproc.scheduling.energy import CapLatch
from extproc.scheduling.interface import Candidates, CycleState, SchedulingRequest

NEUTRAL = 0.5
"""The ``power`` score of a candidate with no power telemetry: neither preferred nor avoided."""


def headroom(power: Sequence[Power]) -> float | None:
    """``1 - watts / limit`` of the tightest cap among the node's readings that give both, finite, in
    [0, 1] (``None``: no reading gives both; a NaN or infinite figure gives nothing)."""
    room = [
        1.0 - p.watts / p.limit_w
        for p in power
        if not p.error
        and p.watts is not None
        and p.limit_w is not None
        and 0 < p.limit_w < math.inf
        and math.isfinite(p.watts)
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


def running(candidate: EndpointState) -> float:
    """Requests the endpoint runs now: its engine's last reading (running + waiting), or this gateway's
    requests in flight there when more (or when there is no reading)."""
    m = candidate.metrics
    engine = 0.0 if m is None else max(0.0, m.running) + max(0.0, m.waiting)
    return max(engine if math.isfinite(engine) else 0.0, float(candidate.in_flight))


@dataclass(frozen=True, slots=True)
class MarginalEnergyParams:
    """``ttft_target_s``: consolidate onto a candidate only while its predicted TTFT
    (``CycleState.predicted_ttft``) is at most this (a request's own TTFT budget, when it has one, is
    used instead when tighter). ``max_waiting``: without a prediction, a candidate whose engine queues more
    requests than this does not count as having room. ``ttft_ratio``: nor one predicted more than this
    times the candidates' best prediction (``None``: the target alone): consolidation may cost a little
    latency against the fastest choice, not a lot."""

    ttft_target_s: float = 0.25
    max_waiting: float = 0.0
    ttft_ratio: float | None = 1.25
    scale_j: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.ttft_target_s < math.inf:
            raise ValueError(f"ttft_target_s must be finite and > 0, got {self.ttft_target_s!r}")
        if not 0.0 <= self.max_waiting < math.inf:
            raise ValueError(f"max_waiting must be finite and >= 0, got {self.max_waiting!r}")
        if not 0.0 < self.scale_j < math.inf:
            raise ValueError(f"scale_j must be finite and > 0, got {self.scale_j!r}")
        if self.ttft_ratio is not None and not 1.0 <= self.ttft_ratio < math.inf:
            raise ValueError(f"ttft_ratio must be finite and >= 1, got {self.ttft_ratio!r}")


class MarginalEnergyScorer:
    """``score = max(0, 1 - (cost(id) - min_c cost(c)) / scale_j)`` over the candidates with room
    (formulas in README.md: a difference in J/token, not a ratio, so slope noise between near-equal GPUs
    does not outweigh the other scorers):

    - ``cost(c)``: J per output token this request adds on ``c``'s node (:meth:`PowerCurve.cost`): the busy
      slope ``k`` plus the wake-up draw for the time the request keeps the GPU awake beyond its running
      requests, ``k + wake_w / (seq_tps x (n + 1))`` with ``n`` requests running there;
    - room: predicted TTFT within the target (or, without a prediction, no more than ``max_waiting``
      queued); a candidate without room scores 0, and when none has room every candidate scores 0.5
      (the latency scorers spread the work);
    - a candidate with room and no power curve scores 0.5 (neutral).
    """

    __slots__ = ("name", "params")
    #: Reads ``CycleState.predicted_ttft`` whatever the request (the router fills it).
    needs_prediction = True

    def __init__(self, name: str = "marginal-energy", params: MarginalEnergyParams | None = None) -> None:
        self.name = name
        self.params = params or MarginalEnergyParams()

    def room(
        self,
        request: SchedulingRequest,
        state: CycleState,
        candidate: EndpointState,
        best: float | None = None,
    ) -> bool:
        """Whether ``candidate`` may take the request without breaking the TTFT target; ``best``: the
        lowest prediction among the candidates (for ``ttft_ratio``)."""
        target = self.params.ttft_target_s
        if request.ttft_budget_s is not None and 0 < request.ttft_budget_s < target:
            target = request.ttft_budget_s
        ratio = self.params.ttft_ratio
        if ratio is not None and best is not None:
            target = max(target, ratio * best)
        predicted = state.predicted_ttft.get(candidate.id)
        if predicted is not None and math.isfinite(predicted):
            return predicted <= target
        m = candidate.metrics
        return m is None or not math.isfinite(m.waiting) or m.waiting <= self.params.max_waiting

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> dict[EndpointId, float]:
        known = [state.predicted_ttft[c.id] for c in candidates if c.id in state.predicted_ttft]
        best = min((p for p in known if math.isfinite(p) and p > 0), default=None)
        roomy = [c for c in candidates if self.room(request, state, c, best)]
        if not roomy:
            return {c.id: NEUTRAL for c in candidates}
        costs: dict[EndpointId, float] = {}
        for c in roomy:
            if c.power_curve is not None:
                cost = c.power_curve.cost(running(c))
                if math.isfinite(cost) and cost > 0:
                    costs[c.id] = cost
        best = min(costs.values()) if costs else 0.0
        scores = {c.id: 0.0 for c in candidates}
        for c in roomy:
            known_cost = costs.get(c.id)
            scores[c.id] = (
                NEUTRAL if known_cost is None else max(0.0, 1.0 - (known_cost - best) / self.params.scale_j)
            )
        return scores


@dataclass(frozen=True, slots=True)
class PowerCapParams:
    """When a node counts as over its limits (any one of them).

    ``cap_margin``: over the power cap when ``watts >= (1 - cap_margin) x limit`` for a reading that gives
    both (a node held at its cap reads just under it). ``max_temperature_c``: over when a reading's
    temperature is at least this (``None``: not checked; GPUs' own slowdown temperatures differ by model,
    and their throttle reasons say when they are reached). ``throttled``: a reading that says power or
    thermal limits hold the clocks down counts as over.

    ``leave_margin``: hysteresis. A node that went over stays over until a newer reading has ``watts < (1
    - leave_margin) x limit`` and is neither hot nor throttled; ``None``: none (over exactly while a
    reading says so). Below ``cap_margin``, ``cap_margin`` is used.
    """

    cap_margin: float = 0.02
    max_temperature_c: float | None = None
    throttled: bool = True
    leave_margin: float | None = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.cap_margin < 1.0:
            raise ValueError(f"cap_margin must be in [0, 1), got {self.cap_margin!r}")
        if self.max_temperature_c is not None and not 0 < self.max_temperature_c < math.inf:
            raise ValueError(f"max_temperature_c must be finite and > 0, got {self.max_temperature_c!r}")
        if self.leave_margin is not None and not 0.0 <= self.leave_margin < 1.0:
            raise ValueError(f"leave_margin must be in [0, 1), got {self.leave_margin!r}")


_power = attrgetter("power")


class PowerCapFilter:
    """Drops endpoints whose node is over a limit of :class:`PowerCapParams`, unless every candidate is
    (soft: what it drops may still be a fallback). No power telemetry (none yet, or expired) is never
    over, and forgets the endpoint's latch; readings that are all errors leave the latch as it is."""

    __slots__ = ("_tracked", "latch", "name", "params")
    #: A preference: what it drops may still be a fallback (scheduling/interface.py Filter).
    soft = True

    def __init__(self, name: str = "power-cap", params: PowerCapParams | None = None) -> None:
        self.name = name
        self.params = params or PowerCapParams()
        #: The hysteresis state per endpoint; it changes only on a new reading (the same readings give the
        #: same answer), and a policy change (a new filter) starts it afresh.
        self.latch = CapLatch()
        #: The fleet's state object of each endpoint in the latch: the entry goes with it (an endpoint
        #: removed from the fleet), and a new object under the same id starts afresh.
        self._tracked: dict[str, weakref.ref[EndpointState]] = {}

    def _limits(self, candidate: EndpointState, margin: float) -> bool:
        """Whether a reading without error is at ``(1 - margin)`` of its cap or more, too hot or
        throttled."""
        p = self.params
        for reading in candidate.power:
            if reading.error:
                continue
            limit, watts = reading.limit_w, reading.watts
            if limit is not None and watts is not None and limit > 0 and watts >= (1.0 - margin) * limit:
                return True
            hot = p.max_temperature_c
            if hot is not None and reading.temperature_c is not None and reading.temperature_c >= hot:
                return True
            if p.throttled and reading.throttled:
                return True
        return False

    def over(self, candidate: EndpointState) -> bool:
        """Whether ``candidate``'s node is over its power cap, too hot or throttled (its readings now),
        or, with hysteresis, went over and has not yet come down below ``(1 - leave_margin)`` of its cap."""
        key = candidate.endpoint.id
        power = candidate.power
        if not power:  # no telemetry, or it expired: never over, and nothing to remember
            if key in self.latch:
                self.latch.forget(key)
            return False
        p = self.params
        enter = self._limits(candidate, p.cap_margin)
        if p.leave_margin is None:
            return enter
        at = max((r.at for r in power if not r.error), default=None)
        if at is None:  # every source failed: no new reading, the latch stands
            return self.latch.held(key)
        tracked = self._tracked.get(key)
        if tracked is None or tracked() is not candidate:
            self._track(key, candidate)
        stay = enter or self._limits(candidate, max(p.cap_margin, p.leave_margin))
        return self.latch.update(key, at, enter=enter, stay=stay)

    def _track(self, key: str, candidate: EndpointState) -> None:
        if key in self._tracked:  # a new state object under the id: the endpoint left and came back
            self.latch.forget(key)
        self._tracked[key] = weakref.ref(candidate, partial(self._gone, key))

    def _gone(self, key: str, ref: weakref.ref[EndpointState]) -> None:
        """``key``'s state object was freed (the endpoint left the fleet): its latch entry goes too."""
        if self._tracked.get(key) is ref:
            del self._tracked[key]
            self.latch.forget(key)

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        if not self.latch.holding and not any(map(_power, candidates)):
            # No readings and nothing latched over: no candidate is over (the usual fleet without power
            # telemetry; what :meth:`over` would say for each, without walking them).
            return Candidates.of(candidates)
        kept = [c for c in candidates if not self.over(c)]
        return kept if 0 < len(kept) < len(candidates) else Candidates.of(candidates)
