"""The marginal-energy scorer and the power-cap filter's hysteresis: the power curve fitted from readings
(idle draw, wake-up draw, busy slope, one sequence's speed), the cost of a request on a busy and on an
idle node, the scorer's formula (a table), the latch (a table), and routing with them: with two equal
replicas the busy one takes the work while its predicted TTFT is within the target and the idle one
when it is not."""

from __future__ import annotations

import gc
import random

import pytest

from contracts.events import EndpointId, Power
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.fleet import EndpointState, Fleet
from extproc.scheduling.energy import CapLatch, EnergyModel, PowerCurve
from extproc.scheduling.interface import CycleState, SchedulingRequest
from extproc.scheduling.power import (
    NEUTRAL,
    MarginalEnergyParams,
    MarginalEnergyScorer,
    PowerCapFilter,
    PowerCapParams,
)
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile, parse_scheduling

REQUEST = SchedulingRequest(request_id="r", model="m", digests=(), prompt_tokens=0, now=0.0)
#: An H100-like curve: 70 W idle, 220 W more once active, 0.05 J per token busy, 150 tokens/s a sequence.
CURVE = PowerCurve(idle_w=70.0, wake_w=220.0, k=0.05, seq_tps=150.0, busy_tps=600.0)


def state(
    i: int,
    *,
    curve: PowerCurve | None = CURVE,
    running: float = 0.0,
    waiting: float = 0.0,
    power: tuple[Power, ...] = (),
) -> EndpointState:
    ep = Endpoint(EndpointId(f"e{i}"), f"10.0.0.{i}:8000", frozenset({"m"}), node=f"node-{i}")
    s = EndpointState(ep, metrics=EngineMetrics(waiting=waiting, running=running, kv_usage=0.1, at=0.0))
    s.power_curve, s.power = curve, power
    return s


def test_the_curve_separates_idle_draw_wake_up_and_busy_slope() -> None:
    model = EnergyModel()
    t = 0.0
    for _ in range(3):  # idle: 70 W, nothing running
        model.observe("a", 70.0, 0.0, now=t, reading_at=t, running=0.0)
        t += 1
    for tps in (150.0, 600.0, 300.0, 1200.0, 900.0):  # busy: 290 W + 0.05 J/token, 150 tokens/s a sequence
        model.observe("a", 290.0 + 0.05 * tps, tps, now=t, reading_at=t, running=tps / 150.0)
        t += 1
    curve = model.curve("a")
    assert curve is not None
    assert curve.idle_w == pytest.approx(70.0)
    assert curve.wake_w == pytest.approx(220.0)
    assert curve.k == pytest.approx(0.05)
    assert curve.seq_tps == pytest.approx(150.0)
    assert curve.cost(running=0) == pytest.approx(0.05 + 220.0 / 150.0)  # the whole wake-up
    assert curve.cost(running=9) == pytest.approx(0.05 + 220.0 / 1500.0)  # awake 1/10 of it longer
    assert curve.cost(running=1e9) == pytest.approx(0.05)  # the busy slope
    # the straight line over every reading puts the step from idle into its slope
    marginal = model.marginal("a")
    assert marginal is not None and marginal > 0.1


@pytest.mark.parametrize(
    ("readings", "expected"),
    [
        # fewer than 3 busy readings (weights decayed): no curve
        ([(70.0, 0.0, 0.0), (300.0, 200.0, 1.0), (320.0, 600.0, 4.0)], None),
        # busy readings at one load level and idle ones: k is the busy mean above idle, no wake-up known
        (
            [(70.0, 0.0, 0.0)] + [(370.0, 300.0, 2.0)] * 4,
            PowerCurve(idle_w=70.0, wake_w=0.0, k=1.0, seq_tps=150.0, busy_tps=300.0),
        ),
        # no idle reading: the idle draw is the busy intercept (no wake-up cost known)
        (
            [(300.0, 200.0, None), (320.0, 600.0, None), (310.0, 400.0, None), (310.0, 400.0, None)],
            PowerCurve(idle_w=290.0, wake_w=0.0, k=0.05, seq_tps=None, busy_tps=400.0),
        ),
        # no tokens but requests running (a prefill): not an idle reading; one level, no idle: average
        (
            [(500.0, 0.0, 3.0)] + [(400.0, 200.0, None)] * 4,
            PowerCurve(idle_w=0.0, wake_w=0.0, k=2.0, seq_tps=None, busy_tps=200.0),
        ),
    ],
)
def test_power_curve_fallbacks(
    readings: list[tuple[float, float, float | None]], expected: PowerCurve | None
) -> None:
    model = EnergyModel()
    for i, (watts, tps, running) in enumerate(readings):
        model.observe("a", watts, tps, now=float(i), reading_at=float(i), running=running)
    curve = model.curve("a")
    if expected is None:
        assert curve is None
        return
    assert curve is not None
    for name in ("idle_w", "wake_w", "k", "busy_tps"):
        assert getattr(curve, name) == pytest.approx(getattr(expected, name), rel=1e-2, abs=1e-6), name
    assert curve.seq_tps == (None if expected.seq_tps is None else pytest.approx(expected.seq_tps))
    model.forget("a")
    assert model.curve("a") is None


