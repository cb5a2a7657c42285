"""The ext_proc's own saturation (sans IO): how many decisions are in flight, and how late its event loop
runs.

A *decision* is the CPU work of one request: from the moment its ext_proc stream starts until the
processor has answered it: headers read, body buffered, parsed, rendered, tokenized (in a worker thread
for a large body: the *decision queue*), hashed, looked up and scheduled. Counting from the stream's
start, not from its headers, sees the backlog: under more load than the loop decides, streams wait with
their messages unread, and only their count says so (measured: extproc/overload/README.md). A bodyless
request (a probe, ``GET /v1/models``) stops counting at its headers; a request flow control holds
(:mod:`extproc.flow`) stops when it is queued, one waiting for its prefill half or a slot restore when
decided. :class:`DecisionGate` bounds the decisions in flight: :meth:`DecisionGate.admit` at a request's
headers is the whole shed test (one comparison, before any body is buffered), so shedding costs no
parse.

:class:`LagMeter`: a timer due every ``interval_s`` seconds that wakes ``lag`` seconds late says the
loop was busy that long with other work; ``lag`` over a window is the loop's saturation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from contracts.config import Section
from contracts.errors import ConfigError

#: Decisions in flight by default (measured: extproc/overload/README.md).
DEFAULT_MAX_DECISIONS = 256


@dataclass(frozen=True, slots=True)
class OverloadConfig:
    """``max_decisions``: decisions in flight beyond which a new request is shed (503) at its headers
    (0: no bound); ``lag_interval_s``: the loop-lag timer's period (s); ``lag_window_s``: the window the
    peak lag is kept over (s)."""

    max_decisions: int = DEFAULT_MAX_DECISIONS
    lag_interval_s: float = 0.05
    lag_window_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_decisions < 0:
            raise ConfigError("overload.max_decisions: must be >= 0")
        if not 0.001 <= self.lag_interval_s <= self.lag_window_s:
            raise ConfigError("overload: need 0.001 <= lag_interval_s <= lag_window_s")


def parse_overload(section: Section) -> OverloadConfig:
    """The gateway config's ``[overload]`` table; unknown keys are errors."""
    d = OverloadConfig()
    config = OverloadConfig(
        max_decisions=section.integer("max_decisions", d.max_decisions, minimum=0),
        lag_interval_s=section.number("lag_interval_s", d.lag_interval_s, minimum=0.001),
        lag_window_s=section.number("lag_window_s", d.lag_window_s, minimum=0.001),
    )
    section.done()
    return config


class DecisionGate:
    """Counts decisions in flight against ``limit`` (0: none). ``queued``: of those, the ones whose body
    is complete and waits for a worker thread (:meth:`enqueue` / :meth:`dequeue`)."""

    __slots__ = ("admitted", "in_flight", "limit", "peak", "queued", "shed")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self.queued = 0
        self.peak = 0
        self.admitted = 0
        self.shed = 0

    def enter(self) -> None:
        """A stream started: counted until :meth:`release`."""
        self.in_flight += 1
        if self.in_flight > self.peak:
            self.peak = self.in_flight

    def admit(self) -> bool:
        """An entered stream's headers came with a body to follow: ``True``, or ``False`` when more than
        ``limit`` decisions are in flight, itself included (then shed it, and :meth:`release` it)."""
        if self.limit and self.in_flight > self.limit:
            self.shed += 1
            return False
        self.admitted += 1
        return True

    def release(self) -> None:
        """An entered stream's decision ended (answered, held, rejected, shed, or its stream closed)."""
        self.in_flight = max(0, self.in_flight - 1)

    def enqueue(self) -> None:
        self.queued += 1

    def dequeue(self) -> None:
        self.queued = max(0, self.queued - 1)

    @property
    def saturation(self) -> float:
        """``in_flight / limit`` (0 without a limit): 1 means the next request is shed."""
        return self.in_flight / self.limit if self.limit else 0.0


class LagMeter:
    """The loop's lateness: :meth:`record` each wake of a timer (``due`` and ``woke``, seconds of the
    loop's clock); ``last`` and ``peak`` (the highest over the last ``window_s``)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.last = 0.0
        self._recent: deque[tuple[float, float]] = deque()  # (woke, lag), lag decreasing

    def record(self, due: float, woke: float) -> float:
        lag = max(0.0, woke - due)
        self.last = lag
        recent = self._recent
        while recent and recent[-1][1] <= lag:  # a monotonic deque: the window's max at the front
            recent.pop()
        recent.append((woke, lag))
        while recent[0][0] < woke - self.window_s:
            recent.popleft()
        return lag

    @property
    def peak(self) -> float:
        return self._recent[0][1] if self._recent else 0.0
