"""The scheduling plugin interfaces: the only place they are declared.

A scheduling cycle takes one request and the candidate endpoints and runs, in order:

1. data producers, done once by the caller: the prefix index lookup fills :class:`CycleState`;
2. filters, each narrowing the candidate list (a filter never empties it on its own: see each filter);
3. scorers, each returning a score in [0, 1] per candidate (missing data scores 0, scorers never raise);
4. the profile multiplies scores by their weights and sums them;
5. the picker turns the totals into an ordered list: the pick first, then fallbacks.

Plugins are pure: no IO, no clock reads (``now`` lives in the request), no mutation of endpoint state.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from contracts.digest import Digest
from contracts.events import EndpointId
from extproc.fleet import EndpointState


@dataclass(frozen=True, slots=True)
class SchedulingRequest:
    """What the scheduler knows of a request.

    ``digests``: the chained block digests of the prompt (full blocks only). ``prompt_tokens``: the prompt
    length in tokens. ``subset``: the ``ip:port`` addresses the gateway allows (EPP subset hint), or
    ``None`` for no restriction. ``now``: monotonic seconds. ``ttft_budget_s``: seconds left of the
    request's TTFT deadline (flow control's), ``None`` without one. ``prompt_blocks``: the prompt's blocks
    as the ``prefix`` and ``kv-tier`` scorers divide by (the router's estimate, the same whether or not it
    tokenized the whole prompt: ``Router.scored_blocks``); ``None``: ``len(digests)`` (:attr:`blocks`).
    """

    request_id: str
    model: str
    digests: Sequence[Digest]
    prompt_tokens: int
    now: float
    subset: frozenset[str] | None = None
    objective: str | None = None
    fairness_id: str | None = None
    ttft_budget_s: float | None = None
    prompt_blocks: int | None = None

    @property
    def blocks(self) -> int:
        """The prompt's blocks the scorers divide by: ``prompt_blocks``, else ``len(digests)``."""
        return len(self.digests) if self.prompt_blocks is None else self.prompt_blocks


@dataclass(slots=True)
class CycleState:
    """Data computed once per cycle and read by plugins.

    ``prefix_blocks``: leading blocks of the request each endpoint holds (absent: 0).
    ``cached_blocks``: blocks each endpoint is known to hold in total (cache occupancy, absent: 0).
    ``warm_blocks``: leading blocks the endpoint's node's kvcached holds (a local fetch; absent: 0).
    ``peer_warm_blocks``: the longest lead any node's kvcached holds (a peer fetch; 0: none).
    ``exact``: every candidate's ``prefix_blocks`` comes from its engine's KV events (precise index), so a
    lead it lost to eviction is gone from the figures; ``False`` when any is the approximate index's guess.
    ``predicted_ttft``: seconds to the first token predicted per candidate (:mod:`extproc.scheduling.predict`;
    filled only when the request has a TTFT budget or the profile has a plugin that reads it).
    """

    prefix_blocks: Mapping[EndpointId, int] = field(default_factory=dict)
    cached_blocks: Mapping[EndpointId, int] = field(default_factory=dict)
    warm_blocks: Mapping[EndpointId, int] = field(default_factory=dict)
    peer_warm_blocks: int = 0
    exact: bool = False
    predicted_ttft: Mapping[EndpointId, float] = field(default_factory=dict)


class Filter(Protocol):
    """Narrows the candidates; returns a (possibly equal) sub-list, never raises.

    A filter whose class sets ``soft = True`` states a preference (load, balance), not a rule: what it
    drops is not picked, but stays fit to be a fallback after the picker's own (least loaded first), so
    a request the preferred endpoints fail can still be retried (:meth:`Profile.schedule`).
    """

    name: str

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]: ...


class Scorer(Protocol):
    """Scores each candidate in [0, 1] (higher is better); missing data scores 0."""

    name: str

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> dict[EndpointId, float]: ...


class Picker(Protocol):
    """Orders scored candidates: the pick first, then up to ``max_fallbacks`` fallbacks."""

    name: str

    def pick(
        self, scored: Sequence[tuple[EndpointState, float]], rng: random.Random
    ) -> list[EndpointState]: ...
