"""The drift alarm's core (sans IO): per model and endpoint, the prompt tokens the router predicted the
engine held against the tokens the engine reported it reused.

Each routed request the engine answered with a cached-token count is one :class:`Sample`: ``predicted``
= matched blocks x block size at the decision, ``actual`` = the engine's
``usage.prompt_tokens_details.cached_tokens``. Requests with nothing predicted carry no claim to check
and are only counted. Over the last ``window`` samples of a (model, endpoint) (README.md)::

    ratio = sum(actual) / sum(predicted)
    error = sum(max(0, predicted - actual)) / sum(predicted)

The alarm trips when at least ``min_samples`` samples are in the window and ``error >= trip_error``, and
clears when ``error <= clear_error`` (hysteresis). Samples older than ``max_age_s`` leave the window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from contracts.config import Section
from contracts.errors import ConfigError


@dataclass(frozen=True, slots=True)
class DriftPolicy:
    """``window``: samples kept per (model, endpoint); ``min_samples``: no verdict below this many;
    ``trip_error`` / ``clear_error``: the error at or above which the alarm trips, at or below which a
    tripped alarm clears; ``max_age_s``: seconds a sample stays in its window."""

    window: int = 64
    min_samples: int = 16
    trip_error: float = 0.5
    clear_error: float = 0.25
    max_age_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.min_samples <= self.window:
            raise ConfigError("drift: need window >= 1 and 1 <= min_samples <= window")
        if not 0.0 <= self.clear_error < self.trip_error <= 1.0:
            raise ConfigError("drift: need 0 <= clear_error < trip_error <= 1")
        if not self.max_age_s > 0:
            raise ConfigError("drift: max_age_s must be positive")


@dataclass(frozen=True, slots=True)
class Sample:
    """One answered request: ``predicted`` and ``actual`` cached prompt tokens, at ``at`` (seconds)."""

    predicted: int
    actual: int
    at: float


#: The two ways the engine's number arrives: each answer's ``cached_tokens`` (this module), or the
#: engine's prefix-cache counters (:mod:`extproc.drift.counters`).
RESPONSES, COUNTERS = "responses", "counters"
Key = tuple[str, str, str]
"""(model, endpoint, source) of one alarm."""


@dataclass(frozen=True, slots=True)
class DriftView:
    """What the alarm says of one (model, endpoint) from one ``source``: ``samples`` in the window
    (requests with a prediction), ``ratio`` and ``error`` over them (``None`` with no sample),
    ``tripped``, and since start ``observed`` (requests compared, predicted or not)."""

    model: str
    endpoint: str
    samples: int
    ratio: float | None
    error: float | None
    tripped: bool
    observed: int
    source: str = RESPONSES


def verdict(policy: DriftPolicy, tripped: bool, samples: int, error: float | None) -> bool:
    """The trip rule (README.md): with ``samples >= min_samples``, trip at ``error >= trip_error``, clear
    at ``error <= clear_error``; otherwise (and with too few samples) the last verdict stands; no sample
    at all: not tripped."""
    if samples == 0 or error is None:
        return False
    if samples < policy.min_samples:
        return tripped
    if error >= policy.trip_error:
        return True
    if error <= policy.clear_error:
        return False
    return tripped


@dataclass(slots=True)
class _Window:
    samples: deque[Sample] = field(default_factory=deque)
    predicted: int = 0
    actual: int = 0
    shortfall: int = 0
    tripped: bool = False
    observed: int = 0

    def push(self, sample: Sample, size: int) -> None:
        self.samples.append(sample)
        self._add(sample, 1)
        while len(self.samples) > size:
            self._add(self.samples.popleft(), -1)

    def expire(self, before: float) -> None:
        while self.samples and self.samples[0].at < before:
            self._add(self.samples.popleft(), -1)

    def _add(self, s: Sample, sign: int) -> None:
        self.predicted += sign * s.predicted
        self.actual += sign * s.actual
        self.shortfall += sign * max(0, s.predicted - s.actual)


class DriftMonitor:
    """Keeps one window per (model, endpoint); :meth:`observe` returns the views whose alarm changed."""

    def __init__(
        self, policy: DriftPolicy | None = None, published: dict[Key, DriftView] | None = None
    ) -> None:
        self.policy = policy or DriftPolicy()
        self._windows: dict[tuple[str, str], _Window] = {}
        #: The latest view of each alarm, replaced whole at each change (shared with
        #: :class:`~extproc.drift.counters.CounterDrift`): what the metrics collector reads from its own
        #: thread (copy it with ``list(...)``, retrying on RuntimeError).
        self.published: dict[Key, DriftView] = {} if published is None else published

    def observe(self, model: str, endpoint: str, predicted: int, actual: int, now: float) -> DriftView | None:
        """One answered request; the new view when its alarm tripped or cleared, else ``None``."""
        key = (model, endpoint)
        win = self._windows.get(key)
        if win is None:
            win = self._windows[key] = _Window()
        win.observed += 1
        win.expire(now - self.policy.max_age_s)
        if predicted > 0:
            win.push(Sample(predicted, max(0, actual), now), self.policy.window)
        was = win.tripped
        win.tripped = self._verdict(win)
        view = self.published[(*key, RESPONSES)] = self._view(key, win)
        return view if win.tripped != was else None

    def forget(self, endpoint: str) -> None:
        """The endpoint left the fleet: drop its windows."""
        for key in [k for k in self._windows if k[1] == endpoint]:
            del self._windows[key]
            self.published.pop((*key, RESPONSES), None)

    def views(self, now: float) -> list[DriftView]:
        """Every (model, endpoint) seen, sorted, with samples older than ``max_age_s`` expired."""
        out = []
        for key in sorted(self._windows):
            win = self._windows[key]
            win.expire(now - self.policy.max_age_s)
            win.tripped = self._verdict(win)
            view = self.published[(*key, RESPONSES)] = self._view(key, win)
            out.append(view)
        return out

    def _verdict(self, win: _Window) -> bool:
        error = win.shortfall / win.predicted if win.predicted > 0 else None
        return verdict(self.policy, win.tripped, len(win.samples), error)

    @staticmethod
    def _view(key: tuple[str, str], win: _Window) -> DriftView:
        ratio = error = None
        if win.predicted > 0:
            ratio = win.actual / win.predicted
            error = win.shortfall / win.predicted
        return DriftView(key[0], key[1], len(win.samples), ratio, error, win.tripped, win.observed)


def parse_drift(section: Section) -> DriftPolicy:
    """The gateway config's ``[drift]`` table; unknown keys are errors."""
    d = DriftPolicy()
    policy = DriftPolicy(
        window=section.integer("window", d.window, minimum=1),
        min_samples=section.integer("min_samples", d.min_samples, minimum=1),
        trip_error=section.number("trip_error", d.trip_error, minimum=0.0),
        clear_error=section.number("clear_error", d.clear_error, minimum=0.0),
        max_age_s=section.number("max_age_s", d.max_age_s, minimum=0.001),
    )
    section.done()
    return policy
