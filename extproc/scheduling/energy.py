"""Energy per output token of each node, from its agent's power readings and its engines' output tokens/s.

Pure bookkeeping (``now`` is a parameter). Per node, :class:`EnergyModel` fits the line
``watts = idle + k x tokens_per_s`` by exponentially weighted least squares over the node's readings
(weights halving every ``half_life_s``): the slope ``k`` is the **marginal** energy of an output token
(J/token), what one more token of work costs on that node, idle power excluded. It needs readings at
different loads: while the weighted spread of tokens/s is below ``min_spread_tps`` (or the slope is not
positive) it falls back to the node's **average** energy per token now, ``watts / tokens_per_s`` (an upper
bound of the marginal one: it includes idle power), and to ``None`` below ``min_tps``.

Which reading gives a node's watts (:func:`node_watts`): the first source without an error in the order
``dcgm``, ``nvml``, ``redfish``, ``ipmi``: the GPUs' own power follows inference load, a BMC's includes the
host's; its mean since the source's previous reading when it has an energy counter
(:func:`average_watts`), else its instantaneous watts. Tokens/s are the sum over the node's endpoints.

**The power curve** (:meth:`EnergyModel.curve`, read by the ``marginal-energy`` scorer): the same
readings split by whether the node generated tokens. Idle readings (``tokens_per_s < min_tps`` and,
where the caller says, no request running) give the **idle draw** (their weighted mean); busy readings
give a second line ``watts = base + k x tokens_per_s`` fitted over busy readings only, whose intercept
``base`` is what an active GPU draws before its first token of work (the decode floor: every weight read
per step), and the **speed of one sequence** (the weighted mean of ``tokens_per_s / running`` over busy
readings that say how many requests ran). The straight line over all readings mixes the step from idle
to active into its slope; the split keeps it apart: ``wake_w = max(0, base - idle)`` is what waking an
idle GPU costs per second, whatever its tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from contracts.events import Power
from extproc.fleet import PowerCurve

__all__ = ["KIND_ORDER", "CapLatch", "EnergyModel", "PowerCurve", "average_watts", "node_watts"]

#: The order in which a node's power sources are trusted for its watts.
KIND_ORDER = ("dcgm", "nvml", "redfish", "ipmi")


def node_watts(power: Sequence[Power]) -> Power | None:
    """The reading that gives the node's watts (module docstring), ``None`` when none does."""
    usable = [p for p in power if not p.error and p.watts is not None]
    if not usable:
        return None
    rank = {kind: i for i, kind in enumerate(KIND_ORDER)}
    return min(usable, key=lambda p: (rank.get(p.kind, len(KIND_ORDER)), p.source))


def average_watts(previous: Power | None, current: Power) -> float | None:
    """The node's mean draw between two readings of the same source, from its energy counter
    (``(E1 - E0) / (t1 - t0)``), which covers the whole interval the tokens/s are measured over; the
    reading's instantaneous ``watts`` when the counter is missing, went down (a reset) or no time passed."""
    if (
        previous is not None
        and previous.source == current.source
        and previous.energy_j is not None
        and current.energy_j is not None
        and current.energy_j >= previous.energy_j
        and current.at > previous.at
    ):
        return (current.energy_j - previous.energy_j) / (current.at - previous.at)
    return current.watts


@dataclass(slots=True)
class _Fit:
    """Exponentially weighted sums of one node's (tokens/s, watts) readings."""

    at: float
    w: float = 0.0
    t: float = 0.0
    p: float = 0.0
    tt: float = 0.0
    tp: float = 0.0
    last_reading: float = -math.inf


@dataclass(slots=True)
class _Mean:
    """An exponentially weighted mean."""

    at: float
    w: float = 0.0
    s: float = 0.0

    def add(self, x: float, now: float, half_life_s: float) -> None:
        decay = math.pow(2.0, -max(0.0, now - self.at) / half_life_s)
        self.w, self.s = self.w * decay + 1.0, self.s * decay + x
        self.at = max(self.at, now)

    def mean(self) -> float | None:
        return self.s / self.w if self.w > 0 else None


def _add(fit: _Fit, watts: float, tps: float, now: float, half_life_s: float) -> None:
    decay = math.pow(2.0, -max(0.0, now - fit.at) / half_life_s)
    fit.w, fit.t, fit.p, fit.tt, fit.tp = (
        fit.w * decay + 1.0,
        fit.t * decay + tps,
        fit.p * decay + watts,
        fit.tt * decay + tps * tps,
        fit.tp * decay + tps * watts,
    )
    fit.at = max(fit.at, now)


def _slope(fit: _Fit, min_spread: float) -> float | None:
    """The fitted slope, ``None`` while tokens/s have not varied by ``min_spread`` or it is not positive."""
    if fit.w < 3.0:
        return None
    mean_t = fit.t / fit.w
    var_t = fit.tt / fit.w - mean_t * mean_t
    if var_t < min_spread**2:
        return None
    slope = (fit.tp / fit.w - mean_t * fit.p / fit.w) / var_t
    return slope if slope > 0 and math.isfinite(slope) else None


@dataclass(slots=True)
class _Curve:
    """One node's idle and busy readings (module docstring, "The power curve")."""

    busy: _Fit
    idle: _Mean
    seq: _Mean


