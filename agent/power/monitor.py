"""The shell that reads every configured power source on its own interval and keeps the latest reading.

Each source runs in its own task, so a slow or hung one delays nobody: not the other sources, and never
the feed (the telemetry loop only takes :meth:`PowerMonitor.readings`, a list in memory). One read is
bounded by the source's ``timeout_s``; a read that fails (:class:`~agent.power.errors.PowerSourceError`,
the bound, or a bug in a source) is kept as a reading with ``error`` set and no values, logged once per
run of failures (a warning naming the error, then one line when it reads again), counted, and retried
after ``interval_s`` doubled per failure in a row, at most :attr:`PowerMonitor.max_backoff_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agent.power.errors import PowerSourceError
from agent.power.reading import Sample, stamp
from contracts.events import Power

log = logging.getLogger(__name__)


class Source(Protocol):
    """A power source: :meth:`read` gives one sample or raises :class:`PowerSourceError`."""

    name: str
    kind: str

    async def read(self) -> Sample: ...

    async def aclose(self) -> None: ...


@dataclass(slots=True)
class SourceState:
    """One source's bookkeeping: its settings (s), counts, the run of failures, the latest reading."""

    source: Source
    interval_s: float
    timeout_s: float
    reads: int = 0
    failures: int = 0
    streak: int = 0
    latest: Power | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, object]:
        """What the agent's ``/status`` shows of the source (no credentials: sources hold none here)."""
        latest = self.latest
        return {
            "name": self.source.name,
            "kind": self.source.kind,
            "interval_s": self.interval_s,
            "reads": self.reads,
            "failures": self.failures,
            "failing_for": self.streak,
            "error": None if latest is None else latest.error or None,
            "watts": None if latest is None else latest.watts,
            "limit_w": None if latest is None else latest.limit_w,
            "temperature_c": None if latest is None else latest.temperature_c,
            "throttled": None if latest is None else latest.throttled,
            "at": None if latest is None else latest.at,
        }


class PowerMonitor:
    """Reads ``sources`` (each with its interval and timeout, s) until :meth:`aclose`; never raises.

    ``wall``: the wall clock stamped on readings (seconds since the epoch); ``sleep``: how the loop waits
    (tests pass a fake to step it).
    """

    max_backoff_s = 30.0

    def __init__(
        self,
        sources: Sequence[tuple[Source, float, float]],
        *,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._states = {s.name: SourceState(s, interval, timeout) for s, interval, timeout in sources}
        if len(self._states) != len(sources):
            raise ValueError("power sources must have distinct names")
        self._wall = wall
        self._sleep = sleep

    @property
    def states(self) -> list[SourceState]:
        return list(self._states.values())

    def readings(self) -> list[Power]:
        """The latest reading of every source that has been read at least once."""
        return [s.latest for s in self._states.values() if s.latest is not None]

    async def read_once(self, name: str) -> Power:
        """One attempt at source ``name``, recorded as its latest reading, and returned."""
        state = self._states[name]
        source = state.source
        error = ""
        sample: Sample | None = None
        unexpected: Exception | None = None
        try:
            async with asyncio.timeout(state.timeout_s):
                sample = await source.read()
        except PowerSourceError as exc:
            error = str(exc) or type(exc).__name__
        except TimeoutError:
            error = f"no answer within {state.timeout_s:g} s"
        except Exception as exc:  # a bug in a source must not end power telemetry
            unexpected = exc
            error = f"{type(exc).__name__}: {exc}"
        reading = stamp(source.name, source.kind, self._wall(), sample, error)
        state.reads += 1
        if sample is None:
            state.failures += 1
            state.streak += 1
            if state.streak == 1:  # once per run of failures (a bug's traceback too)
                log.warning(
                    "power source %s (%s) failed%s: %s; retrying",
                    name,
                    source.kind,
                    " unexpectedly" if unexpected is not None else "",
                    reading.error,
                    exc_info=unexpected,
                )
        else:
            if state.streak:
                log.info(
                    "power source %s (%s) reads again after %d failures", name, source.kind, state.streak
                )
            state.streak = 0
        state.latest = reading
        return reading

    def delay(self, name: str) -> float:
        """Seconds until source ``name``'s next read: its interval, doubled per failure in a row."""
        state = self._states[name]
        if not state.streak:
            return state.interval_s
        return min(self.max_backoff_s, state.interval_s * 2.0 ** min(state.streak - 1, 16))

    def start(self) -> None:
        for name, state in self._states.items():
            state.task = asyncio.create_task(self._run(name), name=f"kvgate-power-{name}")

    async def aclose(self) -> None:
        """Stop every source's task and close the sources."""
        for state in self._states.values():
            task, state.task = state.task, None
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for state in self._states.values():
            try:
                await state.source.aclose()
            except Exception:  # closing one source must not leave the others open
                log.exception("closing power source %s failed", state.source.name)

    async def _run(self, name: str) -> None:
        while True:
            await self.read_once(name)
            await self._sleep(self.delay(name))
