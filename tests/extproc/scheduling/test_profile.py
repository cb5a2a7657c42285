from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from contracts.digest import block_digests, chain_seed
from contracts.errors import ConfigError
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.fleet import EndpointState, Fleet
from extproc.index.approximate import ApproximateIndex
from extproc.scheduling.filters import HealthyFilter, LoadThresholdFilter, ModelFilter
from extproc.scheduling.interface import CycleState, SchedulingRequest
from extproc.scheduling.picker import MaxScorePicker
from extproc.scheduling.profile import Profile, ScheduleResult, cycle_state
from extproc.scheduling.registry import (
    DEFAULT_SCHEDULING,
    PLUGIN_TYPES,
    build_profile,
    parse_scheduling,
)

BLOCK = 16
SEED = chain_seed("m")


def make_fleet(n: int = 4) -> Fleet:
    fleet = Fleet(Endpoint(EndpointId(f"e{i}"), f"10.0.0.{i}:8000", frozenset({"m"})) for i in range(n))
    for state in fleet:
        fleet.record_scrape(state.id, EngineMetrics(waiting=0.0, running=1.0, kv_usage=0.2, at=0.0))
    return fleet


def tokens(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(blocks * BLOCK)]


def make_request(
    toks: Sequence[int], now: float = 1.0, subset: frozenset[str] | None = None
) -> SchedulingRequest:
    return SchedulingRequest(
        request_id="r",
        model="m",
        digests=block_digests(SEED, toks, BLOCK),
        prompt_tokens=len(toks),
        now=now,
        subset=subset,
    )


class Gateway:
    """The cycle as the router runs it: match, schedule, record the pick."""

    def __init__(self, fleet: Fleet, seed: int = 0) -> None:
        self.fleet = fleet
        self.index = ApproximateIndex()
        self.profile = build_profile(DEFAULT_SCHEDULING)
        self.rng = random.Random(seed)

    def route(self, toks: Sequence[int], now: float = 1.0) -> EndpointId:
        request = make_request(toks, now)
        result = self.profile.schedule(request, cycle_state(self.index, request), list(self.fleet), self.rng)
        assert result.pick is not None
        self.index.record(result.pick.id, request.digests, now)
        return result.pick.id


# --- end-to-end scenarios -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_shared_long_prefix_goes_to_its_owner(seed: int) -> None:
    rng = random.Random(seed)
    gw = Gateway(make_fleet(), seed)
    for _ in range(8):  # unrelated traffic, so every endpoint holds something
        gw.route(tokens(rng, 12))
    document = tokens(rng, 40)
    owner = gw.route(document + tokens(rng, 2))
    assert gw.route(document + tokens(rng, 3)) == owner


@pytest.mark.parametrize("seed", range(10))
def test_cold_prefixes_spread_over_all_endpoints(seed: int) -> None:
    rng = random.Random(seed)
    gw = Gateway(make_fleet(), seed)
    first_round = [gw.route(tokens(rng, 8)) for _ in range(4)]
    assert sorted(first_round) == ["e0", "e1", "e2", "e3"]
    second_round = Counter(gw.route(tokens(rng, 8)) for _ in range(4))
    assert set(second_round.values()) == {1}


@pytest.mark.parametrize("seed", range(10))
def test_hot_prefix_spills_when_its_owner_is_over_threshold(seed: int) -> None:
    rng = random.Random(seed)
    fleet = make_fleet()
    gw = Gateway(fleet, seed)
    hot = tokens(rng, 30)
    owner = gw.route(hot + tokens(rng, 1))
    assert gw.route(hot + tokens(rng, 1)) == owner  # while it has room, the owner keeps it
    fleet.record_scrape(owner, EngineMetrics(waiting=20.0, running=8.0, kv_usage=0.5, at=1.0))
    spilled = gw.route(hot + tokens(rng, 1))
    assert spilled != owner
    for state in fleet:  # once every replica is over the threshold, the prefix decides again
        fleet.record_scrape(state.id, EngineMetrics(waiting=20.0, running=8.0, kv_usage=0.5, at=1.0))
    assert gw.route(hot + tokens(rng, 1)) in {owner, spilled}


@pytest.mark.parametrize(("with_filter", "spills"), [(True, True), (False, False)])
def test_load_threshold_is_what_moves_a_hot_prefix(with_filter: bool, spills: bool) -> None:
    """Prefix score alone would keep piling onto the overloaded owner; the filter takes it out."""
    fleet = make_fleet()
    fleet.record_scrape(EndpointId("e1"), EngineMetrics(waiting=20.0, running=8.0, kv_usage=0.5, at=1.0))
    config = parse_scheduling(
        {
            "plugins": [{"type": "load-threshold"}, {"type": "prefix"}, {"type": "max-score"}],
            "profiles": [
                {
                    "name": "p",
                    "plugins": [{"ref": "load-threshold"}] * with_filter
                    + [{"ref": "prefix"}, {"ref": "max-score"}],
                }
            ],
        }
    )
    request = make_request(tokens(random.Random(1), 10))
    index = ApproximateIndex()
    index.record(EndpointId("e1"), request.digests, 0.0)
    result = build_profile(config).schedule(
        request, cycle_state(index, request), list(fleet), random.Random(0)
    )
    assert (result.endpoints[0].id != "e1") is spills


