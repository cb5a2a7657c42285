"""Automatic llama.cpp slot saves into kvcached: a slot that finished a long request is saved, untouched by
any client call.

- :class:`SlotWatch` (sans IO) reads llama-server's ``GET /slots`` and says which slots finished a task
  since it last looked: an idle slot (``is_processing`` false) whose ``id_task`` differs from the last
  one handled for it (a task that came and went between two looks still counts), or, for builds that
  report no ``id_task``, a slot seen busy and now idle. A slot whose ``n_prompt_tokens`` (the tokens it
  caches, as llama-server reports them when idle) is below ``min_tokens`` is skipped without saving.
- :class:`SlotAutoSaver` (shell) feeds the watch: from the agent's telemetry poll, which already reads
  ``/slots`` of llama.cpp engines every 0.1 s (:class:`agent.telemetry.EngineScraper`, ``on_slots``), or
  from its own poll every ``poll_s`` (0.2 s) when the engine's metrics are off. Finished slots queue up and
  one worker task per engine saves them one at a time (:meth:`agent.slots.SlotCache.save_slot`: the
  tokens are read from the saved file itself; nothing is put below ``min_tokens`` tokens, for an
  unreadable token list, or when kvcached already holds the chain's last digest). The telemetry poll is
  never blocked by a save. Failures are logged (engine, slot and reason; never tokens) and counted
  (:class:`AutoSaveStats`, in the agent's ``GET /status``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.errors import AgentError
from agent.slots import SaveOutcome, SlotCache

log = logging.getLogger(__name__)

POLL_S = 0.2
"""Own ``/slots`` poll period (s) when no telemetry poll reads it."""


class SlotWatch:
    """Which slots finished a task since the last look (module docstring); ``min_tokens`` >= 0."""

    def __init__(self, min_tokens: int) -> None:
        self.min_tokens = min_tokens
        self._handled: dict[int, object] = {}  # slot id -> id_task last handled
        self._busy: set[int] = set()
        #: Finished slots skipped because they cached fewer than ``min_tokens`` tokens.
        self.skipped_short = 0

    def finished(self, slots: Sequence[Mapping[str, Any]]) -> list[int]:
        """The ids of the slots to save now, in the order given."""
        out: list[int] = []
        for slot in slots:
            sid = slot.get("id")
            if not isinstance(sid, int) or isinstance(sid, bool):
                continue
            processing = slot.get("is_processing")
            if processing is True:
                self._busy.add(sid)
                continue
            if processing is not False:
                continue
            was_busy = sid in self._busy
            self._busy.discard(sid)
            task = slot.get("id_task")
            new = was_busy if task is None else self._handled.get(sid) != task
            if not new:
                continue
            self._handled[sid] = task
            cached = slot.get("n_prompt_tokens")
            if isinstance(cached, int) and cached < self.min_tokens:
                self.skipped_short += 1
                continue
            out.append(sid)
        return out

    def reset(self) -> None:
        """Forget everything (the engine restarted: its slots and task ids start again)."""
        self._handled.clear()
        self._busy.clear()


@dataclass(slots=True)
class AutoSaveStats:
    """Counts of one engine's automatic saves: by :class:`~agent.slots.SaveOutcome` (``stored``, ``held``,
    ``short``, ``unreadable``), ``errors`` (engine or kvcached failed), ``poll_errors`` (own ``/slots``
    poll failed), and ``stored_bytes``/``markers`` put."""

    stored: int = 0
    held: int = 0
    short: int = 0
    unreadable: int = 0
    errors: int = 0
    poll_errors: int = 0
    stored_bytes: int = 0
    markers: int = 0


class SlotAutoSaver:
    """Saves one llama-server's finished slots into kvcached (module docstring).

    ``cache``: a callable giving the engine's current :class:`~agent.slots.SlotCache` (``None`` while it
    has no launch); ``model``: the served model name (the digest chain's seed).
    """

    def __init__(
        self,
        engine_id: str,
        model: str,
        cache: Callable[[], SlotCache | None],
        min_tokens: int,
        *,
        poll_s: float = POLL_S,
    ) -> None:
        if min_tokens < 0 or poll_s <= 0:
            raise ValueError("min_tokens must be >= 0 and poll_s > 0")
        self.engine_id, self.model, self._cache = engine_id, model, cache
        self.min_tokens, self.poll_s = min_tokens, poll_s
        self.watch = SlotWatch(min_tokens)
        self.stats = AutoSaveStats()
        self._queue: list[int] = []
        self._worker: asyncio.Task[None] | None = None
        self._poller: asyncio.Task[None] | None = None

    def observe(self, slots: Sequence[Mapping[str, Any]]) -> None:
        """A fresh ``/slots`` reading: queue the finished slots and make sure the worker runs. Never
        blocks (callable from the telemetry poll)."""
        for sid in self.watch.finished(slots):
            if sid not in self._queue:
                self._queue.append(sid)
        if self._queue and (self._worker is None or self._worker.done()):
            self._worker = asyncio.create_task(self._drain(), name=f"slot-autosave-{self.engine_id}")

    def poll(self) -> None:
        """Poll ``/slots`` every ``poll_s`` seconds (for an engine no telemetry poll reads)."""
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll(), name=f"slot-poll-{self.engine_id}")

    def reset(self) -> None:
        """The engine restarted: drop queued slots and what the watch remembers."""
        self._queue.clear()
        self.watch.reset()

    async def idle(self) -> None:
        """Wait until no save is queued or running (for tests and draining)."""
        while self._worker is not None and not self._worker.done():
            await asyncio.shield(self._worker)

    async def aclose(self) -> None:
        """Stop polling and saving (a save in progress is cancelled: its file is removed, nothing put
        after the cancellation)."""
        for task in (self._poller, self._worker):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._poller = self._worker = None

    def as_dict(self) -> dict[str, int]:
        """Counters for ``GET /status``."""
        out = dataclasses.asdict(self.stats)
        out["skipped_short_slots"] = self.watch.skipped_short
        return out

    async def _drain(self) -> None:
        while self._queue:
            await self._save(self._queue.pop(0))

    async def _save(self, slot: int) -> None:
        cache = self._cache()
        if cache is None:
            return
        try:
            outcome = await cache.save_slot(slot, self.model, min_tokens=self.min_tokens)
        except AgentError as exc:
            self.stats.errors += 1
            log.warning("engine %s slot %d: auto-save failed: %s", self.engine_id, slot, exc)
            return
        except Exception:  # a bug must not end auto-save for this engine
            self.stats.errors += 1
            log.exception("engine %s slot %d: auto-save failed", self.engine_id, slot)
            return
        self._count(outcome)
        if outcome.outcome == "stored":
            log.info("engine %s slot %d: saved %d tokens (%d blocks, %d markers, %d bytes) into kvcached",
                     self.engine_id, slot, outcome.tokens, outcome.blocks, outcome.markers,
                     outcome.file_bytes)  # fmt: skip
        elif outcome.outcome == "unreadable":
            log.warning("engine %s slot %d: saved file has no readable token list; not stored",
                        self.engine_id, slot)  # fmt: skip

    def _count(self, outcome: SaveOutcome) -> None:
        s = self.stats
        if outcome.outcome == "stored":
            s.stored += 1
            s.stored_bytes += outcome.file_bytes
            s.markers += outcome.markers
        elif outcome.outcome == "held":
            s.held += 1
        elif outcome.outcome == "short":
            s.short += 1
        else:
            s.unreadable += 1

    async def _poll(self) -> None:
        failing = False
        while True:
            cache = self._cache()
            if cache is not None:
                try:
                    self.observe(await cache.slots())
                    failing = False
                except AgentError as exc:
                    self.stats.poll_errors += 1
                    if not failing:
                        log.warning("engine %s: /slots unreadable (%s); auto-save waits", self.engine_id, exc)
                    failing = True
            await asyncio.sleep(self.poll_s)