def test_cost_without_one_sequence_speed_uses_the_busy_mean() -> None:
    curve = PowerCurve(idle_w=55.0, wake_w=120.0, k=0.05, seq_tps=None, busy_tps=400.0)
    assert curve.cost(running=0) == pytest.approx(0.05 + 120.0 / 400.0)
    assert curve.cost(running=float("nan")) == pytest.approx(0.05 + 120.0 / 400.0)


BUSY, IDLE = dict(running=4.0), dict(running=0.0)
CHEAP = PowerCurve(idle_w=55.0, wake_w=120.0, k=0.04, seq_tps=100.0, busy_tps=400.0)
C_BUSY, C_IDLE, C_CHEAP = 0.05 + 220.0 / (150.0 * 5), 0.05 + 220.0 / 150.0, 0.04 + 120.0 / (100.0 * 5)


@pytest.mark.parametrize(
    ("candidates", "predicted", "params", "expected"),
    [
        # busy (4 running) and idle, same curve: k + 220 / (150 x 5) against k + 220 / 150 (past the scale)
        ([state(1, **BUSY), state(2, **IDLE)], {}, MarginalEnergyParams(), {"e1": 1.0, "e2": 0.0}),
        # a wider scale: 1 - (cost - best) / scale
        (
            [state(1, **BUSY), state(2, **IDLE)],
            {},
            MarginalEnergyParams(scale_j=2.0),
            {"e1": 1.0, "e2": pytest.approx(1.0 - (C_IDLE - C_BUSY) / 2.0)},
        ),
        # two busy nodes, different curves: the difference of their costs
        (
            [state(1, **BUSY), state(2, curve=CHEAP, **BUSY)],
            {},
            MarginalEnergyParams(),
            {"e1": pytest.approx(1.0 - (C_BUSY - C_CHEAP)), "e2": 1.0},
        ),
        # the same curve, 1 and 9 running: the fuller one keeps the GPU awake anyway (consolidation)
        (
            [state(1, running=1.0), state(2, running=9.0)],
            {},
            MarginalEnergyParams(),
            {"e1": pytest.approx(1.0 - (220.0 / 300.0 - 220.0 / 1500.0)), "e2": 1.0},
        ),
        # the busy one is predicted past the target (and past 1.25x the best): no room, the idle one wins
        (
            [state(1, **BUSY), state(2, **IDLE)],
            {"e1": 0.40, "e2": 0.10},
            MarginalEnergyParams(ttft_target_s=0.25),
            {"e1": 0.0, "e2": 1.0},
        ),
        # past the target but within 1.25x the best prediction: room (the target cannot be met anyway)
        (
            [state(1, **BUSY), state(2, **IDLE)],
            {"e1": 0.36, "e2": 0.30},
            MarginalEnergyParams(ttft_target_s=0.25),
            {"e1": 1.0, "e2": 0.0},
        ),
        # ... unless the ratio is off
        (
            [state(1, **BUSY), state(2, **IDLE)],
            {"e1": 0.36, "e2": 0.30},
            MarginalEnergyParams(ttft_target_s=0.25, ttft_ratio=None),
            {"e1": NEUTRAL, "e2": NEUTRAL},
        ),
        # no prediction: a queue longer than max_waiting is no room
        (
            [state(1, waiting=2.0, **BUSY), state(2, **IDLE)],
            {},
            MarginalEnergyParams(),
            {"e1": 0.0, "e2": 1.0},
        ),
        # no curve: neutral; no telemetry anywhere: neutral
        (
            [state(1, curve=None, **BUSY), state(2, **IDLE)],
            {},
            MarginalEnergyParams(),
            {"e1": NEUTRAL, "e2": 1.0},
        ),
        (
            [state(1, curve=None), state(2, curve=None)],
            {},
            MarginalEnergyParams(),
            {"e1": NEUTRAL, "e2": NEUTRAL},
        ),
    ],
)
def test_marginal_energy_scorer(
    candidates: list[EndpointState],
    predicted: dict[str, float],
    params: MarginalEnergyParams,
    expected: dict[str, float],
) -> None:
    cycle = CycleState(predicted_ttft={EndpointId(k): v for k, v in predicted.items()})
    assert MarginalEnergyScorer(params=params).score(REQUEST, cycle, candidates) == expected


