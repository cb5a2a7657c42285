"""Time to first token of one streamed chat completion, client side: what the slot benchmarks time.

Shared by :mod:`load.bench.slots` (requests straight to a llama-server) and :mod:`load.bench.slots_auto`
(requests through the gateway, with a model name and the conformance header).
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp


async def ttft(
    session: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, Any]],
    *,
    model: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[float, int]:
    """(TTFT in ms, the engine's ``timings.cache_n``) of one streamed chat completion (``model`` and
    ``headers``: for a request through the gateway)."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}
    if model is not None:
        body["model"] = model
    began = time.perf_counter()
    first: float | None = None
    cache_n = -1
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or [{}]
            if first is None and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter()
            if "timings" in chunk:
                cache_n = int(chunk["timings"].get("cache_n", -1))
    end = first if first is not None else time.perf_counter()
    return (end - began) * 1000, cache_n
