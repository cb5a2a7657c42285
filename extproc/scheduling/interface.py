"""The scheduling plugin interfaces: the only place they are declared.

A scheduling cycle takes one request and the candidate endpoints and runs, in order:

1. data producers, done once by the caller: the prefix index lookup fills :class:`CycleState`;
2. filters, each narrowing the candidate list (a filter never empties it on its own: see each filter);
3. scorers, each returning a score in [0, 1] per candidate (missing data scores 0, scorers never raise);
4. the profile multiplies scores by their weights and sums them;
5. the picker turns the totals into an ordered list: the pick first, then fallbacks.

Plugins are pure: no IO, no clock reads (``now`` lives in the request), no mutation of endpoint state.

The profile hands plugins the candidates as a :class:`Candidates`: a list (what :class:`Filter` and
:class:`Scorer` take, so any plugin written against them works unchanged) that also keeps per-cycle
columns (ids, loads, waiting), computed on first read and shared by every plugin of the cycle. A scorer
may also offer :meth:`ListScorer.score_list` (parallel values instead of a dict); the profile then calls
that instead of ``score``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Protocol

from contracts.digest import Digest
from contracts.events import EndpointId
from extproc.fleet import EndpointState, loads_of


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


class Candidates(list[EndpointState]):
    """The candidates of one cycle, with per-cycle columns read by several plugins.

    A plain list of :class:`EndpointState` to whatever iterates it; ``ids``, ``loads`` and ``waiting`` are
    parallel lists (one entry per candidate, in order) computed on their first read and kept for the rest
    of the cycle, so ``load`` (a property of a few attribute reads) is computed once per candidate and
    cycle, not once per plugin that reads it. Endpoint state does not change during a cycle (plugins are
    pure, the router's updates come after it), so the columns stay true for the list they were computed
    for. Read-only: a plugin never mutates it (a filter returns a new list, :meth:`select` or the same
    object), or the columns would no longer match.
    """

    __slots__ = ("_ids", "_loads", "_waiting")

    def __init__(self, states: Iterable[EndpointState] = ()) -> None:
        super().__init__(states)
        self._ids: list[EndpointId] | None = None
        self._loads: list[float] | None = None
        self._waiting: list[float] | None = None

    @classmethod
    def of(cls, candidates: Sequence[EndpointState]) -> Candidates:
        """``candidates`` itself if it is one (its columns kept), else a new one with the same states."""
        return candidates if isinstance(candidates, Candidates) else cls(candidates)

    @property
    def ids(self) -> list[EndpointId]:
        """Each candidate's ``endpoint.id``."""
        ids = self._ids
        if ids is None:
            ids = self._ids = [c.endpoint.id for c in self]
        return ids

    @property
    def loads(self) -> list[float]:
        """Each candidate's :attr:`EndpointState.load`."""
        loads = self._loads
        if loads is None:
            loads = self._loads = loads_of(self)
        return loads

    @property
    def waiting(self) -> list[float]:
        """Each candidate's ``metrics.waiting``; NaN without metrics (so it is never over a limit and is
        left out of means and scores, as a candidate without metrics is)."""
        waiting = self._waiting
        if waiting is None:
            nan = math.nan
            waiting = self._waiting = [nan if (m := c.metrics) is None else m.waiting for c in self]
        return waiting

    def select(self, keep: Sequence[bool]) -> Candidates:
        """The candidates whose flag in ``keep`` (parallel to them) is true, with the columns computed so
        far."""
        out = Candidates(compress(self, keep))
        if self._ids is not None:
            out._ids = list(compress(self._ids, keep))
        if self._loads is not None:
            out._loads = list(compress(self._loads, keep))
        if self._waiting is not None:
            out._waiting = list(compress(self._waiting, keep))
        return out


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


class ListScorer(Scorer, Protocol):
    """A scorer that can also give its scores as a list parallel to ``candidates``; the profile calls
    :meth:`score_list` instead of ``score`` when a scorer has it (the built-in ones do).

    ``score_list`` returns one value per candidate, in order, each already in [0, 1] and not NaN (the
    profile adds them as they are, without clamping: a candidate ``score`` leaves out is 0.0 here), or
    ``None`` when ``score`` would return ``{}`` (nothing scored: every candidate adds 0). Its values must
    equal ``score``'s clamped to [0, 1], missing ones 0.
    """

    def score_list(
        self, request: SchedulingRequest, state: CycleState, candidates: Candidates
    ) -> list[float] | None: ...


class Picker(Protocol):
    """Orders scored candidates: the pick first, then up to ``max_fallbacks`` fallbacks."""

    name: str

    def pick(
        self, scored: Sequence[tuple[EndpointState, float]], rng: random.Random
    ) -> list[EndpointState]: ...


class ListPicker(Picker, Protocol):
    """A picker that can also take the scores as a list parallel to the candidates; the profile calls
    :meth:`pick_list` instead of ``pick`` when a picker has it (the built-in one does). It must return
    what ``pick(list(zip(candidates, scores)), rng)`` would, drawing the same numbers from ``rng``."""

    def pick_list(
        self, candidates: Sequence[EndpointState], scores: Sequence[float], rng: random.Random
    ) -> list[EndpointState]: ...
