"""A scheduling profile: filters, weighted scorers and one picker, run in that order for one request.

The profile owns what plugins must not do themselves: it applies weights, clamps every score to [0, 1]
(missing or NaN: 0), stops early when a filter leaves nothing, and times each plugin when asked to
(``timed``: benches and debugging; the request path does not read the clocks). A typical cycle::

    state = CycleState(prefix_blocks=index.match(req.digests, req.now), cached_blocks=index.occupancy())
    result = profile.schedule(req, state, list(fleet), rng)
    if not result.endpoints: ...  # 503: result.rejected_by names the filter that removed the last one
    index.record(result.endpoints[0].id, req.digests, req.now)
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat

from contracts.errors import ConfigError
from contracts.events import EndpointId
from extproc.fleet import EndpointState
from extproc.index.interface import PrefixIndex
from extproc.scheduling.interface import (
    Candidates,
    CycleState,
    Filter,
    Picker,
    SchedulingRequest,
    Scorer,
)


@dataclass(frozen=True, slots=True)
class ScheduleResult:
    """The outcome of one scheduling cycle.

    ``endpoints``: the pick first, then fallbacks; empty when no candidate survived the filters.
    ``rejected_by``: the filter that removed the last candidate (``None`` if there were none to start
    with, or if something was picked). ``scores``: weighted total per candidate that passed the filters.
    ``scorer_scores``: each scorer's clamped, unweighted scores (only when the profile explains).
    ``timings_ns``: nanoseconds per plugin (only when the profile is ``timed``).
    """

    endpoints: tuple[EndpointState, ...]
    scores: Mapping[EndpointId, float] = field(default_factory=dict)
    scorer_scores: Mapping[str, Mapping[EndpointId, float]] = field(default_factory=dict)
    timings_ns: Mapping[str, int] = field(default_factory=dict)
    rejected_by: str | None = None

    @property
    def pick(self) -> EndpointState | None:
        """The chosen endpoint, or ``None`` (the caller answers 503)."""
        return self.endpoints[0] if self.endpoints else None


def cycle_state(index: PrefixIndex, request: SchedulingRequest) -> CycleState:
    """The per-cycle data the plugins read, computed once from the prefix index."""
    return CycleState(
        prefix_blocks=index.match(request.digests, request.now), cached_blocks=index.occupancy()
    )


_ScoreList = Callable[[SchedulingRequest, CycleState, Candidates], "list[float] | None"]
_PickList = Callable[[Sequence[EndpointState], Sequence[float], random.Random], list[EndpointState]]


def _weighted_sum(weighed: Sequence[tuple[Sequence[float], float]], n: int) -> list[float]:
    """Per candidate, ``0.0 + w1 * v1 + w2 * v2 + ...`` over the scorers in order (each ``values`` parallel
    to the ``n`` candidates, in [0, 1]), added left to right as one scorer at a time would: the same floats.
    Three scorers per pass (one list comprehension each), not one pass per scorer. ``0.0 + w * v`` is
    ``w * v`` (both >= 0), so the first pass starts from the first product."""
    totals: list[float] | None = None
    for start in range(0, len(weighed), 3):
        chunk = weighed[start : start + 3]
        if len(chunk) == 3:
            (a, wa), (b, wb), (c, wc) = chunk
            if totals is None:
                totals = [x * wa + y * wb + z * wc for x, y, z in zip(a, b, c, strict=True)]
            else:
                totals = [t + x * wa + y * wb + z * wc for t, x, y, z in zip(totals, a, b, c, strict=True)]
        elif len(chunk) == 2:
            (a, wa), (b, wb) = chunk
            if totals is None:
                totals = [x * wa + y * wb for x, y in zip(a, b, strict=True)]
            else:
                totals = [t + x * wa + y * wb for t, x, y in zip(totals, a, b, strict=True)]
        else:
            ((a, wa),) = chunk
            if totals is None:
                totals = [x * wa for x in a]
            else:
                totals = [t + x * wa for t, x in zip(totals, a, strict=True)]
    return [0.0] * n if totals is None else totals


def _by_load(state: EndpointState) -> float:
    return state.load


def _clamp(value: float) -> float:
    if value >= 1.0:
        return 1.0
    if value >= 0.0:
        return value
    return 0.0  # negative or NaN


class Profile:
    """One named composition of plugins.

    ``scorers`` pairs each scorer with its weight (finite, >= 0; a weight of 0 skips the scorer). Plugin
    names must be distinct: they key the timings and per-scorer scores. ``max_fallbacks`` caps the
    fallbacks kept after the pick (``None``: whatever the picker returns). ``timed`` times each plugin
    with ``clock`` (nanoseconds) into :attr:`ScheduleResult.timings_ns`; ``explain`` also keeps each
    scorer's clamped scores in the result. Both are for benches and debugging, off on the request path:
    a cycle at 64 endpoints costs ~0.1 ms, and reading the clock twice per plugin is a few µs of it.
    """

    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
        *,
        max_fallbacks: int | None = None,
        clock: Callable[[], int] = time.perf_counter_ns,
        timed: bool = False,
        explain: bool = False,
    ) -> None:
        names = [f.name for f in filters] + [s.name for s, _ in scorers] + [picker.name]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"profile {name!r}: plugin names used twice: {', '.join(duplicates)}")
        for scorer, weight in scorers:
            if not 0 <= weight < math.inf:
                raise ConfigError(f"profile {name!r}: weight of {scorer.name!r} must be finite and >= 0")
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple((s, float(w)) for s, w in scorers if w > 0)
        if max_fallbacks is not None and max_fallbacks < 0:
            raise ConfigError(f"profile {name!r}: max_fallbacks must be >= 0")
        self.picker = picker
        self._limit = None if max_fallbacks is None else 1 + max_fallbacks
        self._clock = clock
        self.timed = timed
        self.explain = explain
        #: Whether each filter is soft, looked up once (Filter's ``soft``).
        self._soft = tuple(bool(getattr(f, "soft", False)) for f in self.filters)
        #: Some plugin reads ``CycleState.predicted_ttft`` whatever the request (the router fills it).
        plugins = (*self.filters, *(s for s, _ in self.scorers))
        self.predicts = any(getattr(p, "needs_prediction", False) for p in plugins)
        #: Each scorer's ``score_list`` (``ListScorer``), looked up once; ``None``: it has only ``score``.
        self._score_lists: tuple[_ScoreList | None, ...] = tuple(
            getattr(s, "score_list", None) for s, _ in self.scorers
        )
        #: The picker's ``pick_list`` (``ListPicker``), or ``None``: it has only ``pick``.
        self._pick_list: _PickList | None = getattr(picker, "pick_list", None)

    def schedule(
        self,
        request: SchedulingRequest,
        state: CycleState,
        candidates: Sequence[EndpointState],
        rng: random.Random,
    ) -> ScheduleResult:
        """Filter, score and pick among ``candidates`` for ``request``; never raises for lack of endpoints."""
        if not candidates:
            return ScheduleResult(())
        clock = self._clock
        timings: dict[str, int] | None = {} if self.timed else None
        started = 0
        current = Candidates(candidates)  # a copy: the caller's list is never handed to a plugin
        spare: list[EndpointState] = []  # dropped by a soft filter only: still fit to be a fallback
        for plugin, soft in zip(self.filters, self._soft, strict=True):
            if timings is not None:
                started = clock()
            kept = plugin.filter(request, state, current)
            # A filter that returned a Candidates (the built-in ones) kept its columns; a plain list: anew.
            narrowed = kept if isinstance(kept, Candidates) else Candidates(kept)
            if soft:
                if len(narrowed) < len(current):
                    passed = set(narrowed.ids)  # ids: read by the scorers next anyway
                    spare.extend(compress(current, [e not in passed for e in current.ids]))
            elif spare:
                spare = list(plugin.filter(request, state, spare))
            current = narrowed
            if timings is not None:
                timings[plugin.name] = clock() - started
            if not current:
                if not spare:
                    return ScheduleResult((), timings_ns=timings or {}, rejected_by=plugin.name)
                # A rule removed every endpoint a preference kept: the ones it passed over (the rule
                # applied to them too) are scheduled instead; a preference never makes a 503.
                current, spare = Candidates(spare), []

        ids = current.ids
        weighed: list[tuple[Sequence[float], float]] = []  # each scorer's values in [0, 1], its weight
        per_scorer: dict[str, Mapping[EndpointId, float]] = {}
        for (scorer, weight), score_list in zip(self.scorers, self._score_lists, strict=True):
            if timings is not None:
                started = clock()
            if score_list is not None:
                # In [0, 1] and not NaN (``ListScorer``): used as they are, no clamp.
                values = score_list(request, state, current)
                if timings is not None:
                    timings[scorer.name] = clock() - started
                if values is not None:  # None: nothing scored, every candidate adds 0
                    weighed.append((values, weight))
                if self.explain:
                    per_scorer[scorer.name] = dict(zip(ids, values or repeat(0.0), strict=False))
                continue
            raw = scorer.score(request, state, current)
            if timings is not None:
                timings[scorer.name] = clock() - started
            if raw:  # nothing scored: every candidate adds 0
                # Clamped to [0, 1] (negatives and NaN count as 0), in the candidates' order. A scorer that
                # scored every candidate, in their order (the usual: a dict built by walking them), gives
                # its values in that order as they are, without a lookup per candidate.
                values_in = (
                    raw.values()
                    if len(raw) == len(ids) and list(raw) == ids
                    else map(raw.get, ids, repeat(0.0))
                )
                weighed.append(([(v if v < 1.0 else 1.0) if v > 0.0 else 0.0 for v in values_in], weight))
            if self.explain:
                per_scorer[scorer.name] = {endpoint: _clamp(raw.get(endpoint, 0.0)) for endpoint in ids}
        totals = _weighted_sum(weighed, len(ids))

        if timings is not None:
            started = clock()
        picker = self.picker
        if self._pick_list is not None:
            ordered = self._pick_list(current, totals, rng)
        else:
            ordered = picker.pick(list(zip(current, totals, strict=True)), rng)
        if spare and (self._limit is None or len(ordered) < self._limit):
            # A retry on an endpoint a preference filter passed over beats no retry at all.
            ordered = [*ordered, *sorted(spare, key=_by_load)]
        if timings is not None:
            timings[picker.name] = clock() - started
        scores = dict(zip(ids, totals, strict=True))
        return ScheduleResult(tuple(ordered[: self._limit]), scores, per_scorer, timings or {})
