"""What engines export for routing: one scrape's load signals, the names of the series they come from (each
kind's are on its :class:`~engines.kind.EngineKind`; :func:`engines.kinds.metric_names`), and a fast parser.

The parser reads only the few series routing needs (REFERENCE.md section 4) and sums them over label
sets (an engine serving several models reports one series per model). It is a line scan, not a full
exposition-format parser: the gateway's scrape loop and the agent's telemetry run it every 100 ms per
engine, and the gateway's CPU is its ceiling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One scrape of an engine's load signals.

    ``waiting``/``running``: requests queued / being decoded. ``kv_usage``: fraction 0..1 of KV cache in
    use, ``None`` where the engine does not export it. ``at``: monotonic seconds of the scrape.
    ``ttft_sum``/``ttft_count``: the engine's time-to-first-token histogram's cumulative sum (seconds) and
    count, ``None`` where it exports none (or the reading came from elsewhere than a scrape).
    ``generation_tokens``: the engine's counter of output tokens generated since it started (its rate is
    the output tokens/s an energy-per-token figure divides by), ``None`` where it exports none.
    ``prefix_hits``/``prefix_queries``: the engine's counters of prompt tokens served from its prefix cache
    and of prompt tokens looked up there (vLLM's), ``None`` where it exports none (the drift alarm,
    :mod:`extproc.drift`).
    """

    waiting: float
    running: float
    kv_usage: float | None
    at: float
    ttft_sum: float | None = None
    ttft_count: float | None = None
    generation_tokens: float | None = None
    prefix_hits: float | None = None
    prefix_queries: float | None = None


@dataclass(frozen=True, slots=True)
class MetricNames:
    """Series names of one engine kind's load: requests queued, requests running, the KV cache use
    gauge (``None`` where the engine has no such gauge), the time-to-first-token histogram's name
    (its ``_sum`` and ``_count`` series are read; ``None``: none), and the output-token counter's series
    (``None``: none)."""

    waiting: str
    running: str
    kv_usage: str | None
    ttft: str | None = None
    generation_tokens: str | None = None
    #: The prefix cache's counters: prompt tokens hit, prompt tokens queried (``None``: none).
    prefix_hits: str | None = None
    prefix_queries: str | None = None


def parse_metrics(text: str, names: MetricNames, at: float) -> EngineMetrics:
    """Sum each wanted series over its label sets; missing waiting/running read as 0, kv and TTFT as
    ``None``."""
    wanted = {names.waiting: 0, names.running: 1}
    if names.kv_usage is not None:
        wanted[names.kv_usage] = 2
    if names.ttft is not None:
        wanted[names.ttft + "_sum"] = 3
        wanted[names.ttft + "_count"] = 4
    if names.generation_tokens is not None:
        wanted[names.generation_tokens] = 5
    if names.prefix_hits is not None and names.prefix_queries is not None:
        wanted[names.prefix_hits] = 6
        wanted[names.prefix_queries] = 7
    sums = [0.0] * 8
    seen = [False] * 8
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        end = brace if brace >= 0 else line.find(" ")
        slot = wanted.get(line[:end])
        if slot is None:
            continue
        rest = line[line.rfind("}") + 1 :] if brace >= 0 else line[end:]
        try:
            value = float(rest.split()[0])  # `name{labels} value [timestamp]`
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            sums[slot] += value
            seen[slot] = True
    kv = sums[2] if seen[2] else None
    if kv is not None and kv > 1.0:  # some engines export a percentage
        kv = kv / 100.0
    ttft = seen[3] and seen[4]
    return EngineMetrics(
        waiting=sums[0],
        running=sums[1],
        kv_usage=kv,
        at=at,
        ttft_sum=sums[3] if ttft else None,
        ttft_count=sums[4] if ttft else None,
        generation_tokens=sums[5] if seen[5] else None,
        prefix_hits=sums[6] if seen[6] and seen[7] else None,
        prefix_queries=sums[7] if seen[6] and seen[7] else None,
    )
