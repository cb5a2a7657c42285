"""TTFT prediction: how long an endpoint would take to send this request's first token (formulas in
README.md, "TTFT prediction").

Per endpoint ``e`` and request ``r``::

    ttft(e, r) = base_e + slope_e * (ahead_e + uncached(e, r))

``uncached(e, r)``: the request's prompt tokens beyond the blocks the prefix index says ``e`` holds.
``ahead_e``: prefill tokens queued at ``e`` before ``r``: the uncached tokens of this gateway's requests
routed to ``e`` whose predicted first token is still to come, or the engine's own waiting queue times the
mean uncached tokens of a request there, whichever is more. ``slope_e`` (seconds per prefill token) and
``base_e`` (seconds) are a least-squares line through the endpoint's observations, each weighted
``2 ** (-age / half_life)`` in observations. An observation is one window of at least
:data:`WINDOW_S` between two readings of the engine's time-to-first-token histogram (vLLM's and SGLang's
``*:time_to_first_token_seconds``, scraped with its load): ``y`` = the window's mean TTFT
(``delta sum / delta count``), ``x`` = the mean ``ahead + uncached`` of the requests this gateway routed
there during the window. (Envoy's time to first upstream byte is no TTFT: a streaming engine sends its
response headers before the prefill, a non-streaming one after the last token.) Until an endpoint has
observations spread enough to fit a slope, the slope is the prior's (:data:`PRIOR_TOKENS_PER_S`); until it
has any, the base is too.

Pure: ``now`` (monotonic seconds) is a parameter; no IO.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from contracts.events import EndpointId
from extproc.fleet import EndpointState

PRIOR_TOKENS_PER_S = 10_000.0
"""Prefill rate assumed before an endpoint's own observations fit one (an 8B model on one H100 does about
this much with chunked prefill; the fit replaces it)."""
PRIOR_BASE_S = 0.02
"""TTFT of an empty prompt on an idle endpoint assumed before any observation (scheduling + one step)."""
HALF_LIFE = 64.0
"""Observations after which one weighs half as much in the fit."""
CONFIDENT_AFTER = 6
"""Observations an endpoint needs before its prediction may shed a request
(:meth:`TTFTPredictor.confident`)."""
MIN_SPREAD_TOKENS = 64.0
"""Standard deviation of ``x`` (tokens) the observations need before their own slope replaces the
prior's."""
WINDOW_S = 0.5
"""Shortest span (s) of engine TTFT readings one observation covers: longer than a typical TTFT, so the
requests routed in a window and those whose first token it counted are mostly the same."""
MAX_PENDING = 65_536
"""Routed requests remembered until their completion, at most (the oldest are forgotten)."""
PENDING_TTL_S = 900.0
"""Seconds a routed request is remembered without a completion."""
_DECAY = math.pow(2.0, -1.0 / HALF_LIFE)


class Fit:
    """An exponentially weighted least-squares line ``y = base + slope * x`` (each new observation
    multiplies the weight of the earlier ones by ``2 ** (-1 / HALF_LIFE)``)."""

    __slots__ = ("count", "sw", "sx", "sxx", "sxy", "sy")

    def __init__(self) -> None:
        self.count = 0
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = _DECAY
        self.sw = self.sw * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y
        self.count += 1

    def own_slope(self) -> bool:
        """Whether :meth:`line`'s slope comes from the observations (at least 3, ``x`` spread at least
        :data:`MIN_SPREAD_TOKENS`, a rising fit) rather than the prior."""
        if self.count < 3:
            return False
        mean_x, mean_y = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mean_x * mean_x
        return var >= MIN_SPREAD_TOKENS * MIN_SPREAD_TOKENS and self.sxy / self.sw - mean_x * mean_y > 0.0

    def line(self, prior_slope: float, prior_base: float) -> tuple[float, float]:
        """``(slope, base)``: the fitted line when the observations' ``x`` spread at least
        :data:`MIN_SPREAD_TOKENS` (and the fit rises); else the prior slope through the observations'
        mean; with no observation, the prior. ``base`` is never below 0."""
        if self.count == 0:
            return prior_slope, prior_base
        mean_x, mean_y = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mean_x * mean_x
        slope = prior_slope
        if self.count >= 3 and var >= MIN_SPREAD_TOKENS * MIN_SPREAD_TOKENS:
            fitted = (self.sxy / self.sw - mean_x * mean_y) / var
            if fitted > 0.0:
                slope = fitted
        base = mean_y - slope * mean_x
        if base < 0.0:  # the prior slope overshoots: keep the line through the mean, from 0
            base = 0.0
            slope = mean_y / mean_x if mean_x > 0 else slope
        return slope, base


