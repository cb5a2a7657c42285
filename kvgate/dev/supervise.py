"""When ``kvgate up`` restarts a child that died: capped exponential backoff, reset by a stable run.

Pure policy: no processes, no clock reads (``now`` is a parameter, seconds on one monotonic clock). The
process side (watching children, spawning them again, awaiting their readiness) is
:mod:`kvgate.dev.supervisor`.

With the defaults, a child that keeps dying at once is restarted after 0.2 s, 0.4 s, 0.8 s, ... up to
10 s, then every 10 s for as long as it keeps dying: it never stops the stack. A child that ran for
``stable_s`` or longer before it died is restarted after ``initial_s`` again::

    plan = RestartPlan()
    plan.started(now=0.0)
    plan.exited(now=1.0)    # Restart(attempt=1, delay_s=0.2, at=1.2)
    plan.started(now=1.2)
    plan.exited(now=1.3)    # Restart(attempt=2, delay_s=0.4, at=1.7)
"""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """Restart delays (s): ``initial_s`` for the first restart, doubling up to ``max_s``; a run that
    lasted ``stable_s`` or longer starts the sequence again from ``initial_s``."""

    initial_s: float = 0.2
    max_s: float = 10.0
    stable_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"backoff: need 0 < initial_s <= max_s, got {self.initial_s}, {self.max_s}")
        if self.stable_s <= 0:
            raise ValueError(f"backoff: stable_s must be positive, got {self.stable_s}")

    def delay_s(self, attempt: int) -> float:
        """The delay before restart number ``attempt`` (1 = the first since the last stable run)."""
        if attempt < 1:
            raise ValueError(f"attempt must be >= 1, got {attempt}")
        # 2**60 already exceeds any cap; the exponent is bounded so a long crash loop never overflows.
        return min(self.max_s, self.initial_s * 2.0 ** min(attempt - 1, 60))


@dataclass(frozen=True, slots=True)
class Restart:
    """What to do about a child that died: restart number ``attempt`` (1 = the first since it last ran
    stably), after ``delay_s``, i.e. at ``at`` (on the clock ``now`` was given on)."""

    attempt: int
    delay_s: float
    at: float


class RestartPlan:
    """One child's restart schedule. Call :meth:`started` each time it is (re)started and
    :meth:`exited` each time it is found dead; the latter says when to start it again."""

    def __init__(self, backoff: Backoff | None = None) -> None:
        self.backoff = backoff or Backoff()
        self._started_at: float | None = None
        self._attempt = 0

    @property
    def attempt(self) -> int:
        """Restarts since the child last ran stably (0: none)."""
        return self._attempt

    def started(self, now: float) -> None:
        """The child was (re)started at ``now``."""
        self._started_at = now

    def exited(self, now: float) -> Restart:
        """The child was found dead at ``now``: when to start it again. A run of ``stable_s`` or more
        (from the last :meth:`started`) resets the sequence; without a start since the last exit, the
        sequence goes on."""
        if self._started_at is not None and now - self._started_at >= self.backoff.stable_s:
            self._attempt = 0
        self._started_at = None
        self._attempt += 1
        delay = self.backoff.delay_s(self._attempt)
        return Restart(self._attempt, delay, now + delay)


def exit_reason(returncode: int) -> str:
    """A process's end as people read it: ``"exit code 3"``, ``"signal SIGKILL"`` (``subprocess``'s
    negative return codes are signals)."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"