@pytest.mark.parametrize("seed", range(10))
def test_shared_system_prompt_does_not_collapse_groups(seed: int) -> None:
    rng = random.Random(seed)
    gw = Gateway(make_fleet(), seed)
    system = tokens(rng, 2)
    groups = [system + tokens(rng, 6) for _ in range(12)]
    owners = [gw.route(g + tokens(rng, 2)) for g in groups]
    counts = Counter(owners)
    assert set(counts) == {"e0", "e1", "e2", "e3"}
    assert max(counts.values()) <= 4
    # Each group's follow-up question finds the replica holding that group's context.
    assert [gw.route(g + tokens(rng, 2)) for g in groups] == owners


# --- the runner's own duties ----------------------------------------------------------------------


class FixedScorer:
    def __init__(self, name: str, scores: dict[str, float]) -> None:
        self.name = name
        self.scores = scores

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> dict[EndpointId, float]:
        return {EndpointId(k): v for k, v in self.scores.items()}


class Ticks:
    def __init__(self) -> None:
        self.t = 0

    def __call__(self) -> int:
        self.t += 10
        return self.t


def run(profile: Profile, fleet: Fleet | None = None, **kw: Any) -> ScheduleResult:
    candidates = list(fleet if fleet is not None else make_fleet(3))
    return profile.schedule(make_request([1] * BLOCK, **kw), CycleState(), candidates, random.Random(0))


def test_scores_are_clamped_weighted_and_summed() -> None:
    raw = FixedScorer("raw", {"e0": 7.0, "e1": -3.0, "e2": math.nan})
    half = FixedScorer("half", {"e0": 0.5, "e1": 0.5})  # e2 missing: 0
    profile = Profile("p", [], [(raw, 2.0), (half, 4.0)], MaxScorePicker(), explain=True)
    result = run(profile)
    assert result.scorer_scores["raw"] == {"e0": 1.0, "e1": 0.0, "e2": 0.0}
    assert result.scores == {"e0": 4.0, "e1": 2.0, "e2": 0.0}
    assert [s.id for s in result.endpoints] == ["e0", "e1", "e2"]
    assert result.rejected_by is None


def test_zero_weight_scorer_is_skipped() -> None:
    profile = Profile("p", [], [(FixedScorer("off", {"e2": 1.0}), 0.0)], MaxScorePicker())
    result = run(profile)
    assert "off" not in result.timings_ns and result.scores == {"e0": 0.0, "e1": 0.0, "e2": 0.0}


def test_every_plugin_is_timed_when_asked() -> None:
    plugins = ([ModelFilter()], [(FixedScorer("s", {}), 1.0)], MaxScorePicker())
    profile = Profile("p", *plugins, clock=Ticks(), timed=True)
    assert run(profile).timings_ns == {"model": 10, "s": 10, "max-score": 10}
    ticks = Ticks()
    assert run(Profile("p", *plugins, clock=ticks)).timings_ns == {} and ticks.t == 0  # never read


def test_no_candidates_left_is_an_empty_result_naming_the_filter() -> None:
    profile = build_profile(DEFAULT_SCHEDULING)
    fleet = make_fleet(3)
    result = run(profile, fleet, subset=frozenset({"10.9.9.9:1"}))
    assert result.endpoints == () and result.pick is None and result.rejected_by == "subset"
    for state in fleet:
        state.draining = True
    assert run(profile, fleet).rejected_by == "healthy"
    assert profile.schedule(make_request([1] * BLOCK), CycleState(), [], random.Random(0)) == ScheduleResult(
        ()
    )


def test_subset_hint_is_honoured_end_to_end() -> None:
    result = run(build_profile(DEFAULT_SCHEDULING), subset=frozenset({"10.0.0.2:8000"}))
    assert [s.id for s in result.endpoints] == ["e2"]


def test_gateway_max_fallbacks_caps_the_picker() -> None:
    assert len(run(build_profile(DEFAULT_SCHEDULING)).endpoints) == 3
    assert len(run(build_profile(DEFAULT_SCHEDULING, max_fallbacks=1)).endpoints) == 2
    assert len(run(build_profile(DEFAULT_SCHEDULING, max_fallbacks=0)).endpoints) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scorers": [(FixedScorer("s", {}), -1.0)]}, "weight"),
        ({"scorers": [(FixedScorer("s", {}), math.inf)]}, "weight"),
        ({"filters": [ModelFilter("x"), LoadThresholdFilter("x")]}, "used twice"),
        ({"max_fallbacks": -1}, "max_fallbacks"),
    ],
)
def test_profile_rejects_bad_composition(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"filters": [], "scorers": [], "picker": MaxScorePicker(), **kwargs}
    with pytest.raises(ConfigError, match=message):
        Profile("p", **args)