def test_a_request_budget_tighter_than_the_target_wins() -> None:
    busy, idle = state(1, **BUSY), state(2, **IDLE)
    cycle = CycleState(predicted_ttft={busy.id: 0.2, idle.id: 0.05})
    tight = SchedulingRequest("r", "m", (), 0, 0.0, ttft_budget_s=0.1)
    scorer = MarginalEnergyScorer(params=MarginalEnergyParams(ttft_target_s=0.25))
    assert scorer.score(REQUEST, cycle, [busy, idle]) == {"e1": 1.0, "e2": 0.0}
    assert scorer.score(tight, cycle, [busy, idle]) == {"e1": 0.0, "e2": 1.0}


def test_marginal_energy_params_are_checked() -> None:
    for bad in (dict(ttft_target_s=0.0), dict(max_waiting=-1.0), dict(ttft_ratio=0.5), dict(scale_j=0.0)):
        with pytest.raises(ValueError):
            MarginalEnergyParams(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="leave_margin"):
        PowerCapParams(leave_margin=1.0)


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        # (at, enter, stay): on when over the entry threshold, off only below the exit one
        ([(1, True, True), (2, False, True), (3, False, True), (4, False, False)], [True, True, True, False]),
        # never in: staying above the exit threshold alone does not turn it on
        ([(1, False, True), (2, False, True)], [False, False]),
        # the same readings (the same time) give the same answer
        ([(1, True, True), (1, False, False), (2, False, False)], [True, True, False]),
        # an earlier time is a new reading too (the agent's clock stepped back, or it restarted): it used
        # to be ignored until the clock passed the old time
        ([(100, True, True), (50, False, False), (50, True, True)], [True, False, False]),
    ],
)
def test_cap_latch(steps: list[tuple[float, bool, bool]], expected: list[bool]) -> None:
    latch = CapLatch()
    assert [latch.update("e", at, enter=enter, stay=stay) for at, enter, stay in steps] == expected


def test_power_cap_filter_hysteresis() -> None:
    """Cap 700 W: over at 686 W (2 % margin), still over at 650 W, back under 630 W (10 % margin)."""
    flt = PowerCapFilter(params=PowerCapParams())
    plain = PowerCapFilter(params=PowerCapParams(leave_margin=None))
    node = state(1)
    seen = []
    for at, watts in enumerate((600.0, 690.0, 650.0, 640.0, 620.0, 650.0), start=1):
        node.power = (Power("dcgm", "dcgm", watts=watts, limit_w=700.0, at=float(at)),)
        seen.append((flt.over(node), flt.over(node), plain.over(node)))
    assert [s[0] for s in seen] == [False, True, True, True, False, False]
    assert all(s[0] == s[1] for s in seen)  # asking twice about one reading changes nothing
    assert [s[2] for s in seen] == [False, True, False, False, False, False]
    # a throttled reading enters too, and keeps it in until a reading without it
    node.power = (Power("dcgm", "dcgm", watts=400.0, limit_w=700.0, throttled=True, at=10.0),)
    assert flt.over(node)
    node.power = (Power("dcgm", "dcgm", watts=400.0, limit_w=700.0, at=11.0),)
    assert not flt.over(node)


def profile_with_marginal_energy(weight: float) -> object:
    plugins = [{"type": p.type, "name": p.name} for p in DEFAULT_SCHEDULING.plugins]
    refs = [
        {"ref": r.ref} if r.weight is None else {"ref": r.ref, "weight": r.weight}
        for r in DEFAULT_SCHEDULING.profiles[0].plugins
    ]
    refs.insert(-1, {"ref": "marginal-energy", "weight": weight})
    return build_profile(parse_scheduling({"plugins": plugins, "profiles": [{"name": "p", "plugins": refs}]}))


def test_the_busy_replica_takes_the_work_within_the_ttft_target() -> None:
    """Two equal replicas, one running a request: the default profile alone sends the next one to the
    idle replica (queue, in-flight); with marginal-energy at weight 4 it goes to the busy one, whose GPU is
    awake anyway, until the busy one's predicted TTFT leaves the target."""
    from extproc.scheduling.profile import Profile

    busy, idle = state(1, running=1.0), state(2)
    busy.in_flight = 1
    within = CycleState(predicted_ttft={busy.id: 0.05, idle.id: 0.04})
    beyond = CycleState(predicted_ttft={busy.id: 0.5, idle.id: 0.04})
    plain = build_profile(DEFAULT_SCHEDULING)
    energy = profile_with_marginal_energy(4.0)
    assert isinstance(energy, Profile) and energy.predicts
    rng = random.Random(0)
    assert plain.schedule(REQUEST, within, [busy, idle], rng).endpoints[0].id == "e2"
    assert energy.schedule(REQUEST, within, [busy, idle], rng).endpoints[0].id == "e1"
    assert energy.schedule(REQUEST, beyond, [busy, idle], rng).endpoints[0].id == "e2"


