"""agent.autosave: which slots finished (SlotWatch, pure) and the saver's queue, one save at a time, counts
and errors (with a stand-in slot cache; the real llama-server flow is in test_slot_chain.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from agent.autosave import SlotAutoSaver, SlotWatch
from agent.errors import EngineError
from agent.slots import SaveOutcome


def idle(sid: int, task: int | None = None, cached: int | None = None) -> dict[str, Any]:
    slot: dict[str, Any] = {"id": sid, "n_ctx": 2048, "is_processing": False}
    if task is not None:
        slot |= {"id_task": task, "n_prompt_tokens": 2000 if cached is None else cached}
    return slot


def busy(sid: int, task: int) -> dict[str, Any]:
    return {"id": sid, "is_processing": True, "id_task": task, "n_prompt_tokens": 10}


@pytest.mark.parametrize(
    ("readings", "expected"),
    [
        ([[idle(0), idle(1)]], [[]]),  # a fresh engine: nothing ran yet
        ([[busy(0, 3)], [busy(0, 3)], [idle(0, 3)], [idle(0, 3)]], [[], [], [0], []]),  # finished once
        ([[idle(0, 3)], [idle(0, 3)]], [[0], []]),  # a task that came and went before the first look
        ([[idle(0, 3)], [idle(0, 5)]], [[0], [0]]),  # another task between two looks
        ([[idle(0, 3), idle(1, 4)], [idle(0, 3), busy(1, 6)]], [[0, 1], []]),
        ([[idle(0, 3, cached=100)], [idle(0, 4, cached=900)]], [[], [0]]),  # under min_tokens: skipped
        ([[busy(0, 1)], [idle(0)]], [[], [0]]),  # a build without id_task when idle: busy -> idle
        ([[{"id": "x", "is_processing": False}, {"id": True, "is_processing": True}]], [[]]),  # junk
    ],
)
def test_watch(readings: list[list[dict[str, Any]]], expected: list[list[int]]) -> None:
    watch = SlotWatch(min_tokens=512)
    assert [watch.finished(r) for r in readings] == expected


def test_watch_counts_short_slots_and_forgets_on_reset() -> None:
    watch = SlotWatch(min_tokens=512)
    assert watch.finished([idle(0, 7, cached=20)]) == [] and watch.skipped_short == 1
    assert watch.finished([idle(0, 8)]) == [0]
    watch.reset()
    assert watch.finished([idle(0, 8)]) == [0]  # a restarted engine's task ids start again


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            if condition():
                return
            await asyncio.sleep(0.01)  # poll interval of the condition, not a stand-in for it


class FakeCache:
    """The slot cache's ``slots`` and ``save_slot``; saves wait for ``release`` and are recorded."""

    def __init__(self) -> None:
        self.readings: list[list[dict[str, Any]]] = []
        self.saves: list[int] = []
        self.running = 0
        self.most = 0
        self.release = asyncio.Event()
        self.fail_slots: set[int] = set()

    async def slots(self) -> list[dict[str, Any]]:
        if not self.readings:
            raise EngineError("e", "/slots: HTTP 503")
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]

    async def save_slot(self, slot: int, model: str, *, min_tokens: int = 0) -> SaveOutcome:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await self.release.wait()
            if slot in self.fail_slots:
                raise EngineError("e", f"/slots/{slot}: HTTP 500")
            self.saves.append(slot)
            return SaveOutcome("stored" if slot else "held", 2000, 125, 124, 1000)
        finally:
            self.running -= 1


async def test_saver_saves_one_at_a_time_and_counts() -> None:
    cache = FakeCache()
    saver = SlotAutoSaver("e", "m", lambda: cache, 512)  # type: ignore[arg-type,return-value]
    try:
        saver.observe([idle(0, 1), idle(1, 2), idle(2, 3, cached=10)])
        saver.observe([idle(0, 1), idle(1, 2), idle(2, 3, cached=10)])  # nothing new: nothing queued twice
        cache.fail_slots = {1}
        await asyncio.sleep(0)  # let the worker start (it then waits on release)
        cache.release.set()
        await saver.idle()
        assert cache.saves == [0] and cache.most == 1
        stats = saver.as_dict()
        assert (stats["held"], stats["errors"], stats["stored"], stats["skipped_short_slots"]) == (1, 1, 0, 1)
        saver.observe([idle(0, 1), idle(1, 9)])
        await saver.idle()
        assert cache.saves == [0] and saver.stats.errors == 2
        cache.fail_slots = set()
        saver.observe([idle(1, 10)])
        await saver.idle()
        assert saver.stats.stored == 1 and saver.stats.markers == 124 and saver.stats.stored_bytes == 1000
    finally:
        await saver.aclose()


async def test_saver_polls_slots_itself() -> None:
    cache = FakeCache()
    cache.release.set()
    saver = SlotAutoSaver("e", "m", lambda: cache, 512, poll_s=0.01)  # type: ignore[arg-type,return-value]
    try:
        saver.poll()
        await until(lambda: saver.stats.poll_errors > 0)  # /slots fails until the engine answers
        cache.readings = [[busy(0, 4)], [idle(0, 4)]]
        await until(lambda: bool(cache.saves))
        assert cache.saves == [0]
    finally:
        await saver.aclose()
