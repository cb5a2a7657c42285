"""Waiting for a condition in async tests: poll it with a deadline, never a sleep standing in for it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(condition: Callable[[], bool], timeout_s: float) -> float:
    """Poll ``condition`` every 5 ms until true; the seconds it took (fails after ``timeout_s``)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.005)
    return time.monotonic() - started
