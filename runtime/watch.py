"""Following one etcd key prefix: the asyncio shell shared by every sans-IO core that mirrors etcd state.

A :class:`PrefixWatcher` drives a :class:`WatchedCore`: one range read of the prefix handed to
:meth:`WatchedCore.snapshot`, then a watch from the next revision whose batches go to
:meth:`WatchedCore.apply` (as :class:`contracts.etcd.Change`). Whatever a call returns goes to
``on_applied``. The loop, until :meth:`PrefixWatcher.aclose`:

* **Liveness**: etcd's watch stream reconnects silently, so a probe beside it (a ``count_only`` read with
  one attempt, every ``probe_interval_s``) raises as soon as etcd stops answering.
* **Outage** (a failed read, watch or probe): the core keeps its last state, :attr:`connected` turns
  false, and the watcher retries with a backoff from 0.1 s doubling up to ``max_backoff_s``, then resyncs
  with a full read (the core applies what changed while it was away). The watch then starts after that
  read's revision, so an etcd rebuilt with revisions starting over is followed too.
* **Cancelled watch** (compaction, or etcd's own reasons): resync at once; but a watch cancelled again
  and again right after it starts (within 1 s) waits a growing time (capped by ``max_backoff_s``) before
  each further resync, so a watch etcd keeps refusing never spins.

Every wait is decided by :class:`Retry` (sans-IO); the shell only reads etcd, sleeps and calls the core.

The client belongs to the caller. Used by the gateway's control plane
(:class:`extproc.control.plane.ControlPlane`) and kvcached's peer discovery (:mod:`kvcached.discovery`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Generic, Protocol, TypeVar

import etcd3aio

from contracts.etcd import Change
from runtime.etcd import ETCD_ERRORS, describe_error

log = logging.getLogger(__name__)

_DELETE = 1  # mvccpb.Event.EventType.DELETE

R_co = TypeVar("R_co", covariant=True)
R = TypeVar("R")


class WatchedCore(Protocol[R_co]):
    """A sans-IO mirror of the keys under a prefix; each call returns what it changed (for ``on_applied``)."""

    def snapshot(
        self, kvs: Iterable[tuple[str, bytes]], revision: int, created: Mapping[str, int] | None = None
    ) -> R_co:
        """Make the state equal to a full read of the prefix (``(key, value)`` pairs) at ``revision``;
        ``created``: each key's etcd create revision."""
        ...

    def apply(self, changes: Iterable[Change], revision: int) -> R_co:
        """Apply one watch response's changes, in order; ``revision`` is the revision after them."""
        ...


class Retry:
    """When to try etcd again (sans-IO: durations in, waits in seconds out).

    After a failure: ``initial_s``, doubling per failure in a row up to ``max_backoff_s`` (a successful
    full read starts over). After a watch etcd cancelled: no wait, unless watches keep being cancelled
    less than ``quick_s`` after they started; from the second such watch in a row the wait is
    ``initial_s * 2**n`` (``n``: watches in that row), capped by ``max_backoff_s``.
    """

    def __init__(self, max_backoff_s: float, *, initial_s: float = 0.1, quick_s: float = 1.0) -> None:
        self.max_backoff_s = max_backoff_s
        self.initial_s = initial_s
        self.quick_s = quick_s
        self._backoff = initial_s
        self._quick = 0  # watches cancelled right after they started, in a row

    def synced(self) -> None:
        """A full read succeeded: the next failure waits ``initial_s`` again."""
        self._backoff = self.initial_s

    def failed(self) -> float:
        """etcd failed: how long to wait before the next full read."""
        wait, self._backoff = self._backoff, min(self._backoff * 2, self.max_backoff_s)
        return wait

    def watch_ended(self, lasted_s: float) -> float:
        """A watch that lasted ``lasted_s`` was cancelled: how long to wait before resyncing (0: at once)."""
        self._quick = self._quick + 1 if lasted_s < self.quick_s else 0
        if self._quick > 1:
            return min(self.initial_s * 2.0**self._quick, self.max_backoff_s)
        return 0.0