@dataclass(slots=True)
class _Routed:
    endpoint: EndpointId
    tokens: int
    first_token_at: float
    at: float
    #: Counted in its endpoint's :class:`_Ahead` sum (its first token not yet due at the last look).
    ahead: bool = False


@dataclass(slots=True)
class _Ahead:
    """An endpoint's routed requests whose predicted first token was still to come at ``seen`` (the latest
    ``now`` asked about): their uncached tokens summed, and a heap by first token to drop them as ``now``
    passes it (a request forgotten meanwhile is skipped when it comes up). So :meth:`TTFTPredictor.ahead`
    costs what fell due since the last call, not a walk over every request routed there and not yet
    completed. ``counted``: the heap's entries still counted in ``tokens``; once the forgotten ones
    outnumber them (completions long before their predicted first token: an overloaded engine's queue
    makes predictions long), the heap is rebuilt without them, so it stays within about twice the
    requests routed and not completed (:data:`MAX_PENDING`)."""

    tokens: int = 0
    seen: float = -math.inf
    heap: list[tuple[float, int, _Routed]] = field(default_factory=list)
    counted: int = 0

    def uncount(self, r: _Routed) -> None:
        """``r`` no longer counts (its first token fell due, or it was forgotten)."""
        r.ahead = False
        self.tokens -= r.tokens
        self.counted -= 1


@dataclass(slots=True)
class _Window:
    """An endpoint's TTFT histogram at the window's start, and the requests routed there since."""

    ttft_sum: float
    ttft_count: float
    at: float
    x_sum: float = 0.0
    predicted_sum: float = 0.0
    routed: int = 0


@dataclass(frozen=True, slots=True)
class Observation:
    """One window's mean predicted and observed engine TTFT (seconds) at ``endpoint``."""

    endpoint: EndpointId
    predicted_s: float
    observed_s: float


