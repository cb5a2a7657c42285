"""The drift alarm from an engine's prefix-cache counters (sans IO): for answers that carry no cached-token
count (streams; vLLM without ``--enable-prompt-tokens-details``).

vLLM counts, engine-wide, the prompt tokens it looked up in its prefix cache (``prefix_cache_queries``)
and those it found (``prefix_cache_hits``); the gateway scrapes both (:mod:`engines.metrics`). They cannot
be matched to one request, so rates are compared: between two readings of an endpoint, the engine's
``d_hits`` and ``d_queries`` against the prompt tokens this gateway routed there (``prompt``) and the ones
it predicted the engine held (``predicted``), each request in the interval of the first reading taken
after it was routed (a reading heard later holds none routed after it was taken). Over the last
``window`` intervals that saw traffic (README.md)::

    engine rate     = sum(d_hits) / sum(d_queries)
    predicted rate  = sum(predicted) / sum(prompt)
    ratio = engine rate / predicted rate        error = max(0, 1 - ratio)

Rates, not token sums: other gateways' requests reach the same engine, and a fraction holds where a
total does not. The trip rule is the one of :func:`~extproc.drift.monitor.verdict`, with the routed
requests that carried a prediction in the window as the sample count. A counter that went down (the
engine restarted) restarts the comparison.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from extproc.drift.monitor import COUNTERS, DriftPolicy, DriftView, Key, verdict

#: The model label of an endpoint that was routed requests of several models.
MIXED = "*"
#: Routed requests held per endpoint until a reading takes them; past it the oldest go uncompared (an
#: engine that exports no counters is never read; one that does is read at least every heartbeat).
MAX_PENDING = 1024


@dataclass(frozen=True, slots=True)
class Interval:
    """Between two readings: the engine's hits and queries, and what this gateway routed there."""

    hits: float
    queries: float
    predicted: int
    prompt: int
    requests: int
    at: float


@dataclass(slots=True)
class _Endpoint:
    model: str | None = None
    last: tuple[float, float] | None = None  # (hits, queries) at the previous reading
    at: float | None = None  # when the engine's previous reading was taken
    pending: deque[tuple[float, int, int]] = field(default_factory=deque)  # (routed at, predicted, prompt)
    observed: int = 0
    window: deque[Interval] = field(default_factory=deque)
    tripped: bool = False


class CounterDrift:
    """One comparison per endpoint; :meth:`reading` returns the view whose alarm changed."""

    def __init__(self, policy: DriftPolicy, published: dict[Key, DriftView]) -> None:
        self.policy = policy
        self.published = published
        self._endpoints: dict[str, _Endpoint] = {}

    def routed(self, endpoint: str, model: str, predicted: int, prompt: int, at: float) -> None:
        """This gateway routed a request there at ``at`` (the readings' clock): ``predicted`` of its
        ``prompt`` tokens held."""
        ep = self._endpoints.get(endpoint)
        if ep is None:
            ep = self._endpoints[endpoint] = _Endpoint()
        if ep.model is None:
            ep.model = model
        elif ep.model not in (model, MIXED):  # several models there: one alarm, labelled "*"
            self.published.pop((ep.model, endpoint, COUNTERS), None)
            ep.model = MIXED
        ep.observed += 1
        ep.pending.append((at, max(0, predicted), max(0, prompt)))
        if len(ep.pending) > MAX_PENDING:
            ep.pending.popleft()

    def reading(self, endpoint: str, hits: float, queries: float, at: float, now: float) -> DriftView | None:
        """The engine's counters, read at ``at`` (a reading already seen is skipped), against the requests
        routed there up to ``at``; the new view when its alarm tripped or cleared."""
        ep = self._endpoints.get(endpoint)
        if ep is None:
            ep = self._endpoints[endpoint] = _Endpoint()
        if ep.at == at:
            return None  # no new reading
        ep.at = at
        last, ep.last = ep.last, (hits, queries)
        predicted = prompt = requests = 0
        while ep.pending and ep.pending[0][0] <= at:  # routed before the reading: the engine may count it
            _, p, n = ep.pending.popleft()
            predicted, prompt, requests = predicted + p, prompt + n, requests + (p > 0)
        if last is None or hits < last[0] or queries < last[1]:  # first reading, or a restart
            return None  # (what was routed before it is in its counts, or lost with the old process)
        if ep.model is None:
            return None  # nothing routed there yet: nothing to compare
        interval = Interval(hits - last[0], queries - last[1], predicted, prompt, requests, now)
        if interval.queries <= 0 and interval.prompt <= 0:
            return None
        ep.window.append(interval)
        while len(ep.window) > self.policy.window:
            ep.window.popleft()
        was = ep.tripped
        view = self._view(endpoint, ep, now)
        return view if view.tripped != was else None

    def views(self, now: float) -> list[DriftView]:
        return [self._view(e, ep, now) for e, ep in sorted(self._endpoints.items()) if ep.model is not None]

    def forget(self, endpoint: str) -> None:
        ep = self._endpoints.pop(endpoint, None)
        if ep is not None and ep.model is not None:
            self.published.pop((ep.model, endpoint, COUNTERS), None)

    def _view(self, endpoint: str, ep: _Endpoint, now: float) -> DriftView:
        while ep.window and ep.window[0].at < now - self.policy.max_age_s:
            ep.window.popleft()
        w = ep.window
        hits, queries = sum(i.hits for i in w), sum(i.queries for i in w)
        predicted, prompt = sum(i.predicted for i in w), sum(i.prompt for i in w)
        samples = sum(i.requests for i in w)
        ratio = error = None
        if queries > 0 and predicted > 0 and prompt > 0:
            ratio = (hits / queries) / (predicted / prompt)
            error = max(0.0, 1.0 - ratio)
        ep.tripped = verdict(self.policy, ep.tripped, samples, error)
        assert ep.model is not None
        view = DriftView(ep.model, endpoint, samples, ratio, error, ep.tripped, ep.observed, COUNTERS)
        self.published[(ep.model, endpoint, COUNTERS)] = view
        return view
