"""Scorers: each rates every candidate in [0, 1], higher is better (formulas in README.md).

Scorers never raise and never see weights: missing or non-finite data scores 0, and the profile applies
each scorer's weight and clamps whatever comes back to [0, 1].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat

from contracts.events import EndpointId
from extproc.fleet import EndpointState
from extproc.index.interface import DEFAULT_MAX_MATCH_BLOCKS
from extproc.scheduling.interface import Candidates, CycleState, SchedulingRequest


def lower_is_better(values: Mapping[EndpointId, float], saturation: float) -> dict[EndpointId, float]:
    """``1 - v / max(saturation, max_v)``: 1 for an idle endpoint, falling linearly with load.

    ``saturation`` fixes the scale while the fleet is lightly loaded, so one extra queued request costs
    ``1/saturation`` of the score instead of the whole of it (plain min-max normalisation would turn a
    one-request difference into a full swing and drag a hot prefix off its owner). Once some endpoint is
    past ``saturation``, the scale grows with it and relative load still ranks the candidates.
    Endpoints absent from ``values`` (or with a non-finite value) are left out (score 0).
    """
    return _lower_is_better(list(values), list(values.values()), saturation)


def _lower_is_better(
    ids: Sequence[EndpointId], values: Sequence[float], saturation: float
) -> dict[EndpointId, float]:
    """:func:`lower_is_better` of ``dict(zip(ids, values))`` (``ids`` distinct), from two parallel lists:
    :func:`_lower_is_better_list`'s scores keyed by id, the non-finite (missing) values left out."""
    scores = _lower_is_better_list(values, saturation)
    if scores is None:
        return {}
    isfinite = math.isfinite
    if all(map(isfinite, values)):
        return dict(zip(ids, scores, strict=True))
    return {e: s for e, s, v in zip(ids, scores, values, strict=True) if isfinite(v)}


def _lower_is_better_list(values: Sequence[float], saturation: float) -> list[float] | None:
    """The formula of :func:`lower_is_better` as a list parallel to ``values`` (``ListScorer.score_list``):
    the scale from the finite values only, a non-finite value (missing) scoring 0.0; ``None`` when none is
    finite (nothing to score)."""
    isfinite = math.isfinite
    if all(map(isfinite, values)):
        if not values:
            return None
        most = max(values)
        scale = saturation if saturation >= most else most
        if scale <= 0:
            return [1.0] * len(values)
        return [1.0 - (v if v > 0.0 else 0.0) / scale for v in values]
    kept = list(filter(isfinite, values))
    if not kept:
        return None
    most = max(kept)
    scale = saturation if saturation >= most else most
    if scale <= 0:
        return [1.0 if isfinite(v) else 0.0 for v in values]
    return [1.0 - (v if v > 0.0 else 0.0) / scale if isfinite(v) else 0.0 for v in values]


def _as_dict(candidates: Candidates, values: list[float] | None) -> dict[EndpointId, float]:
    """A ``score_list`` result as ``score`` returns it: ``{}`` for ``None``."""
    return {} if values is None else dict(zip(candidates.ids, values, strict=True))


@dataclass(frozen=True, slots=True)
class LoadParams:
    """``saturation``: the load (requests) at which an endpoint scores 0 while no endpoint exceeds it."""

    saturation: float = 8.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.saturation) and self.saturation > 0):
            raise ValueError(f"saturation must be a finite number > 0, got {self.saturation!r}")


@dataclass(frozen=True, slots=True)
class PrefixParams:
    """``max_blocks``: the most leading blocks the index matches (its ``max_match_blocks``), so a prompt
    longer than that still scores 1 on a full match."""

    max_blocks: int = DEFAULT_MAX_MATCH_BLOCKS

    def __post_init__(self) -> None:
        if self.max_blocks <= 0:
            raise ValueError(f"max_blocks must be > 0, got {self.max_blocks!r}")


