"""Supervised agent tasks: a long-running coroutine that fails is restarted, never left dead.

An agent task that runs for as long as its engine does (the KV event pump, which drives the engine's
ZMQ subscriber) used to end on its first unexpected exception, and nothing restarted it: the gateway
then kept routing on the engine's last known blocks while the engine's cache moved on. :func:`supervise`
runs such a task in a loop: an exception (not a cancellation) is logged by its type only (never its
message or traceback, which may quote an engine's payload or token ids), counted by the caller's
``count(error_type)`` (the agent's ``kvgate_agent_task_failures_total``), cleaned up by ``on_failure``
(close what the failed run held, tell the feed that what it published is no longer known), and the
task is run again after a back-off.

Back-off (:class:`RestartPolicy`): after the k-th failure in a row, ``min(max_s, base_s * 2^(k-1))``
seconds; a run that lasted at least ``healthy_after_s`` before failing starts the count again (a task
that fails once a day restarts at once, one that fails at every start waits up to ``max_s``). A run
that returns normally ends the supervision (the task's work is done: its source closed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When a failed task runs again (see the module docstring)."""

    base_s: float = 0.5
    max_s: float = 30.0
    healthy_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.max_s or self.healthy_after_s <= 0:
            raise ValueError("need 0 < base_s <= max_s and healthy_after_s > 0")

    def delay(self, failures: int) -> float:
        """Seconds before the next run after ``failures`` (>= 1) failures in a row."""
        return min(self.max_s, self.base_s * 2.0 ** min(failures - 1, 62))


async def supervise(
    name: str,
    run: Callable[[], Awaitable[None]],
    *,
    count: Callable[[str], object],
    on_failure: Callable[[], Awaitable[None]] | None = None,
    policy: RestartPolicy = RestartPolicy(),
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> None:
    """Run ``run()`` until it returns, restarting it after each exception (see the module docstring).
    Cancellation ends the supervision at once (also during a back-off). ``on_failure`` runs after each
    failure, before the back-off; an exception of its own is logged (type only) and does not stop the
    restarts."""
    failures = 0
    while True:
        started = clock()
        try:
            await run()
            return
        except Exception as exc:  # what supervision is for; CancelledError is a BaseException
            error = type(exc).__name__
        failures = 1 if clock() - started >= policy.healthy_after_s else failures + 1
        delay = policy.delay(failures)
        count(error)
        log.error("task %s failed (%s, %d in a row): restarting in %.1f s", name, error, failures, delay)
        if on_failure is not None:
            try:
                await on_failure()
            except Exception as exc:
                log.error("task %s: cleaning up after the failure failed (%s)", name, type(exc).__name__)
        await sleep(delay)