class EnergyModel:
    """Per-node energy per output token (module docstring). Units: W, tokens/s, J/token, seconds."""

    def __init__(self, half_life_s: float = 300.0, min_spread_tps: float = 5.0, min_tps: float = 1.0) -> None:
        if not (half_life_s > 0 and min_spread_tps > 0 and min_tps > 0):
            raise ValueError("half_life_s, min_spread_tps and min_tps must be > 0")
        self.half_life_s, self.min_spread_tps, self.min_tps = half_life_s, min_spread_tps, min_tps
        self._fits: dict[str, _Fit] = {}
        self._curves: dict[str, _Curve] = {}

    def observe(
        self,
        node: str,
        watts: float,
        tps: float,
        now: float,
        reading_at: float | None = None,
        running: float | None = None,
    ) -> None:
        """Add one reading; ``reading_at`` (the reading's own time) skips a reading already added;
        ``running``: requests the node's engines ran (their metrics), for the speed of one sequence."""
        if not (math.isfinite(watts) and math.isfinite(tps)) or watts < 0 or tps < 0:
            return
        fit = self._fits.get(node)
        if fit is None:
            fit = self._fits[node] = _Fit(now)
        if reading_at is not None:
            if reading_at <= fit.last_reading:
                return
            fit.last_reading = reading_at
        _add(fit, watts, tps, now, self.half_life_s)
        curve = self._curves.get(node)
        if curve is None:
            curve = self._curves[node] = _Curve(_Fit(now), _Mean(now), _Mean(now))
        if tps < self.min_tps:
            if running is None or running < 1.0:  # running requests but no tokens yet: not idle
                curve.idle.add(watts, now, self.half_life_s)
            return
        _add(curve.busy, watts, tps, now, self.half_life_s)
        if running is not None and math.isfinite(running) and running >= 1.0:
            curve.seq.add(tps / running, now, self.half_life_s)

    def curve(self, node: str) -> PowerCurve | None:
        """``node``'s power curve (module docstring), ``None`` before 3 busy readings. Without a busy
        slope yet (tokens/s not spread): ``k`` = the busy mean above the idle draw per token and no wake
        cost; without idle readings: the idle draw is the busy intercept (no wake cost known), or, with
        neither, 0 and ``k`` the busy average ``watts / tokens_per_s``."""
        c = self._curves.get(node)
        if c is None or c.busy.w < 3.0:
            return None
        busy = c.busy
        mean_t, mean_p = busy.t / busy.w, busy.p / busy.w
        idle = c.idle.mean() if c.idle.w >= 1.0 else None
        slope = _slope(busy, self.min_spread_tps)
        if slope is not None:
            base = mean_p - slope * mean_t
            idle_w = base if idle is None else idle
            k, wake = slope, max(0.0, base - idle_w)
        elif idle is not None:
            idle_w, k, wake = idle, max(mean_p - idle, 0.0) / mean_t, 0.0
        else:
            idle_w, k, wake = 0.0, mean_p / mean_t, 0.0
        seq = c.seq.mean() if c.seq.w > 0 else None
        return PowerCurve(idle_w, wake, k, seq if seq is not None and seq > 0 else None, mean_t)

    def marginal(self, node: str, watts: float | None = None, tps: float | None = None) -> float | None:
        """J per output token of ``node``: the fitted slope, else ``watts / tps`` now (module docstring)."""
        fit = self._fits.get(node)
        if fit is not None:
            slope = _slope(fit, self.min_spread_tps)
            if slope is not None:
                return slope
        if watts is None or tps is None or tps < self.min_tps:
            return None
        return watts / tps

    def forget(self, node: str) -> None:
        self._fits.pop(node, None)
        self._curves.pop(node, None)


class CapLatch:
    """Hysteresis for the ``power-cap`` filter, per key (an endpoint): ``over`` turns on when a reading is
    over the entry threshold (``enter``) and off only when a reading is under the exit threshold (not
    ``stay``); it changes only when the readings' time ``at`` differs from the last one it saw (an older
    time too: an agent whose wall clock stepped back, or that restarted, is read at once), so asking again
    about the same readings gives the same answer. Pure bookkeeping, no clock."""

    __slots__ = ("_over", "_state")

    def __init__(self) -> None:
        self._state: dict[str, tuple[float, bool]] = {}
        self._over: set[str] = set()

    @property
    def holding(self) -> bool:
        """Whether some key is latched over."""
        return bool(self._over)

    def __contains__(self, key: object) -> bool:
        return key in self._state

    def __len__(self) -> int:
        return len(self._state)

    def update(self, key: str, at: float, *, enter: bool, stay: bool) -> bool:
        """The latched state for readings taken at ``at``: ``enter`` (over the entry threshold) and
        ``stay`` (over the exit threshold; ``enter`` implies it)."""
        seen = self._state.get(key)
        if seen is not None and at == seen[0]:
            return seen[1]
        over = enter or (stay and seen is not None and seen[1])
        self._state[key] = (at, over)
        if over:
            self._over.add(key)
        else:
            self._over.discard(key)
        return over

    def held(self, key: str) -> bool:
        """The latched state of ``key`` without a new reading (``False`` for a key never seen)."""
        seen = self._state.get(key)
        return seen is not None and seen[1]

    def forget(self, key: str) -> None:
        self._state.pop(key, None)
        self._over.discard(key)