def test_a_marginal_energy_weight_in_the_policy_turns_it_on() -> None:
    from extproc.control.policy import PolicyStore

    store = PolicyStore(DEFAULT_SCHEDULING)
    assert not build_profile(store.policy.scheduling).predicts  # off by default
    policy = store.put("weights/marginal-energy", b"4")
    assert policy is not None and build_profile(policy.scheduling).predicts
    assert store.put("plugins/marginal-energy/ttft_target_s", b"0") is None  # refused, the last good stays


def test_power_cap_filter_a_failed_read_keeps_the_latch() -> None:
    """Readings whose sources all failed neither enter nor leave (a newer error used to release the node:
    only a reading under the exit threshold does)."""
    flt = PowerCapFilter(params=PowerCapParams())
    node = state(1, power=(Power("dcgm", "dcgm", watts=690.0, limit_w=700.0, at=100.0),))
    assert flt.over(node)
    node.power = (Power("dcgm", "dcgm", at=101.0, error="no answer"),)
    assert flt.over(node)
    node.power = (Power("dcgm", "dcgm", watts=650.0, limit_w=700.0, at=102.0),)  # above the exit threshold
    assert flt.over(node)
    node.power = (Power("dcgm", "dcgm", watts=600.0, limit_w=700.0, at=103.0),)
    assert not flt.over(node)
    node.power = (Power("dcgm", "dcgm", at=104.0, error="no answer"),)
    assert not flt.over(node)  # nor does a failure enter


def test_power_cap_filter_forgets_expired_readings() -> None:
    """A node latched over whose readings expire (the fleet's staleness bound makes its power ``()``) is
    not over, and its latch entry goes (it used to stay over for ever: no newer ``at`` ever came); an
    agent whose clock went back is read at once."""
    flt = PowerCapFilter(params=PowerCapParams())
    fleet = Fleet([Endpoint(EndpointId("e1"), "10.0.0.1:8000", frozenset({"m"}), node="n1")])
    fleet.upsert(Endpoint(EndpointId("e2"), "10.0.0.2:8000", frozenset({"m"}), node="n2"))
    node, other = fleet.get(EndpointId("e1")), fleet.get(EndpointId("e2"))
    assert node is not None and other is not None

    def kept() -> list[str]:
        return [c.id for c in flt.filter(REQUEST, CycleState(), [node, other])]

    fleet.record_power(node.id, (Power("dcgm", "dcgm", watts=690.0, limit_w=700.0, at=100.0),), now=10.0)
    assert kept() == ["e2"] and flt.latch.holding
    # the readings expire: no telemetry is never over, and the latch forgets the endpoint
    fleet.expire_metrics(now=20.0, stale_after=2.0)
    assert node.power == () and kept() == ["e1", "e2"]
    assert "e1" not in flt.latch and not flt.latch.holding
    # over again, then the agent restarts with its wall clock behind: its low reading is taken at once
    fleet.record_power(node.id, (Power("dcgm", "dcgm", watts=690.0, limit_w=700.0, at=200.0),), now=30.0)
    assert kept() == ["e2"]
    fleet.record_power(node.id, (Power("dcgm", "dcgm", watts=100.0, limit_w=700.0, at=150.0),), now=31.0)
    assert kept() == ["e1", "e2"]


def test_power_cap_filter_forgets_endpoints_that_left_the_fleet() -> None:
    """The latch keeps no entry for an endpoint removed from the fleet (``CapLatch.forget`` was never
    called: every endpoint that ever went over stayed in it), and one that comes back under its old id
    starts afresh."""
    flt = PowerCapFilter(params=PowerCapParams())
    fleet = Fleet([Endpoint(EndpointId(f"e{i}"), f"10.0.0.{i}:8000", frozenset({"m"})) for i in range(3)])
    states = list(fleet)
    for i, s in enumerate(states):
        fleet.record_power(s.id, (Power("dcgm", "dcgm", watts=690.0, limit_w=700.0, at=100.0 + i),), now=0.0)
    assert all(flt.over(s) for s in states) and len(flt.latch) == 3
    gone = states.pop(0)
    fleet.remove(gone.id)
    del gone
    gc.collect()
    assert "e0" not in flt.latch and len(flt.latch) == 2
    # e1 leaves and comes back (a new state object, the same readings): not latched from before
    fleet.remove(EndpointId("e1"))
    back = fleet.upsert(Endpoint(EndpointId("e1"), "10.0.0.1:8000", frozenset({"m"})))
    back.power = (Power("dcgm", "dcgm", watts=650.0, limit_w=700.0, at=101.0),)  # under the entry threshold
    assert not flt.over(back)
