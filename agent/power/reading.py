"""What one read of a power source yields, and the checks every source's numbers pass (no IO).

:class:`Sample` is a source's answer before the monitor stamps it (:func:`stamp` makes the
:class:`contracts.events.Power` that travels on the feed). :func:`number` rejects what no sensor reads:
booleans, NaN, infinities, negatives and values past a bound, so a garbled answer is a
:class:`~agent.power.errors.PowerSourceError`, never a reading. :data:`THROTTLE_MASK` says which clocks
event reasons count as throttling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from agent.power.errors import PowerSourceError
from contracts.events import Gpu, Power

#: Clocks event reasons (NVML ``nvmlClocksEventReason*``, DCGM ``DCGM_CLOCKS_EVENT_REASON_*``: the same
#: bits) that mean a power or thermal limit holds the clocks down: SW power cap 0x4, HW slowdown 0x8,
#: SW thermal slowdown 0x20, HW thermal slowdown 0x40, HW power brake 0x80. Idle (0x1), application clock
#: settings (0x2), sync boost (0x10) and display clocks (0x100) are not throttling.
THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80

#: Bounds past which a number is garbage, not a reading: watts of one node, degrees Celsius, MHz.
MAX_WATTS = 1_000_000.0
MAX_CELSIUS = 250.0
MAX_MHZ = 100_000.0
#: Largest plausible energy counter (mJ): 10 MW for ten years.
MAX_MILLIJOULES = 1e7 * 3.2e8 * 1e3


@dataclass(frozen=True, slots=True)
class Sample:
    """One successful read. Units: W, J (a cumulative counter), degrees Celsius, MHz; ``None``: not
    read. ``watts`` is ``None`` only for a source that reads temperatures alone."""

    watts: float | None = None
    limit_w: float | None = None
    energy_j: float | None = None
    temperature_c: float | None = None
    throttled: bool | None = None
    sm_clock_mhz: float | None = None


def number(value: object, what: str, maximum: float) -> float:
    """``value`` as a float in ``[0, maximum]``; :class:`PowerSourceError` naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PowerSourceError(f"{what}: expected a number, got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result) or not 0.0 <= result <= maximum:
        raise PowerSourceError(f"{what}: {result!r} is not a plausible reading (0..{maximum:g})")
    return result


def optional(value: object, what: str, maximum: float) -> float | None:
    """:func:`number`, with ``None`` (the field is absent) passed through."""
    return None if value is None else number(value, what, maximum)


def throttled(reasons: int | None) -> bool | None:
    """Whether a clocks event reasons bitmask says power or thermal throttling (``None``: unknown)."""
    return None if reasons is None else bool(reasons & THROTTLE_MASK)


def _sum_of_all(values: Sequence[float | None]) -> float | None:
    """The sum of ``values``, ``None`` when any is missing (part of a node's figure is no figure)."""
    known = [v for v in values if v is not None]
    return sum(known) if len(known) == len(values) else None


def from_gpus(gpus: Sequence[Gpu]) -> Sample:
    """The node's figures from its GPUs' NVML telemetry: watts and limits summed (a limit only when
    every GPU reports one), the energy counters summed in J (likewise only when every GPU reports one),
    the hottest temperature, throttled when any GPU is, the mean SM clock.
    :class:`PowerSourceError` when no GPU reports its power, or for a GPU's implausible number
    (:func:`number`)."""
    watts = [number(g.power_w, f"GPU {g.index} power", MAX_WATTS) for g in gpus if g.power_w is not None]
    if not watts:
        raise PowerSourceError("no GPU reports its power draw")
    temps = [
        number(g.temperature_c, f"GPU {g.index} temperature", MAX_CELSIUS)
        for g in gpus
        if g.temperature_c is not None
    ]
    reasons = [g.throttle_reasons for g in gpus if g.throttle_reasons is not None]
    clocks = [
        number(g.sm_clock_mhz, f"GPU {g.index} SM clock", MAX_MHZ) for g in gpus if g.sm_clock_mhz is not None
    ]
    energy_mj = _sum_of_all(
        [optional(g.energy_mj, f"GPU {g.index} energy counter", MAX_MILLIJOULES) for g in gpus]
    )
    return Sample(
        watts=sum(watts),
        limit_w=_sum_of_all(
            [optional(g.power_limit_w, f"GPU {g.index} power limit", MAX_WATTS) for g in gpus]
        ),
        energy_j=None if energy_mj is None else energy_mj / 1000.0,
        temperature_c=max(temps) if temps else None,
        throttled=any(bool(r & THROTTLE_MASK) for r in reasons) if reasons else None,
        sm_clock_mhz=sum(clocks) / len(clocks) if clocks else None,
    )


def stamp(source: str, kind: str, at: float, sample: Sample | None, error: str = "") -> Power:
    """The feed's record of one attempt at wall-clock time ``at``: ``sample``'s values, or none and
    ``error``."""
    if sample is None:
        return Power(source, kind, at=at, error=error or "no reading")
    return Power(
        source,
        kind,
        watts=sample.watts,
        limit_w=sample.limit_w,
        energy_j=sample.energy_j,
        temperature_c=sample.temperature_c,
        throttled=sample.throttled,
        sm_clock_mhz=sample.sm_clock_mhz,
        at=at,
    )
