"""What engines export for routing: one scrape's load signals, the names of the series they come from (each
kind's are on its :class:`~engines.kind.EngineKind`; :func:`engines.kinds.metric_names`), and a fast parser.

The parser reads only the few series routing needs (REFERENCE.md section 4) and sums them over label
sets (an engine serving several models reports one series per model), except the KV cache use gauge: a
fraction per engine core (vLLM with ``--data-parallel-size`` reports one per ``engine`` label, SGLang one
per DP rank), so its series are averaged, each read as a percentage when above 1. It is a line scan, not a
full exposition-format parser: the gateway's scrape loop and the agent's telemetry run it every 100 ms per
engine, and the gateway's CPU is its ceiling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

MAX_METRICS_BYTES = 16 * 1024 * 1024
"""The largest ``/metrics`` answer read, by the gateway's scrapes and the agent's telemetry alike (a busy
vLLM's is ~100 KiB); a longer one is a failed reading (:func:`runtime.httpbody.read_body`)."""


@dataclass(frozen=True, slots=True)
class LoraState:
    """An engine's LoRA adapters as its metrics tell them.

    vLLM (``vllm:lora_requests_info``, labels ``running_lora_adapters``, ``waiting_lora_adapters``,
    ``max_lora``; the series with the latest value, a wall-clock timestamp, wins): ``running`` and
    ``waiting`` name the adapters of running and of waiting requests, ``max_lora`` the adapter slots
    (vLLM's ``--max-loras``). The gauge names adapters in use, not every adapter held in a slot
    (REFERENCE.md section 7): a recent-use signal. SGLang (``sglang:lora_pool_slots_used`` /
    ``_total``) names no adapter: only ``slots_used`` and ``max_lora`` are set.
    """

    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_lora: int | None = None
    slots_used: int | None = None

    @property
    def active(self) -> frozenset[str]:
        """Adapters with requests (running or waiting)."""
        return self.running | self.waiting

    @property
    def free_slots(self) -> int | None:
        """Adapter slots no adapter in use holds (``None``: unknown)."""
        if self.max_lora is None:
            return None
        used = self.slots_used if self.slots_used is not None else len(self.active)
        return max(0, self.max_lora - used)


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
    #: LoRA adapters (``None``: the engine exports no LoRA metric, or serves none).
    lora: LoraState | None = None


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
    #: vLLM's LoRA info gauge (its labels are read).
    lora_info: str | None = None
    #: SGLang's LoRA pool gauges: slots used and slots in all.
    lora_slots: tuple[str, str] | None = None


def parse_metrics(text: str, names: MetricNames, at: float) -> EngineMetrics:
    """Sum each wanted series over its label sets (KV use: their mean); missing waiting/running read as 0,
    kv and TTFT as ``None``; the LoRA series as :class:`LoraState` (``None`` without them)."""
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
    if names.lora_slots is not None:
        wanted[names.lora_slots[0]] = 8
        wanted[names.lora_slots[1]] = 9
    lora_info = names.lora_info
    lora: LoraState | None = None
    lora_at = -math.inf
    sums = [0.0] * 10
    seen = [False] * 10
    kv_series = 0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        end = brace if brace >= 0 else line.find(" ")
        if lora_info is not None and brace >= 0 and line[:end] == lora_info:
            found = _lora_info(line, brace)
            if found is not None and found[0] >= lora_at:
                lora_at, lora = found
            continue
        slot = wanted.get(line[:end])
        if slot is None:
            continue
        rest = line[line.rfind("}") + 1 :] if brace >= 0 else line[end:]
        try:
            value = float(rest.split()[0])  # `name{labels} value [timestamp]`
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            if slot == 2:  # a fraction per engine core: averaged, not summed (module docstring)
                kv_series += 1
                if value > 1.0:  # some engines export a percentage
                    value /= 100.0
            sums[slot] += value
            seen[slot] = True
    kv = sums[2] / kv_series if seen[2] else None
    ttft = seen[3] and seen[4]
    if seen[8] and seen[9]:
        slots = LoraState(max_lora=int(sums[9]), slots_used=int(sums[8]))
        lora = slots if lora is None else replace(lora, slots_used=slots.slots_used)
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
        lora=lora,
    )


def _lora_info(line: str, brace: int) -> tuple[float, LoraState] | None:
    """A ``vllm:lora_requests_info{...} value`` line: (value, state); ``None`` when malformed."""
    close = line.rfind("}")
    if close < brace:
        return None
    try:
        value = float(line[close + 1 :].split()[0])
    except (IndexError, ValueError):
        return None
    labels: dict[str, str] = {}
    body = line[brace + 1 : close]
    i = 0
    while body[i:].strip(" ,"):  # name="value" pairs; values here hold no escaped quotes (adapter names)
        eq = body.find("=", i)
        if eq < 0 or eq + 1 >= len(body) or body[eq + 1] != '"':
            return None
        stop = body.find('"', eq + 2)
        if stop < 0:
            return None
        labels[body[i:eq].strip().lstrip(",").strip()] = body[eq + 2 : stop]
        i = stop + 1
    try:
        max_lora = int(labels["max_lora"]) if labels.get("max_lora") else None
    except ValueError:
        max_lora = None
    return value, LoraState(
        running=_names(labels.get("running_lora_adapters", "")),
        waiting=_names(labels.get("waiting_lora_adapters", "")),
        max_lora=max_lora,
    )


def _names(joined: str) -> frozenset[str]:
    """Comma-separated adapter names (blanks dropped)."""
    return frozenset(n.strip() for n in joined.split(",") if n.strip())