class PrefixWatcher(Generic[R]):
    """Keeps ``core`` in step with every key under ``prefix`` (see the module docstring).

    ``timeout_s``: the deadline of one etcd call (the range read, the probe); ``probe_interval_s``: how
    often liveness is checked while watching (an outage is noticed within about that long);
    ``max_backoff_s``: the longest wait between reconnection attempts. ``on_applied(result)`` runs on the
    event loop after each snapshot and each applied batch, and must not block; an exception from it is
    logged and the watcher goes on. ``name`` names the task and the log lines.
    """

    def __init__(
        self,
        client: etcd3aio.Etcd3Client,
        prefix: str,
        core: WatchedCore[R],
        *,
        timeout_s: float,
        probe_interval_s: float = 1.0,
        max_backoff_s: float = 5.0,
        on_applied: Callable[[R], None] | None = None,
        name: str = "etcd-watch",
    ) -> None:
        self.prefix = prefix
        self.core = core
        self.name = name
        self._client = client
        self._timeout_s = timeout_s
        self._probe_interval_s = probe_interval_s
        self._retry = Retry(max_backoff_s)
        self._on_applied = on_applied
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self._revision = 0
        #: etcd answered the last call (the core reflects etcd now, give or take a watch delivery).
        self.connected = False
        self._syncs = self._outages = self._compactions = 0

    @property
    def revision(self) -> int:
        """The etcd revision of the last snapshot or batch handed to the core (0: none yet)."""
        return self._revision

    @property
    def synced(self) -> bool:
        """A full read has been applied at least once."""
        return self._synced.is_set()

    @property
    def counters(self) -> Mapping[str, int]:
        """For metrics: full reads applied (syncs), outages noticed (a connected watcher losing etcd),
        watches cancelled for compaction, and connected (0/1)."""
        return {
            "syncs": self._syncs,
            "outages": self._outages,
            "compactions": self._compactions,
            "connected": int(self.connected),
        }

    def start(self) -> None:
        """Start following etcd in the background (an etcd that is down is retried); needs a running loop."""
        if self._task is not None:
            raise RuntimeError(f"{self.name} already started")
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def wait_synced(self, timeout_s: float) -> bool:
        """Wait until the first full read has been applied; ``False`` after ``timeout_s`` seconds."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._synced.wait()
        except TimeoutError:
            return False
        return True

    async def aclose(self) -> None:
        """Stop following (the core keeps its state; the client stays open: it is the caller's)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.connected = False

    def _kv(self) -> etcd3aio.kv.KVService:
        if self._client.kv is None:
            raise RuntimeError("etcd client is not connected")
        return self._client.kv

    async def _run(self) -> None:
        while True:
            try:
                await self._resync()
                self._retry.synced()
                started = time.monotonic()
                await self._follow()
                # Cancelled by etcd (compaction): resync now, but never spin on a watch etcd keeps refusing.
                wait = self._retry.watch_ended(time.monotonic() - started)
                if wait > 0:
                    await asyncio.sleep(wait)
            except ETCD_ERRORS as exc:
                if self.connected:
                    self._outages += 1
                    log.warning(
                        "%s: etcd unreachable (%s): keeping the last known state",
                        self.name,
                        describe_error(exc),
                    )
                self.connected = False
                await asyncio.sleep(self._retry.failed())
            except Exception:
                log.exception("%s: following etcd failed; retrying", self.name)
                self.connected = False
                await asyncio.sleep(self._retry.failed())

    async def _resync(self) -> None:
        response = await self._kv().get(
            self.prefix, etcd3aio.prefix_range_end(self.prefix), timeout=self._timeout_s
        )
        kvs = [(kv.key.decode("utf-8", "replace"), bytes(kv.value)) for kv in response.kvs]
        created = {key: int(kv.create_revision) for (key, _), kv in zip(kvs, response.kvs, strict=True)}
        revision = int(response.header.revision)
        result = self.core.snapshot(kvs, revision, created)
        self._revision = revision
        self._syncs += 1
        if not self.connected:
            log.info("%s: etcd in sync at revision %d (%d keys)", self.name, revision, len(kvs))
        self.connected = True
        self._synced.set()
        self._notify(result)

    async def _follow(self) -> None:
        """Watch until a resync is needed (returns) or etcd is unreachable (raises)."""
        tasks = [asyncio.create_task(self._watch()), asyncio.create_task(self._probe())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            task.result()

    async def _watch(self) -> None:
        if self._client.watch is None:
            raise RuntimeError("etcd client is not connected")
        stream = self._client.watch.watch(
            self.prefix, etcd3aio.prefix_range_end(self.prefix), start_revision=self._revision + 1
        )
        async for response in stream:
            if response.canceled or response.compact_revision:
                self._compactions += int(response.compact_revision > 0)
                log.warning(
                    "%s: etcd watch cancelled (compacted at %d, %s): resyncing",
                    self.name,
                    response.compact_revision,
                    response.cancel_reason or "no reason given",
                )
                return
            if not response.events:
                continue
            changes = [
                Change(
                    event.kv.key.decode("utf-8", "replace"),
                    None if event.type == _DELETE else bytes(event.kv.value),
                    0 if event.type == _DELETE else int(event.kv.create_revision),
                )
                for event in response.events
            ]
            revision = int(response.header.revision)
            result = self.core.apply(changes, revision)
            self._revision = revision
            self._notify(result)

    async def _probe(self) -> None:
        """Raise as soon as etcd stops answering (the watch stream itself retries silently)."""
        while True:
            await asyncio.sleep(self._probe_interval_s)
            await self._kv().get(self.prefix, count_only=True, timeout=self._timeout_s, max_attempts=1)

    def _notify(self, result: R) -> None:
        if self._on_applied is None:
            return
        try:
            self._on_applied(result)
        except Exception:  # a callback bug must not stop the watcher
            log.exception("%s: on_applied callback failed", self.name)