# --- configuration --------------------------------------------------------------------------------


def test_default_config() -> None:
    profile = build_profile(DEFAULT_SCHEDULING)
    assert profile.name == "default"
    assert [f.name for f in profile.filters] == [
        "model",
        "healthy",
        "subset",
        "slo",
        "power-cap",  # no power telemetry: keeps every candidate
        "load-threshold",
        "balance",
    ]
    assert [(s.name, w) for s, w in profile.scorers] == [
        ("prefix", 3.0),
        ("queue", 2.0),
        ("in-flight", 1.0),
        ("cache-spread", 1.0),
        ("kv-tier", 3.0),
        ("lora", 4.0),  # scores nothing unless the request names a LoRA adapter
    ]
    assert profile.picker.name == "max-score"
    assert {spec.type for spec in DEFAULT_SCHEDULING.plugins} == set(PLUGIN_TYPES)


def test_parse_names_params_and_profiles() -> None:
    config = parse_scheduling(
        {
            "plugins": [
                {"type": "model"},
                {
                    "type": "load-threshold",
                    "name": "strict",
                    "params": {"max_waiting": 2, "max_in_flight": 3},
                },
                {"type": "prefix", "params": {"max_blocks": 64}},
                {"type": "queue"},
                {"type": "max-score", "name": "pick", "params": {"max_fallbacks": 0}},
            ],
            "profiles": [
                {"name": "a", "plugins": [{"ref": "model"}, {"ref": "prefix", "weight": 5}, {"ref": "pick"}]},
                {"name": "b", "plugins": [{"ref": "strict"}, {"ref": "queue"}, {"ref": "pick"}]},
            ],
        }
    )
    a, b = build_profile(config), build_profile(config, "b")
    assert a.name == "a" and [(s.name, w) for s, w in a.scorers] == [("prefix", 5.0)]
    assert [(s.name, w) for s, w in b.scorers] == [("queue", 1.0)]  # weight defaults to 1.0
    strict = b.filters[0]
    assert isinstance(strict, LoadThresholdFilter) and strict.name == "strict"
    assert (strict.params.max_waiting, strict.params.max_in_flight, strict.params.max_kv_usage) == (
        2.0,
        3,
        None,
    )
    assert isinstance(a.picker, MaxScorePicker) and a.picker.params.max_fallbacks == 0
    with pytest.raises(ConfigError, match="'c'"):
        build_profile(config, "c")


def _config(plugins: list[Any], profile_plugins: list[Any], **extra: Any) -> dict[str, Any]:
    return {"plugins": plugins, "profiles": [{"name": "p", "plugins": profile_plugins}], **extra}


