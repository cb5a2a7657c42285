"""Waiting for a condition in tests: poll it with a deadline, never a sleep standing in for it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def until(condition: Callable[[], bool], timeout_s: float) -> float:
    """Poll ``condition`` every 5 ms until true; the seconds it took (fails after ``timeout_s``)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.005)
    return time.monotonic() - started


def poll(probe: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.01) -> T:
    """Call ``probe`` (blocking code) until it returns a value, not ``None``; fail after ``timeout_s``
    seconds, naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout_s:g} s")
        time.sleep(interval_s)


async def poll_async(
    probe: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.01
) -> T:
    """:func:`poll` in a coroutine: ``probe`` runs on the event loop, which runs in between (the feeds,
    servers and clients the test started in-process); its first value that is not ``None``."""
    deadline = time.monotonic() + timeout_s
    while (value := probe()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout_s:g} s")
        await asyncio.sleep(interval_s)
    return value