class PrefixScorer:
    """Share of the request's blocks already cached as a leading prefix on the endpoint.

    ``min(matched, t) / t`` with ``t = min(total, max_blocks)``, where ``matched`` is
    ``state.prefix_blocks[endpoint]`` and ``total`` the prompt's full blocks as the router counts them
    for scoring (``SchedulingRequest.blocks``: an estimate unless a lead covers the whole window, README.md);
    0 when the prompt has no full block.
    """

    __slots__ = ("name", "params")

    def __init__(self, name: str = "prefix", params: PrefixParams | None = None) -> None:
        self.name = name
        self.params = params or PrefixParams()

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> dict[EndpointId, float]:
        cands = Candidates.of(candidates)
        return _as_dict(cands, self.score_list(request, state, cands))

    def score_list(
        self, request: SchedulingRequest, state: CycleState, candidates: Candidates
    ) -> list[float] | None:
        total = min(request.blocks, self.params.max_blocks)
        if total <= 0:
            return None
        # min(max(n, 0), total) / total without the builtin calls
        return [
            (total if n >= total else n if n > 0 else 0) / total
            for n in map(state.prefix_blocks.get, candidates.ids, repeat(0))
        ]


class QueueScorer:
    """Fewer queued requests is better: ``1 - waiting / max(saturation, max waiting)`` (see
    :func:`lower_is_better`) over candidates with metrics. No metrics (or a non-finite value): 0.
    """

    __slots__ = ("name", "params")

    def __init__(self, name: str = "queue", params: LoadParams | None = None) -> None:
        self.name = name
        self.params = params or LoadParams()

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> dict[EndpointId, float]:
        ids: list[EndpointId] = []
        values: list[float] = []
        for c in candidates:
            metrics = c.metrics
            if metrics is not None:
                ids.append(c.endpoint.id)
                values.append(metrics.waiting)
        return _lower_is_better(ids, values, self.params.saturation)  # drops the non-finite ones

    def score_list(
        self, request: SchedulingRequest, state: CycleState, candidates: Candidates
    ) -> list[float] | None:
        # ``waiting`` is NaN without metrics: non-finite, so 0.0 and out of the maximum, as in ``score``.
        return _lower_is_better_list(candidates.waiting, self.params.saturation)


class KVUtilizationScorer:
    """Free KV cache is better: ``1 - kv_usage``, clamped to [0, 1]; no metrics or no ``kv_usage``: 0."""

    __slots__ = ("name",)

    def __init__(self, name: str = "kv-utilization") -> None:
        self.name = name

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> dict[EndpointId, float]:
        out: dict[EndpointId, float] = {}
        for c in candidates:
            metrics = c.metrics
            if metrics is not None and metrics.kv_usage is not None and math.isfinite(metrics.kv_usage):
                out[c.id] = min(1.0, max(0.0, 1.0 - metrics.kv_usage))
        return out


class InFlightScorer:
    """Fewer requests at the engine is better: ``1 - n / max(saturation, max n)``.

    ``n`` is :attr:`EndpointState.load`: the engine's ``running + waiting`` at the last scrape plus the
    requests this gateway routed there since, so it reacts within one request instead of one scrape
    interval, and works (on open streams) for engines that export no metrics.
    """

    __slots__ = ("name", "params")

    def __init__(self, name: str = "in-flight", params: LoadParams | None = None) -> None:
        self.name = name
        self.params = params or LoadParams()

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> dict[EndpointId, float]:
        cands = Candidates.of(candidates)
        return _lower_is_better(cands.ids, cands.loads, self.params.saturation)

    def score_list(
        self, request: SchedulingRequest, state: CycleState, candidates: Candidates
    ) -> list[float] | None:
        return _lower_is_better_list(candidates.loads, self.params.saturation)


