"""The scheduling cycle's fast paths change no decision (issue 27).

:meth:`Profile.schedule` skips the clock unless ``timed``, adds scores in one pass and skips scorers that
scored nothing; ``power-cap`` skips a fleet with no readings and nothing latched; ``load-threshold`` reads
each candidate's load once and compares with precomputed limits; three scorers and
:attr:`EndpointState.load` were rewritten for speed. A second round (sched43) read ``endpoint.id`` (a
slot) instead of the ``id`` property, inlined ``load-threshold``'s test and ``lora``'s look for the
adapter, gave ``prefix``, ``queue``, ``in-flight`` and ``cache-spread`` one pass without builtin calls or
intermediate dicts, let the profile add a scorer's values in order when it scored every candidate in their
order, and the picker sort by the score itself when no score is NaN. A third round (sched44) handed the
plugins a :class:`Candidates` list with per-cycle columns (ids, loads, waiting computed once and shared),
let the built-in scorers return parallel lists (``score_list``) that the profile weighs three scorers per
pass, and the picker sort positions instead of pairs (``pick_list``); the same profile with every plugin
wrapped to hide those (a third-party plugin: dict scores, pairs, plain lists) must decide the same too.
Here the straightforward evaluation (the code as it was before those changes, plugin by plugin, picker
included) runs beside the profile on random fleets and states, and both must give the same ``endpoints``,
``scores`` and ``rejected_by``, exactly (same floats, same tie shuffles), cycle after cycle (``power-cap``
keeps a latch between cycles), on fresh fleets and on one fleet whose metrics, counts and index change
between decisions.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.digest import Digest
from contracts.events import EndpointId, Power
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics, LoraState
from extproc.fleet import EndpointState, Fleet, loads_of
from extproc.scheduling.filters import LoadThresholdFilter
from extproc.scheduling.interface import Candidates, CycleState, Filter, Picker, SchedulingRequest, Scorer
from extproc.scheduling.lora import LoraParams, LoraScorer, lora_score
from extproc.scheduling.picker import MaxScoreParams
from extproc.scheduling.power import PowerCapFilter
from extproc.scheduling.profile import Profile, ScheduleResult
from extproc.scheduling.registry import PLUGIN_TYPES, build_profile, parse_scheduling
from extproc.scheduling.scorers import (
    CacheSpreadScorer,
    InFlightScorer,
    LoadParams,
    PrefixParams,
    PrefixScorer,
    QueueScorer,
)

MODEL = "m"
ADAPTER = "a1"


# --- the straightforward evaluation --------------------------------------------------------------


def plain_load(c: EndpointState) -> float:
    metrics = c.metrics
    net = c.net_routed + c.sibling_routed
    if metrics is None:
        return float(max(c.in_flight + c.sibling_in_flight, net, 0))
    return float(max(0, metrics.running + metrics.waiting + net))


def plain_lower_is_better(values: Mapping[EndpointId, float], saturation: float) -> dict[EndpointId, float]:
    values = {endpoint: v for endpoint, v in values.items() if math.isfinite(v)}
    if not values:
        return {}
    scale = max(saturation, max(values.values()))
    if scale <= 0:
        return dict.fromkeys(values, 1.0)
    return {endpoint: 1.0 - max(0.0, v) / scale for endpoint, v in values.items()}


def plain_load_threshold(
    plugin: LoadThresholdFilter, state: CycleState, cands: Sequence[EndpointState]
) -> list[EndpointState]:
    p = plugin.params
    ratio = p.max_in_flight_ratio
    if ratio is not None and state.exact and p.exact_in_flight_ratio is not None:
        ratio = p.exact_in_flight_ratio
    mean = sum(plain_load(c) for c in cands) / len(cands) if cands else 0.0
    waiting = [c.metrics.waiting for c in cands if c.metrics is not None and math.isfinite(c.metrics.waiting)]
    mean_waiting = sum(waiting) / len(waiting) if waiting else 0.0

    def overloaded(c: EndpointState) -> bool:
        if p.max_in_flight is not None and plain_load(c) > p.max_in_flight:
            return True
        if ratio is not None and plain_load(c) > ratio * mean + p.in_flight_slack:
            return True
        m = c.metrics
        if m is None:
            return False
        if m.waiting > p.max_waiting and (
            p.max_waiting_ratio is None or m.waiting > p.max_waiting_ratio * mean_waiting + p.waiting_slack
        ):
            return True
        return p.max_kv_usage is not None and m.kv_usage is not None and m.kv_usage > p.max_kv_usage

    kept = [c for c in cands if not overloaded(c)]
    return kept or list(cands)


def plain_power_cap(plugin: PowerCapFilter, cands: Sequence[EndpointState]) -> list[EndpointState]:
    kept = [c for c in cands if not plugin.over(c)]  # every candidate asked, latch updated for each
    return kept or list(cands)


def plain_queue(cands: Sequence[EndpointState], saturation: float) -> dict[EndpointId, float]:
    waiting: dict[EndpointId, float] = {}
    for c in cands:
        if c.metrics is not None and math.isfinite(c.metrics.waiting):
            waiting[c.id] = c.metrics.waiting
    return plain_lower_is_better(waiting, saturation)


def plain_cache_spread(state: CycleState, cands: Sequence[EndpointState]) -> dict[EndpointId, float]:
    cached = {c.id: max(0, state.cached_blocks.get(c.id, 0)) for c in cands}
    most = max(cached.values(), default=0)
    if most <= 0:
        return dict.fromkeys(cached, 1.0)
    return {endpoint: 1.0 - n / most for endpoint, n in cached.items()}


def plain_prefix(
    request: SchedulingRequest, state: CycleState, cands: Sequence[EndpointState], max_blocks: int
) -> dict[EndpointId, float]:
    total = min(request.blocks, max_blocks)
    if total <= 0:
        return {}
    return {c.id: min(max(state.prefix_blocks.get(c.id, 0), 0), total) / total for c in cands}


def plain_knows(c: EndpointState, adapter: str) -> bool:
    if adapter in c.endpoint.adapters or adapter in c.lora_recent:
        return True
    lora = None if c.metrics is None else c.metrics.lora
    return lora is not None and adapter in lora.active


def plain_lora(
    request: SchedulingRequest, cands: Sequence[EndpointState], params: LoraParams
) -> dict[EndpointId, float]:
    if not any(plain_knows(c, request.model) for c in cands):
        return {}
    return {c.id: lora_score(c, request.model, params, request.now) for c in cands}


def plain_key(pair: tuple[EndpointState, float]) -> float:
    return pair[1] if pair[1] == pair[1] else -math.inf


def plain_pick(
    params: MaxScoreParams, scored: Sequence[tuple[EndpointState, float]], rng: random.Random
) -> list[EndpointState]:
    """MaxScorePicker.pick as it was: a key call per candidate, NaN sorting last."""
    limit = 1 + params.max_fallbacks
    order = sorted(scored, key=plain_key, reverse=True)
    out: list[EndpointState] = []
    seen: set[EndpointId] = set()
    i, n = 0, len(order)
    while i < n and len(out) < limit:
        best = plain_key(order[i])
        j = i + 1
        while j < n and best - plain_key(order[j]) <= params.epsilon:
            j += 1
        group = order[i:j]
        if len(group) > 1:
            rng.shuffle(group)
        for endpoint, _ in group:
            if endpoint.id not in seen and len(out) < limit:
                seen.add(endpoint.id)
                out.append(endpoint)
        i = j
    return out


def plain_schedule(
    profile: Profile,
    request: SchedulingRequest,
    state: CycleState,
    candidates: Sequence[EndpointState],
    rng: random.Random,
    limit: int | None,
) -> ScheduleResult:
    """Profile.schedule as it was: every plugin run, every score added candidate by candidate."""
    if not candidates:
        return ScheduleResult(())

    def run_filter(plugin: Any, cands: Sequence[EndpointState]) -> list[EndpointState]:
        if isinstance(plugin, LoadThresholdFilter):
            return plain_load_threshold(plugin, state, cands)
        if isinstance(plugin, PowerCapFilter):
            return plain_power_cap(plugin, cands)
        return list(plugin.filter(request, state, cands))

    current: Sequence[EndpointState] = candidates
    spare: list[EndpointState] = []
    for plugin in profile.filters:
        kept = run_filter(plugin, current)
        if getattr(plugin, "soft", False):
            passed = {c.id for c in kept}
            spare.extend(c for c in current if c.id not in passed)
        elif spare:
            spare = run_filter(plugin, spare)
        current = kept
        if not current and spare:  # a rule removed every preferred one: the passed-over ones instead
            current, spare = spare, []
        if not current:
            return ScheduleResult((), rejected_by=plugin.name)
    ids = [c.id for c in current]
    totals = [0.0] * len(ids)
    for scorer, weight in profile.scorers:
        kind = scorer.name
        raw: Mapping[EndpointId, float]
        if kind == "queue":
            raw = plain_queue(current, scorer.params.saturation)  # type: ignore[attr-defined]
        elif kind == "in-flight":
            raw = plain_lower_is_better({c.id: plain_load(c) for c in current}, scorer.params.saturation)  # type: ignore[attr-defined]
        elif kind == "cache-spread":
            raw = plain_cache_spread(state, current)
        elif kind == "prefix":
            raw = plain_prefix(request, state, current, scorer.params.max_blocks)  # type: ignore[attr-defined]
        elif kind == "lora":
            raw = plain_lora(request, current, scorer.params)  # type: ignore[attr-defined]
        else:
            raw = scorer.score(request, state, current)
        for i, endpoint in enumerate(ids):
            value = raw.get(endpoint, 0.0)
            if value > 0.0:
                totals[i] += weight * (value if value < 1.0 else 1.0)
    ordered = plain_pick(profile.picker.params, list(zip(current, totals, strict=True)), rng)  # type: ignore[attr-defined]
    if spare and (limit is None or len(ordered) < limit):
        ordered = [*ordered, *sorted(spare, key=plain_load)]
    return ScheduleResult(tuple(ordered[:limit]), dict(zip(ids, totals, strict=True)))


# --- third-party-style plugins: the Protocols only --------------------------------------------------


class PlainFilter:
    """A filter as a third party writes it: returns a plain list (no columns kept)."""

    def __init__(self, inner: Filter) -> None:
        self.inner, self.name = inner, inner.name
        self.soft = getattr(inner, "soft", False)

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        return list(self.inner.filter(request, state, list(candidates)))


class DictScorer:
    """A scorer with ``score`` only (no ``score_list``): the profile clamps and looks up its dict."""

    def __init__(self, inner: Scorer) -> None:
        self.inner, self.name = inner, inner.name

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> dict[EndpointId, float]:
        return self.inner.score(request, state, list(candidates))


class PairsPicker:
    """A picker with ``pick`` only (no ``pick_list``)."""

    def __init__(self, inner: Picker) -> None:
        self.inner, self.name = inner, inner.name

    def pick(self, scored: Sequence[tuple[EndpointState, float]], rng: random.Random) -> list[EndpointState]:
        return self.inner.pick(scored, rng)


def third_party(profile: Profile, limit: int | None) -> Profile:
    """``profile``'s plugins (the same instances: ``power-cap``'s latch is shared) behind the Protocols
    only."""
    return Profile(
        profile.name,
        [PlainFilter(f) for f in profile.filters],
        [(DictScorer(s), w) for s, w in profile.scorers],
        PairsPicker(profile.picker),
        max_fallbacks=None if limit is None else limit - 1,
    )


# --- random fleets and states ---------------------------------------------------------------------


def assert_same_cycle(
    fast: Profile,
    plain: Profile,
    request: SchedulingRequest,
    state: CycleState,
    candidates: Sequence[EndpointState],
    rng: random.Random,
    limit: int | None,
) -> None:
    """``fast.schedule`` and :func:`plain_schedule` on ``plain`` (the same config) with the same tie
    seed: the same endpoints in order, scores and rejections; the load fast path is the property's own
    formula."""
    tie_seed = rng.randrange(2**32)
    got = fast.schedule(request, state, candidates, random.Random(tie_seed))
    want = plain_schedule(plain, request, state, candidates, random.Random(tie_seed), limit)
    assert [s.id for s in got.endpoints] == [s.id for s in want.endpoints]
    assert got.scores == want.scores
    assert got.rejected_by == want.rejected_by
    for s in candidates:
        assert s.load == plain_load(s)
    assert loads_of(candidates) == [plain_load(s) for s in candidates]


def maybe(rng: random.Random, value: Callable[[], Any], p: float = 0.5) -> Any:
    return value() if rng.random() < p else None


def odd_float(rng: random.Random, high: float) -> float:
    """Mostly ordinary, sometimes a tie with 0, an integer, or not finite."""
    roll = rng.random()
    if roll < 0.05:
        return math.nan
    if roll < 0.08:
        return math.inf
    if roll < 0.25:
        return float(rng.randint(0, int(high)))
    return rng.uniform(0.0, high)


def make_state(rng: random.Random, i: int, now: float, wall: float) -> EndpointState:
    adapters = frozenset({ADAPTER}) if rng.random() < 0.3 else frozenset()
    endpoint = Endpoint(
        EndpointId(f"e{i}"), f"10.0.0.{i}:8000", frozenset({MODEL}) | adapters, adapters=adapters
    )
    s = EndpointState(endpoint)
    s.healthy = rng.random() < 0.9
    s.draining = rng.random() < 0.05
    s.ejected_until = now + 1.0 if rng.random() < 0.05 else 0.0
    s.in_flight = rng.randint(0, 6)
    s.routed_since_scrape = rng.randint(0, 6)
    s.completed_since_scrape = rng.randint(0, 6)
    s.sibling_in_flight = rng.randint(0, 2)
    s.sibling_routed = rng.randint(-2, 2)
    if rng.random() < 0.85:
        lora = maybe(
            rng,
            lambda: LoraState(
                running=frozenset({ADAPTER}) if rng.random() < 0.3 else frozenset(),
                max_lora=rng.randint(0, 3),
            ),
            0.2,
        )
        s.metrics = EngineMetrics(
            waiting=odd_float(rng, 20),
            running=odd_float(rng, 40),
            kv_usage=maybe(rng, lambda: rng.uniform(0.0, 1.0), 0.8),
            at=now - 0.1,
            lora=lora,
        )
    if rng.random() < 0.3:
        s.routed_decayed, s.routed_at = rng.uniform(0.0, 20.0), now - rng.uniform(0.0, 5.0)
    if rng.random() < 0.3:
        s.lora_recent = {ADAPTER: now - 1.0}
    if rng.random() < 0.4:
        s.power = tuple(
            Power(
                "gpu",
                "nvml",
                watts=rng.uniform(200.0, 420.0),
                limit_w=maybe(rng, lambda: 400.0, 0.8),
                temperature_c=rng.uniform(40.0, 90.0),
                throttled=rng.random() < 0.1,
                at=wall,
                error="" if rng.random() < 0.9 else "timeout",
            )
            for _ in range(rng.randint(1, 2))
        )
    return s


def random_config(rng: random.Random) -> Any:
    load_threshold = {
        "max_waiting": rng.choice([0.0, 2.0, 8.0]),
        "max_in_flight": rng.choice([None, 3, 10]),
        "max_in_flight_ratio": rng.choice([None, 1.0, 1.5]),
        "exact_in_flight_ratio": rng.choice([None, 1.0, 2.0]),
        "in_flight_slack": rng.choice([0.0, 2.0]),
        "max_waiting_ratio": rng.choice([None, 1.5]),
        "max_kv_usage": rng.choice([None, 0.5, 0.95]),
    }
    params: dict[str, dict[str, object]] = {
        "load-threshold": load_threshold,
        "power-cap": {"leave_margin": rng.choice([None, 0.1]), "max_temperature_c": rng.choice([None, 80.0])},
        "max-score": {"max_fallbacks": rng.randint(0, 4)},
    }
    order = ["model", "healthy", "subset", "slo", "power-cap", "load-threshold", "balance"]
    weights = {
        "prefix": 3.0,
        "queue": 2.0,
        "in-flight": 1.0,
        "cache-spread": 1.0,
        "kv-tier": 3.0,
        "lora": 4.0,
    }
    refs: list[dict[str, object]] = [{"ref": name} for name in order]
    refs += [{"ref": name, "weight": rng.choice([weight, 0.0, 1.0])} for name, weight in weights.items()]
    refs.append({"ref": "max-score"})
    return parse_scheduling(
        {
            "plugins": [{"type": t, **({"params": params[t]} if t in params else {})} for t in PLUGIN_TYPES],
            "profiles": [{"name": "p", "plugins": refs}],
        }
    )


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_profile_decides_as_the_straightforward_evaluation(seed: int) -> None:
    rng = random.Random(seed)
    config = random_config(rng)
    limit = rng.choice([None, 1, 3])
    max_fallbacks = None if limit is None else limit - 1
    fast, plain = (
        build_profile(config, max_fallbacks=max_fallbacks),
        build_profile(config, max_fallbacks=max_fallbacks),
    )
    if rng.random() < 0.3:  # the same plugins behind the Protocols only, as a third party writes them
        fast = third_party(fast, limit)
    n = rng.randint(1, 12)
    now, wall = 100.0, 1.8e9
    for cycle in range(3):  # power-cap's latch carries over
        now, wall = now + 1.0, wall + rng.choice([0.0, 1.0])
        fleet = [make_state(rng, i, now, wall) for i in range(n)]
        digests = [Digest(bytes([b]) * 16) for b in range(rng.randint(0, 20))]
        ids = [s.id for s in fleet]
        state = CycleState(
            prefix_blocks={e: rng.randint(0, len(digests)) for e in ids if rng.random() < 0.5},
            cached_blocks={e: rng.randint(-1, 50) for e in ids if rng.random() < 0.7},
            warm_blocks={e: rng.randint(0, 20) for e in ids if rng.random() < 0.2},
            peer_warm_blocks=rng.choice([0, 0, 5]),
            exact=rng.random() < 0.5,
            predicted_ttft={e: rng.uniform(0.0, 2.0) for e in ids if rng.random() < 0.5},
        )
        addresses = [s.endpoint.address for s in fleet]
        subset = frozenset(a for a in addresses if rng.random() < 0.7) if rng.random() < 0.2 else None
        request = SchedulingRequest(
            request_id=f"r{cycle}",
            model=rng.choice([MODEL, ADAPTER]),
            digests=digests,
            prompt_tokens=16 * len(digests),
            now=now,
            subset=subset,
            ttft_budget_s=maybe(rng, lambda: rng.uniform(0.0, 2.0), 0.3),
        )
        assert_same_cycle(fast, plain, request, state, fleet, rng, limit)


def random_cycle_state(rng: random.Random, ids: Sequence[EndpointId], blocks: int) -> CycleState:
    return CycleState(
        prefix_blocks={e: rng.randint(-1, 2 * blocks + 1) for e in ids if rng.random() < 0.5},
        cached_blocks={e: rng.randint(-1, 50) for e in ids if rng.random() < 0.7},
        warm_blocks={e: rng.randint(0, 20) for e in ids if rng.random() < 0.2},
        peer_warm_blocks=rng.choice([0, 0, 5]),
        exact=rng.random() < 0.5,
        predicted_ttft={e: rng.uniform(0.0, 2.0) for e in ids if rng.random() < 0.5},
    )


def change(rng: random.Random, fleet: Fleet, now: float, wall: float) -> None:
    """What happens to a fleet between two decisions: scrapes (some lost, some stale), routed and
    completed requests, siblings' counts, health, drains, ejections, adapters seen, power readings, a
    changed static description."""
    for i, s in enumerate(list(fleet)):
        roll = rng.random()
        if roll < 0.3:
            fresh = make_state(rng, i, now, wall)
            routed_before = rng.choice([None, 0, s.routed_since_scrape])
            fleet.record_scrape(
                s.id,
                fresh.metrics or EngineMetrics(waiting=0.0, running=0.0, kv_usage=None, at=now),
                routed_before,
            )
            if rng.random() < 0.3:
                fleet.record_power(s.id, fresh.power, now)
        elif roll < 0.4:
            fleet.record_scrape_failure(s.id, unhealthy_after=1, gone=rng.random() < 0.5)
        elif roll < 0.45:
            fleet.upsert(make_state(rng, i, now, wall).endpoint)
        if rng.random() < 0.5:
            s.in_flight = max(0, s.in_flight + rng.randint(-2, 3))
            s.routed_since_scrape += rng.randint(0, 3)
            s.completed_since_scrape += rng.randint(0, 2)
            s.count_routed(now, rng.choice([1.0, -1.0]))
        if rng.random() < 0.2:
            s.sibling_in_flight, s.sibling_routed = rng.randint(0, 3), rng.randint(-3, 3)
        if rng.random() < 0.1:
            fleet.set_state(s.id, healthy=rng.random() < 0.8, draining=rng.random() < 0.1)
        if rng.random() < 0.05:
            fleet.eject(s.id, now + rng.uniform(0.0, 2.0))
        if rng.random() < 0.1:
            s.saw_adapter(ADAPTER, now)
    fleet.expire_metrics(now, stale_after=rng.choice([0.05, 10.0]))


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_one_fleet_changing_between_decisions_decides_as_the_straightforward_evaluation(seed: int) -> None:
    """The same fleet over several decisions (up to 64 endpoints), its state changed between them as the
    feeds, scrapes and router change it: whatever a cycle reads, it reads the state as it is now."""
    rng = random.Random(seed)
    config = random_config(rng)
    limit = rng.choice([None, 1, 3])
    max_fallbacks = None if limit is None else limit - 1
    fast = build_profile(config, max_fallbacks=max_fallbacks)
    plain = build_profile(config, max_fallbacks=max_fallbacks)
    if rng.random() < 0.3:  # the same plugins behind the Protocols only, as a third party writes them
        fast = third_party(fast, limit)
    n = rng.choice([1, 2, 4, 16, 64])
    now, wall = 100.0, 1.8e9
    fleet = Fleet()
    for i in range(n):
        made = make_state(rng, i, now, wall)
        s = fleet.upsert(made.endpoint)
        for name in (
            "healthy",
            "in_flight",
            "routed_since_scrape",
            "completed_since_scrape",
            "metrics",
            "routed_decayed",
            "routed_at",
            "sibling_in_flight",
            "sibling_routed",
            "power",
            "lora_recent",
        ):
            setattr(s, name, getattr(made, name))
    for cycle in range(6):
        now, wall = now + rng.choice([0.01, 1.0]), wall + rng.choice([0.0, 1.0])
        if cycle:
            change(rng, fleet, now, wall)
        states = list(fleet)
        digests = [Digest(bytes([b]) * 16) for b in range(rng.randint(0, 20))]
        prompt_blocks = rng.choice([None, 0, len(digests), rng.randint(0, 300)])
        state = random_cycle_state(rng, [s.id for s in states], prompt_blocks or len(digests))
        request = SchedulingRequest(
            request_id=f"r{cycle}",
            model=rng.choice([MODEL, MODEL, ADAPTER]),
            digests=digests,
            prompt_tokens=16 * len(digests),
            now=now,
            ttft_budget_s=maybe(rng, lambda: rng.uniform(0.0, 2.0), 0.3),
            prompt_blocks=prompt_blocks,
        )
        assert_same_cycle(fast, plain, request, state, states, rng, limit)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_picker_orders_as_it_did(seed: int) -> None:
    """MaxScorePicker sorts by the score itself unless a score is NaN: the same order, ties and shuffles
    as the key function that sends NaN last, with NaN, infinities and ties in the scores."""
    rng = random.Random(seed)
    params = MaxScoreParams(max_fallbacks=rng.randint(0, 5), epsilon=rng.choice([0.0, 1e-9, 0.1]))
    picker = PLUGIN_TYPES["max-score"].factory("max-score", params)
    n = rng.randint(0, 20)
    values = [0.0, 1.0, 0.5, 3.0, math.nan, math.inf, -math.inf, 0.1 + 0.2, 0.3]
    scored = [
        (make_state(rng, i, 0.0, 0.0), rng.choice(values) if rng.random() < 0.5 else rng.uniform(0.0, 3.0))
        for i in range(n)
    ]
    tie_seed = rng.randrange(2**32)
    got = picker.pick(scored, random.Random(tie_seed))  # type: ignore[attr-defined]
    want = plain_pick(params, scored, random.Random(tie_seed))
    assert [s.id for s in got] == [s.id for s in want]
    states, scores = [c for c, _ in scored], [score for _, score in scored]
    listed = picker.pick_list(states, scores, random.Random(tie_seed))  # type: ignore[attr-defined]
    assert [s.id for s in listed] == [s.id for s in want]


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_each_rewritten_scorer_scores_as_it_did(seed: int) -> None:
    """The rewritten scorers alone, on unfiltered candidates (no model filter before ``lora``, so an
    adapter only some endpoint has seen or runs counts too): the same dict, keys in the same order."""
    rng = random.Random(seed)
    now = 100.0
    fleet = [make_state(rng, i, now, 1.8e9) for i in range(rng.choice([0, 1, 2, 4, 16, 64]))]
    for s in fleet:
        if rng.random() < 0.5:  # the adapter known only from readings or routing, or not at all
            s.endpoint = Endpoint(s.id, s.endpoint.address, frozenset({MODEL}))
    digests = [Digest(bytes([b]) * 16) for b in range(rng.randint(0, 20))]
    prompt_blocks = rng.choice([None, 0, len(digests), rng.randint(0, 300)])
    state = random_cycle_state(rng, [s.id for s in fleet], prompt_blocks or len(digests))
    request = SchedulingRequest(
        "r", rng.choice([MODEL, ADAPTER]), digests, 0, now, prompt_blocks=prompt_blocks
    )
    saturation, max_blocks = rng.choice([0.5, 8.0]), rng.choice([4, 256])
    load, prefix = LoadParams(saturation), PrefixParams(max_blocks)
    for scorer, want in (
        (PrefixScorer(params=prefix), plain_prefix(request, state, fleet, max_blocks)),
        (QueueScorer(params=load), plain_queue(fleet, saturation)),
        (
            InFlightScorer(params=load),
            plain_lower_is_better({c.id: plain_load(c) for c in fleet}, saturation),
        ),
        (CacheSpreadScorer(), plain_cache_spread(state, fleet)),
        (LoraScorer(), plain_lora(request, fleet, LoraParams())),
    ):
        got = scorer.score(request, state, fleet)
        assert list(got.items()) == list(want.items()), scorer.name
        assert_lists_as_scores(scorer, request, state, fleet)


def assert_lists_as_scores(
    scorer: Any, request: SchedulingRequest, state: CycleState, fleet: Sequence[EndpointState]
) -> None:
    """``score_list`` (ListScorer) is ``score`` clamped to [0, 1], missing ones 0.0, in the candidates'
    order; ``None`` exactly when ``score`` scores nothing above 0."""
    scores = scorer.score(request, state, fleet)
    values = scorer.score_list(request, state, Candidates(fleet))
    want = [min(1.0, max(0.0, v)) if (v := scores.get(s.id, 0.0)) == v else 0.0 for s in fleet]
    if values is None:
        assert not any(want), scorer.name
    else:
        assert values == want, scorer.name
        assert all(0.0 <= v <= 1.0 for v in values), scorer.name


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_every_built_in_list_scorer_gives_its_scores_as_a_list(seed: int) -> None:
    """Every built-in scorer with ``score_list`` (the profile adds those lists unclamped), on random
    fleets and states, with the default params and a random configuration."""
    rng = random.Random(seed)
    now = 100.0
    fleet = [make_state(rng, i, now, 1.8e9) for i in range(rng.choice([0, 1, 2, 4, 16, 64]))]
    digests = [Digest(bytes([b]) * 16) for b in range(rng.randint(0, 20))]
    prompt_blocks = rng.choice([None, 0, len(digests), rng.randint(0, 300)])
    state = random_cycle_state(rng, [s.id for s in fleet], prompt_blocks or len(digests))
    request = SchedulingRequest(
        "r", rng.choice([MODEL, ADAPTER]), digests, 0, now, prompt_blocks=prompt_blocks
    )
    listed = 0
    for name, plugin_type in PLUGIN_TYPES.items():
        if plugin_type.kind != "scorer":
            continue
        scorer = plugin_type.factory(name)
        if hasattr(scorer, "score_list"):
            listed += 1
            assert_lists_as_scores(scorer, request, state, fleet)
    assert listed >= 6


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_candidates_keep_their_columns_through_a_selection(seed: int) -> None:
    """``Candidates.select`` carries the columns computed so far: the same as computing them anew."""
    rng = random.Random(seed)
    fleet = [make_state(rng, i, 100.0, 1.8e9) for i in range(rng.randint(0, 20))]
    cands = Candidates(fleet)
    if rng.random() < 0.5:
        _ = cands.ids
    if rng.random() < 0.5:
        _ = cands.loads
    if rng.random() < 0.5:
        _ = cands.waiting
    keep = [rng.random() < 0.5 for _ in fleet]
    got = cands.select(keep)
    fresh = Candidates(s for s, k in zip(fleet, keep, strict=True) if k)
    assert list(got) == list(fresh)
    assert got.ids == fresh.ids == [s.id for s in fresh]
    assert got.loads == fresh.loads == [plain_load(s) for s in fresh]
    nan_safe = [math.nan if s.metrics is None else s.metrics.waiting for s in fresh]
    assert [repr(w) for w in got.waiting] == [repr(w) for w in nan_safe]
    assert Candidates.of(got) is got
