"""Keeping ``kvgate up``'s children running: each :class:`Service` that dies is started again.

A :class:`Service` is one named child process the launcher keeps: the same command line, work directory
and log file (appended to) each time it starts, so a restarted child serves at the same addresses (the
launcher pins ephemeral ports to the ones the first run bound). Files listed as ``stale`` (ready files,
Envoy's admin address file) are removed before each start, so only the new process's can be read, and
ready files count only when they carry its PID (:meth:`kvgate.dev.procs.Child.wait_for_json_file`).

The :class:`Supervisor` thread polls every service; a dead one is logged (which, its PID, its exit code
or signal) and started again after the delay :class:`kvgate.dev.supervise.RestartPlan` gives (capped
exponential backoff, reset by a stable run), forever: a child that keeps crashing never stops the stack.
A restarted child's readiness is awaited on a thread of its own, so one slow start never delays the
supervision of the others; once ready, ``on_ready`` hears of it (the launcher refreshes ``stack.json``).
Only :meth:`Supervisor.close` (the launcher stopping) ends supervision.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from kvgate.dev.procs import Child
from kvgate.dev.supervise import Backoff, Restart, RestartPlan, exit_reason

log = logging.getLogger(__name__)
T = TypeVar("T")


class Restartable(Protocol):
    """What the supervisor needs of a child: its state, a way to start it again, and its readiness."""

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None:
        """``None`` while the current process runs; its exit status (negative: a signal) once it ended."""

    def spawn(self) -> object:
        """Start the process again (same command line, ports, files); returns at once."""

    def await_ready(self) -> object:
        """Block until the current process is ready (its value: e.g. its ready file); ``RuntimeError``
        when it exits first or is not ready in time."""

    def kill(self) -> None:
        """End the current process by PID (not ready in time), keeping its exit status."""


class Service(Generic[T]):
    """One child process under ``name`` that the launcher keeps running (see the module docstring).

    ``ready(child)`` blocks until ``child`` is ready and returns what it reported (``ChildFailed`` when
    it exits first or times out). ``argv`` may be replaced between starts (the launcher pins port 0 to
    the port the first start bound); the first :meth:`spawn` happens at construction."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        ready: Callable[[Child], T],
        *,
        stale: Sequence[Path] = (),
    ) -> None:
        self._name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._ready = ready
        self._stale = tuple(stale)
        self.starts = 0
        self.child = self.spawn()

    @property
    def name(self) -> str:
        return self._name

    @property
    def pid(self) -> int:
        return self.child.pid

    @property
    def returncode(self) -> int | None:
        return self.child.proc.poll()

    def alive(self) -> bool:
        return self.child.alive()

    def tail(self, lines: int = 30) -> str:
        return self.child.tail(lines)

    def spawn(self) -> Child:
        """Start the process (again): stale files removed, the log appended to after the first start."""
        if self.starts:
            self.child.stop()  # already exited: reaps it and closes its log
        for path in self._stale:
            path.unlink(missing_ok=True)
        self.child = Child(self._name, self.argv, self.log_path, append=self.starts > 0)
        self.starts += 1
        return self.child

    def await_ready(self) -> T:
        return self._ready(self.child)

    def kill(self) -> None:
        self.child.stop(grace_s=1.0)

    def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM the current process, SIGKILL after ``grace_s``; its exit status."""
        return self.child.stop(grace_s)


class Supervisor:
    """A thread that restarts dead :class:`Restartable` children (see the module docstring).

    ``on_ready(child, value)`` runs on the readiness thread once a restarted child is ready; ``poll_s``
    is how often every child is checked; ``clock`` is the monotonic clock the plans run on."""

    def __init__(
        self,
        children: Sequence[Restartable],
        *,
        backoff: Backoff | None = None,
        on_ready: Callable[[Restartable, object], None] | None = None,
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.children = list(children)
        self._on_ready = on_ready
        self._poll_s = poll_s
        self._clock = clock
        self._plans = {c.name: RestartPlan(backoff) for c in self.children}
        self._due: dict[str, Restart] = {}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvgate-supervisor", daemon=True)
        #: Restarts so far, per child name (what the tests and the banner's users can observe).
        self.restarts: dict[str, int] = dict.fromkeys(self._plans, 0)

    def start(self) -> None:
        now = self._clock()
        for plan in self._plans.values():
            plan.started(now)
        self._thread.start()

    def close(self) -> None:
        """Stop supervising (no start after this returns); readiness threads end with their children."""
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._closed.wait(self._poll_s):
            for child in self.children:
                self._check(child, self._clock())

    def _check(self, child: Restartable, now: float) -> None:
        due = self._due.get(child.name)
        if due is not None:
            if now >= due.at:
                del self._due[child.name]
                self._restart(child, due, now)
            return
        code = child.returncode
        if code is None:
            return
        restart = self._plans[child.name].exited(now)
        self._due[child.name] = restart
        log.warning(
            "%s (pid %d) died (%s): restarting it in %.1f s (attempt %d)",
            child.name,
            child.pid,
            exit_reason(code),
            restart.delay_s,
            restart.attempt,
        )

    def _restart(self, child: Restartable, due: Restart, now: float) -> None:
        self._plans[child.name].started(now)
        try:
            child.spawn()
        except OSError as exc:
            restart = self._plans[child.name].exited(self._clock())
            self._due[child.name] = restart
            log.warning("%s could not be started (%s): retrying in %.1f s", child.name, exc, restart.delay_s)
            return
        self.restarts[child.name] += 1
        log.info(
            "%s restarted (pid %d, attempt %d); awaiting its readiness", child.name, child.pid, due.attempt
        )
        waiter = threading.Thread(
            target=self._await, args=(child, child.pid, now), name=f"kvgate-ready-{child.name}", daemon=True
        )
        waiter.start()

    def _await(self, child: Restartable, pid: int, started: float) -> None:
        """Readiness of ``child``'s process ``pid`` (on this thread); a child that is not ready in time
        is killed, so the supervision loop restarts it."""
        try:
            value = child.await_ready()
        except RuntimeError as exc:
            if child.pid == pid and child.returncode is None and not self._closed.is_set():
                child.kill()
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("%s (pid %d) did not become ready: %s", child.name, pid, reason)
            return
        if self._closed.is_set() or child.pid != pid:
            return
        log.info(
            "%s is ready again (pid %d, %.1f s after its restart)", child.name, pid, self._clock() - started
        )
        if self._on_ready is not None:
            try:
                self._on_ready(child, value)
            except Exception:  # the thread's boundary: the child serves whatever the callback hit
                log.exception("after %s became ready again", child.name)
