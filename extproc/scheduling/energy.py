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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from contracts.events import Power

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


class EnergyModel:
    """Per-node energy per output token (module docstring). Units: W, tokens/s, J/token, seconds."""

    def __init__(self, half_life_s: float = 300.0, min_spread_tps: float = 5.0, min_tps: float = 1.0) -> None:
        if not (half_life_s > 0 and min_spread_tps > 0 and min_tps > 0):
            raise ValueError("half_life_s, min_spread_tps and min_tps must be > 0")
        self.half_life_s, self.min_spread_tps, self.min_tps = half_life_s, min_spread_tps, min_tps
        self._fits: dict[str, _Fit] = {}

    def observe(
        self, node: str, watts: float, tps: float, now: float, reading_at: float | None = None
    ) -> None:
        """Add one reading; ``reading_at`` (the reading's own time) skips a reading already added."""
        if not (math.isfinite(watts) and math.isfinite(tps)) or watts < 0 or tps < 0:
            return
        fit = self._fits.get(node)
        if fit is None:
            fit = self._fits[node] = _Fit(now)
        if reading_at is not None:
            if reading_at <= fit.last_reading:
                return
            fit.last_reading = reading_at
        decay = math.pow(2.0, -max(0.0, now - fit.at) / self.half_life_s)
        fit.w, fit.t, fit.p, fit.tt, fit.tp = (
            fit.w * decay + 1.0,
            fit.t * decay + tps,
            fit.p * decay + watts,
            fit.tt * decay + tps * tps,
            fit.tp * decay + tps * watts,
        )
        fit.at = max(fit.at, now)

    def marginal(self, node: str, watts: float | None = None, tps: float | None = None) -> float | None:
        """J per output token of ``node``: the fitted slope, else ``watts / tps`` now (module docstring)."""
        fit = self._fits.get(node)
        if fit is not None and fit.w >= 3.0:
            mean_t = fit.t / fit.w
            var_t = fit.tt / fit.w - mean_t * mean_t
            if var_t >= self.min_spread_tps**2:
                slope = (fit.tp / fit.w - mean_t * fit.p / fit.w) / var_t
                if slope > 0 and math.isfinite(slope):
                    return slope
        if watts is None or tps is None or tps < self.min_tps:
            return None
        return watts / tps

    def forget(self, node: str) -> None:
        self._fits.pop(node, None)