PICK = {"type": "max-score"}
PICK_REF = {"ref": "max-score"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (_config([{"type": "nope"}, PICK], [PICK_REF]), "unknown type 'nope'"),
        (_config([PICK], [PICK_REF], extra=1), "unknown key 'extra'"),
        (_config([{"type": "queue", "weight": 1}, PICK], [PICK_REF]), "unknown key 'weight'"),
        (_config([{"type": "load-threshold", "params": {"max_wait": 1}}, PICK], [PICK_REF]), "'max_wait'"),
        (_config([{"type": "queue", "params": {"x": 1}}, PICK], [PICK_REF]), r"plugin 'queue'.*'x'"),
        (_config([{"type": "prefix", "params": {"max_blocks": "8"}}, PICK], [PICK_REF]), "'max_blocks'"),
        (_config([{"type": "prefix", "params": {"max_blocks": True}}, PICK], [PICK_REF]), "'max_blocks'"),
        (_config([{"type": "prefix", "params": {"max_blocks": 2.5}}, PICK], [PICK_REF]), "'max_blocks'"),
        (
            _config([{"type": "load-threshold", "params": {"max_waiting": -1}}, PICK], [PICK_REF]),
            "max_waiting",
        ),
        (
            _config([{"type": "load-threshold", "params": {"max_waiting": math.inf}}, PICK], [PICK_REF]),
            "finite",
        ),
        (_config([{"type": "queue"}, PICK], [{"ref": "queue", "weight": -1}, PICK_REF]), "weight"),
        (_config([{"type": "queue"}, PICK], [{"ref": "queue", "weight": math.nan}, PICK_REF]), "weight"),
        (_config([{"type": "queue"}, PICK], [{"ref": "queue", "weight": "3"}, PICK_REF]), "weight"),
        (_config([{"type": "model"}, PICK], [{"ref": "model", "weight": 1}, PICK_REF]), "only scorers"),
        (
            _config([PICK, {"type": "max-score", "name": "two"}], [PICK_REF, {"ref": "two"}]),
            "exactly one picker",
        ),
        (_config([{"type": "queue"}], [{"ref": "queue"}]), "exactly one picker"),
        (_config([PICK], [{"ref": "missing"}, PICK_REF]), "'missing' names no configured plugin"),
        (_config([PICK], [PICK_REF, PICK_REF]), "referenced twice"),
        (_config([PICK, PICK], [PICK_REF]), "used twice"),
        (_config([PICK], [{"ref": "max-score", "wieght": 1}]), "unknown key 'wieght'"),
        (_config([{"name": "x"}], [PICK_REF]), "missing key 'type'"),
        ({"plugins": [PICK], "profiles": []}, "at least one profile"),
        ({"plugins": [PICK]}, "missing key 'profiles'"),
        ({"plugins": {"type": "max-score"}, "profiles": []}, "expected a list"),
        ([], "expected a mapping"),
    ],
)
def test_config_errors(raw: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_scheduling(raw)


class Only:
    """A filter keeping one endpoint: ``soft`` says whether it is a preference or a rule."""

    def __init__(self, keep: str, *, soft: bool) -> None:
        self.name, self.keep, self.soft = f"only-{keep}", keep, soft

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        return [c for c in candidates if c.id == self.keep]


def test_what_a_preference_filter_drops_is_still_a_fallback() -> None:
    """A soft filter (balance, load-threshold) narrowing the pick to one endpoint leaves the decision with
    fallbacks (least loaded first), so a pick that fails can be retried; a hard filter's drops never come
    back, and a hard filter after the soft one applies to the fallbacks too."""
    fleet = make_fleet(4)
    for i, state in enumerate(fleet):
        state.routed_since_scrape = 4 - i  # loads e0 5, e1 4, e2 3, e3 2
    capped = Profile("p", [Only("e0", soft=True)], [], MaxScorePicker(), max_fallbacks=2)
    assert [s.id for s in run(capped, fleet).endpoints] == ["e0", "e3", "e2"]
    unhealthy = fleet.get(EndpointId("e3"))
    assert unhealthy is not None
    unhealthy.healthy = False
    then_healthy = Profile(
        "p", [Only("e0", soft=True), HealthyFilter()], [], MaxScorePicker(), max_fallbacks=2
    )
    assert [s.id for s in run(then_healthy, fleet).endpoints] == ["e0", "e2", "e1"]
    hard = Profile("p", [Only("e0", soft=False)], [], MaxScorePicker(), max_fallbacks=2)
    assert [s.id for s in run(hard, fleet).endpoints] == ["e0"]


def test_a_rule_that_removes_every_preferred_endpoint_falls_back_to_the_passed_over_ones() -> None:
    """A preference listed before a rule (load-threshold before healthy): when the rule removes every
    endpoint the preference kept, the ones it passed over (the rule applied to them too) are scheduled,
    not a 503: a soft filter never turns a servable request into "no endpoint"."""
    fleet = make_fleet(4)
    for i, state in enumerate(fleet):
        state.routed_since_scrape = 4 - i  # loads e0 5, e1 4, e2 3, e3 2
    preferred = fleet.get(EndpointId("e0"))
    passed_over_unhealthy = fleet.get(EndpointId("e3"))
    assert preferred is not None and passed_over_unhealthy is not None
    preferred.healthy = passed_over_unhealthy.healthy = False
    profile = Profile("p", [Only("e0", soft=True), HealthyFilter()], [], MaxScorePicker(), max_fallbacks=2)
    result = run(profile, fleet)
    assert sorted(s.id for s in result.endpoints) == ["e1", "e2"] and result.rejected_by is None
    everyone = Profile("p", [Only("e0", soft=True), Only("e9", soft=False)], [], MaxScorePicker())
    assert run(everyone, fleet).rejected_by == "only-e9"  # the rule leaves none at all: 503 as before


def test_the_default_profile_keeps_fallbacks_when_balance_narrows_the_pick() -> None:
    """A replica back from a restart (routed share 0) is the balance filter's only choice for a while; the
    others stay fallbacks (a request it fails is retried, not a 503)."""
    fleet = make_fleet(3)
    for state in fleet:
        if state.id != "e0":
            state.count_routed(1.0, 50.0)
    profile = build_profile(DEFAULT_SCHEDULING, max_fallbacks=2)
    state = CycleState(exact=True)
    result = profile.schedule(make_request([1] * BLOCK), state, list(fleet), random.Random(0))
    assert result.endpoints[0].id == "e0" and len(result.endpoints) == 3