class CacheSpreadScorer:
    """Emptier caches are better: ``1 - cached / max_cached`` over candidates; all zero: 1.

    ``cached`` is ``state.cached_blocks[endpoint]`` (absent: 0). A cold prefix has no prefix score
    anywhere, so without this it would land wherever load ties happen to break, and a burst of new prefixes
    can pile onto one replica; this steers new prefixes to the replicas holding the least.
    """

    __slots__ = ("name",)

    def __init__(self, name: str = "cache-spread") -> None:
        self.name = name

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> dict[EndpointId, float]:
        cands = Candidates.of(candidates)
        return _as_dict(cands, self.score_list(request, state, cands))

    def score_list(
        self, request: SchedulingRequest, state: CycleState, candidates: Candidates
    ) -> list[float] | None:
        cached = [n if n > 0 else 0 for n in map(state.cached_blocks.get, candidates.ids, repeat(0))]
        most = max(cached, default=0)
        if most <= 0:
            return [1.0] * len(cached)
        return [1.0 - n / most for n in cached]


@dataclass(frozen=True, slots=True)
class TierParams:
    """Worth of a block that must be fetched, relative to one on the endpoint's GPU (1): ``local`` from
    the endpoint's own node's kvcached (RAM or SSD), ``peer`` from another node's over QUIC."""

    local: float = 0.5
    peer: float = 0.25

    def __post_init__(self) -> None:
        if not 0 <= self.peer <= self.local <= 1:
            raise ValueError("need 0 <= peer <= local <= 1")


class TierScorer:
    """Blocks a prefix cache outside the GPU saves: below GPU-resident, above nothing.

    With ``n`` = the request's blocks (``SchedulingRequest.blocks``, as for ``prefix``), ``g`` =
    ``state.prefix_blocks`` (on the endpoint), ``w`` = ``state.warm_blocks`` (its node's kvcached) and
    ``p`` = ``state.peer_warm_blocks`` (any node's kvcached):
    ``(local * max(0, w - g) + peer * max(0, p - max(g, w))) / n``, in ``[0, local]``. No kvcached: 0.
    """

    __slots__ = ("name", "params")

    def __init__(self, name: str = "kv-tier", params: TierParams | None = None) -> None:
        self.name = name
        self.params = params or TierParams()

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> dict[EndpointId, float]:
        cands = Candidates.of(candidates)
        values = self.score_list(request, state, cands)
        return dict.fromkeys(cands.ids, 0.0) if values is None else _as_dict(cands, values)

    def score_list(
        self, request: SchedulingRequest, state: CycleState, candidates: Candidates
    ) -> list[float] | None:
        n = request.blocks
        peer_blocks = state.peer_warm_blocks
        if n == 0 or (peer_blocks <= 0 and not state.warm_blocks):
            return None  # 0 everywhere
        local, peer = self.params.local, self.params.peer
        gpu_get, warm_get = state.prefix_blocks.get, state.warm_blocks.get
        scores: list[float] = []
        for endpoint in candidates.ids:
            gpu = gpu_get(endpoint, 0)
            warm = warm_get(endpoint, 0)
            extra = local * max(0, warm - gpu) + peer * max(0, peer_blocks - max(gpu, warm))
            value = extra / n
            scores.append(1.0 if value >= 1.0 else value if value > 0.0 else 0.0)
        return scores


class PredictedTTFTScorer:
    """``best / predicted``: 1 for the candidate predicted to send the first token soonest
    (``state.predicted_ttft``, :mod:`extproc.scheduling.predict`: the prefill tokens queued ahead plus the
    request's own uncached tokens, over the endpoint's learned prefill rate), falling with its predicted
    TTFT. Candidates without a prediction score 0. A load scorer that weighs queued work in tokens, not
    requests, and knows the prefix match; opt-in (not in the default profile: README.md)."""

    __slots__ = ("name",)
    #: The router fills ``state.predicted_ttft`` for profiles with a plugin that sets this.
    needs_prediction = True

    def __init__(self, name: str = "ttft") -> None:
        self.name = name

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> dict[EndpointId, float]:
        predicted = state.predicted_ttft
        values = [predicted[c.id] for c in candidates if c.id in predicted]
        finite = [v for v in values if math.isfinite(v) and v >= 0.0]
        if not finite:
            return {}
        best = max(min(finite), 1e-6)
        return {
            c.id: best / max(v, 1e-6)
            for c in candidates
            if (v := predicted.get(c.id, math.inf)) >= 0.0 and math.isfinite(v)
        }
