"""LoRA adapter affinity: send a request for an adapter where the adapter is already in a GPU slot.

An engine serving LoRA adapters holds ``max_lora`` of them in GPU slots (vLLM ``--max-loras``; LRU
eviction); a request for an adapter that is not loaded first waits for a slot and pays the load. What
the gateway knows per endpoint (:class:`~extproc.fleet.EndpointState`):

- ``metrics.lora`` (:class:`~engines.metrics.LoraState`): the adapters of the engine's running and
  waiting requests and ``max_lora`` at the last reading (vLLM's ``vllm:lora_requests_info``, scraped or
  sent by the agent; a recent-use signal, not the slot table);
- ``lora_recent``: adapter -> when it was last known on the endpoint (in a reading, or routed there by
  this gateway); its ``max_lora`` most recent adapters stand for the slot table (vLLM's LRU).

Score of endpoint ``c`` for a request naming adapter ``A`` (README.md has the table); requests that name
no adapter any candidate knows (a base model) score nothing, so the scorer only matters for adapters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from contracts.events import EndpointId
from extproc.fleet import EndpointState
from extproc.scheduling.interface import Candidates, CycleState, SchedulingRequest


@dataclass(frozen=True, slots=True)
class LoraParams:
    """Scores of the cases between 1 (the adapter is active) and 0 (every slot busy with others):
    ``loaded`` the adapter is idle in a slot, ``free`` a slot is free, ``evict`` an idle adapter must
    make room, ``unknown`` the endpoint reports no slot count (not active nor recently there).
    ``unread_s``: with no reading of the endpoint (never scraped, or its metrics gone stale), an adapter
    known there (routed there, or in its last reading) this many seconds ago or less counts as loaded."""

    loaded: float = 0.8
    free: float = 0.5
    evict: float = 0.2
    unknown: float = 0.3
    unread_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("loaded", "free", "evict", "unknown"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise ValueError(f"{name} must be within [0, 1], got {value!r}")
        if not (math.isfinite(self.unread_s) and self.unread_s > 0.0):
            raise ValueError(f"unread_s must be a number of seconds above 0, got {self.unread_s!r}")


def lora_score(state: EndpointState, adapter: str, params: LoraParams, now: float) -> float:
    """The score of ``state`` for a request naming ``adapter`` at ``now`` (module docstring, README.md)."""
    metrics = state.metrics
    recent = state.lora_recent
    if metrics is None:  # no reading: nothing says what runs there, nor since when it was routed
        seen = recent.get(adapter)
        return params.loaded if seen is not None and now - seen <= params.unread_s else params.unknown
    lora = metrics.lora
    busy = set() if lora is None else set(lora.active)
    busy.update(a for a, at in recent.items() if at >= metrics.at)  # routed here since the reading
    if adapter in busy:
        return 1.0
    if lora is None or lora.max_lora is None or lora.max_lora <= 0:
        return params.loaded if adapter in recent else params.unknown
    max_lora = lora.max_lora
    slots = sorted(recent, key=recent.__getitem__, reverse=True)[:max_lora]  # LRU: the latest max_lora
    if adapter in slots:
        return params.loaded
    held = max(len(slots), len(busy), lora.slots_used or 0)
    if held < max_lora:
        return params.free
    if len(busy) < max_lora:
        return params.evict
    return 0.0


class LoraScorer:
    """Adapter affinity (module docstring): 1 active, ``loaded``, ``free``, ``evict``, 0 all slots busy."""

    __slots__ = ("name", "params")

    def __init__(self, name: str = "lora", params: LoraParams | None = None) -> None:
        self.name = name
        self.params = params or LoraParams()

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> dict[EndpointId, float]:
        cands = Candidates.of(candidates)
        values = self.score_list(request, state, cands)
        return {} if values is None else dict(zip(cands.ids, values, strict=True))

    def score_list(
        self, request: SchedulingRequest, state: CycleState, candidates: Candidates
    ) -> list[float] | None:
        adapter = request.model
        # Does any candidate know the adapter? Walked for every request, and most name a base model.
        for c in candidates:
            if adapter in c.endpoint.adapters or adapter in c.lora_recent:
                break
            metrics = c.metrics
            if metrics is not None and (lora := metrics.lora) is not None and adapter in lora.active:
                break
        else:
            return None  # a base model, or an adapter no endpoint has declared or reported
        params = self.params
        now = request.now
        return [lora_score(c, adapter, params, now) for c in candidates]