class TTFTPredictor:
    """Per-endpoint TTFT lines, learned from the requests this gateway routed (see the module docstring)."""

    def __init__(
        self, prior_tokens_per_s: float = PRIOR_TOKENS_PER_S, prior_base_s: float = PRIOR_BASE_S
    ) -> None:
        self._prior_slope = 1.0 / prior_tokens_per_s
        self._prior_base = prior_base_s
        self._fits: dict[EndpointId, Fit] = {}
        self._mean_tokens: dict[EndpointId, float] = {}
        self._routed: OrderedDict[str, _Routed] = OrderedDict()
        self._at: dict[EndpointId, dict[str, _Routed]] = {}
        self._ahead: dict[EndpointId, _Ahead] = {}
        self._order = itertools.count()  # heap ties: first tokens predicted for the same instant
        self._windows: dict[EndpointId, _Window] = {}
        #: Hears each observation (``None``: nobody; the gateway's metrics compare the two).
        self.listener: Callable[[Observation], None] | None = None

    def line(self, endpoint: EndpointId) -> tuple[float, float]:
        """``(slope s/token, base s)`` of ``endpoint`` now."""
        fit = self._fits.get(endpoint)
        if fit is None:
            return self._prior_slope, self._prior_base
        return fit.line(self._prior_slope, self._prior_base)

    def fitted_slope(self, endpoint: EndpointId) -> float | None:
        """``endpoint``'s slope (s/token) when its own observations fit it; ``None`` while it is the
        prior's."""
        fit = self._fits.get(endpoint)
        if fit is None or not fit.own_slope():
            return None
        return fit.line(self._prior_slope, self._prior_base)[0]

    def backlog(self, state: EndpointState, now: float, slope: float) -> float:
        """Prefill tokens still to compute at the endpoint before a request arriving ``now`` could start
        its own, draining at ``1 / slope`` tokens/s (a work-conserving queue): over this gateway's
        requests routed there and not yet completed, oldest first, ``W <- max(0, W - (at_r - at_prev) /
        slope) + uncached_r``, then ``W(now) = max(0, W - (now - at_last) / slope)``; or the engine's
        waiting requests (last reading) times their mean uncached tokens, whichever is more. Unlike
        :meth:`ahead`, a request whose prefill is done by ``now`` at that rate counts nothing, whatever
        its predicted first token; the engine's reading drains the same way from the time it was taken.
        ``slope <= 0``: nothing waits."""
        if slope <= 0.0:
            return 0.0
        work = 0.0
        routed = self._at.get(state.id)
        if routed:
            last: float | None = None
            for r in sorted(routed.values(), key=lambda r: r.at):
                if last is not None:
                    work = max(0.0, work - (r.at - last) / slope)
                work += r.tokens
                last = r.at
            if last is not None:
                work = max(0.0, work - (now - last) / slope)
        metrics = state.metrics
        if metrics is None or metrics.waiting <= 0:
            return work
        queued = metrics.waiting * self._mean_tokens.get(state.id, 0.0)
        return max(work, queued - max(0.0, now - metrics.at) / slope)

    def confident(self, endpoint: EndpointId) -> bool:
        """Whether ``endpoint``'s line rests on at least :data:`CONFIDENT_AFTER` observations."""
        fit = self._fits.get(endpoint)
        return fit is not None and fit.count >= CONFIDENT_AFTER

    def ahead(self, state: EndpointState, now: float) -> float:
        """Prefill tokens queued at the endpoint before a request arriving ``now``: the uncached tokens of
        this gateway's requests there whose predicted first token is after ``now``, or the engine's
        waiting requests (last reading) times their mean uncached tokens, whichever is more."""
        mine = 0
        pending = self._ahead.get(state.id)
        if pending is not None and now >= pending.seen:
            heap = pending.heap
            while heap and heap[0][0] <= now:  # due by now: no longer ahead
                r = heapq.heappop(heap)[2]
                if r.ahead:
                    pending.uncount(r)
            pending.seen = now
            mine = pending.tokens
        elif pending is not None:  # asked about an earlier instant: the requests routed there, one by one
            routed = self._at.get(state.id)
            for r in routed.values() if routed else ():
                if r.first_token_at > now:
                    mine += r.tokens
        metrics = state.metrics
        if metrics is None or metrics.waiting <= 0:
            return float(mine)
        return max(float(mine), metrics.waiting * self._mean_tokens.get(state.id, 0.0))

    def predict(self, state: EndpointState, uncached: int, now: float) -> float:
        """Predicted seconds from a decision at ``now`` to the first token at ``state`` for a request
        with ``uncached`` prompt tokens not held there."""
        self._learn(state)
        slope, base = self.line(state.id)
        return base + slope * (self.ahead(state, now) + uncached)

    def routed(self, request_id: str, state: EndpointState, uncached: int, now: float) -> float:
        """Remember that ``request_id`` went to ``state`` at ``now`` with ``uncached`` tokens to prefill
        (it counts as ahead of later requests until its predicted first token, and in the endpoint's
        current window); returns its predicted TTFT there."""
        self.forget(request_id)
        self._learn(state)
        x = self.ahead(state, now) + uncached
        slope, base = self.line(state.id)
        predicted = base + slope * x
        entry = _Routed(state.id, uncached, now + predicted, now)
        self._routed[request_id] = entry
        self._at.setdefault(state.id, {})[request_id] = entry
        pending = self._ahead.get(state.id)
        if pending is None:
            pending = self._ahead[state.id] = _Ahead()
        if entry.first_token_at > pending.seen:  # else already due: never counted
            entry.ahead = True
            pending.tokens += uncached
            pending.counted += 1
            heapq.heappush(pending.heap, (entry.first_token_at, next(self._order), entry))
        window = self._windows.get(state.id)
        if window is not None:
            window.x_sum += x
            window.predicted_sum += predicted
            window.routed += 1
        mean = self._mean_tokens.get(state.id)
        self._mean_tokens[state.id] = uncached if mean is None else mean + (uncached - mean) / HALF_LIFE
        self._trim(now)
        return predicted

    def moved(self, request_id: str, state: EndpointState, now: float) -> None:
        """Envoy sent ``request_id`` to ``state`` (a fallback) instead: it counts there from now on."""
        entry = self._routed.get(request_id)
        if entry is None or entry.endpoint == state.id:
            return
        self.forget(request_id)
        self.routed(request_id, state, entry.tokens, now)

    def _learn(self, state: EndpointState) -> None:
        """Close ``state``'s window if its latest TTFT reading is :data:`WINDOW_S` past the window's
        start: one observation when the engine counted first tokens and this gateway routed requests
        there meanwhile (a count that fell, an engine restart, starts afresh)."""
        metrics = state.metrics
        if metrics is None or metrics.ttft_sum is None or metrics.ttft_count is None:
            return
        window = self._windows.get(state.id)
        if window is not None:
            if metrics.at - window.at < WINDOW_S:
                return
            counted = metrics.ttft_count - window.ttft_count
            if counted > 0 and window.routed:
                observed = (metrics.ttft_sum - window.ttft_sum) / counted
                x = window.x_sum / window.routed
                fit = self._fits.get(state.id)
                if fit is None:
                    fit = self._fits[state.id] = Fit()
                fit.add(x, max(0.0, observed))
                if self.listener is not None:
                    self.listener(Observation(state.id, window.predicted_sum / window.routed, observed))
        self._windows[state.id] = _Window(metrics.ttft_sum, metrics.ttft_count, metrics.at)

    def forget(self, request_id: str) -> _Routed | None:
        """Drop ``request_id`` (its response failed, or it was observed); what was remembered of it."""
        entry = self._routed.pop(request_id, None)
        if entry is not None:
            at = self._at.get(entry.endpoint)
            if at is not None:
                at.pop(request_id, None)
            if entry.ahead:
                pending = self._ahead[entry.endpoint]
                pending.uncount(entry)
                heap = pending.heap
                if len(heap) > 2 * pending.counted + 64:  # mostly forgotten entries: drop them
                    heap[:] = [item for item in heap if item[2].ahead]
                    heapq.heapify(heap)
        return entry

    def retain(self, endpoints: Container[EndpointId]) -> None:
        """Forget every endpoint not in ``endpoints`` (it left the fleet): its line, window, mean and the
        requests routed there."""
        known = {*self._fits, *self._mean_tokens, *self._at, *self._ahead, *self._windows}
        for gone in [e for e in known if e not in endpoints]:
            self._fits.pop(gone, None)
            self._mean_tokens.pop(gone, None)
            self._windows.pop(gone, None)
            self._ahead.pop(gone, None)
            for request_id in self._at.pop(gone, {}):
                self._routed.pop(request_id, None)

    def __len__(self) -> int:
        """Routed requests remembered."""
        return len(self._routed)

    def _trim(self, now: float) -> None:
        routed = self._routed
        while routed:
            request_id, oldest = next(iter(routed.items()))
            if len(routed) <= MAX_PENDING and now - oldest.at <= PENDING_TTL_S:
                return
            self.forget(request_id)
