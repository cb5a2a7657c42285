"""The power plugins and the energy model: the scorer's formula (a table), the soft power-cap filter,
the per-node fit of watts against output tokens/s, and routing with them: the replica with the lower
energy per token gets the work, one over its cap gets none while another has room, and a power weight
written to a real etcd takes effect in a running control plane without a restart."""

from __future__ import annotations

import math
import random

import etcd3aio
import pytest

from contracts.etcd import EtcdSettings
from contracts.events import EndpointId, Power
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.control.plane import ControlPlane
from extproc.control.policy import Policy, PolicyStore
from extproc.fleet import EndpointState, Fleet
from extproc.scheduling.energy import EnergyModel, node_watts
from extproc.scheduling.interface import CycleState, SchedulingRequest
from extproc.scheduling.power import (
    NEUTRAL,
    PowerCapFilter,
    PowerCapParams,
    PowerParams,
    PowerScorer,
    headroom,
)
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile
from tests.polling import until

pytest_plugins = ("tests.etcd_fixtures",)

REQUEST = SchedulingRequest(request_id="r", model="m", digests=(), prompt_tokens=0, now=0.0)


def state(
    i: int,
    *,
    energy: float | None = None,
    power: tuple[Power, ...] = (),
    waiting: float = 0.0,
) -> EndpointState:
    ep = Endpoint(EndpointId(f"e{i}"), f"10.0.0.{i}:8000", frozenset({"m"}), node=f"node-{i}")
    s = EndpointState(ep, metrics=EngineMetrics(waiting=waiting, running=0.0, kv_usage=0.1, at=0.0))
    s.energy_per_token, s.power = energy, power
    return s


def capped(watts: float, limit: float = 700.0, **kwargs: object) -> tuple[Power, ...]:
    return (Power("dcgm", "dcgm", watts=watts, limit_w=limit, at=1.0, **kwargs),)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        # no telemetry anywhere: neutral
        ([state(1), state(2)], {"e1": NEUTRAL, "e2": NEUTRAL}),
        # efficiency alone: min e / e
        ([state(1, energy=0.5), state(2, energy=1.0)], {"e1": 1.0, "e2": 0.5}),
        # headroom alone: neutral efficiency x min(1, (1 - watts / limit) / 0.2)
        (
            [state(1, power=capped(350.0)), state(2, power=capped(630.0)), state(3, power=capped(720.0))],
            {"e1": 0.5, "e2": 0.25, "e3": 0.0},
        ),
        # both: efficiency x room; ample room does not matter, a node near its cap loses its lead
        (
            [
                state(1, energy=0.5, power=capped(350.0)),
                state(2, energy=2.0),
                state(3, energy=0.5, power=capped(665.0)),
            ],
            {"e1": 1.0, "e2": 0.25, "e3": 0.25},
        ),
        # a candidate without telemetry stays neutral
        ([state(1, energy=1.0), state(2)], {"e1": 1.0, "e2": 0.5}),
        # a failed source says nothing; a non-positive energy is no estimate
        (
            [state(1, power=(Power("bmc", "ipmi", at=1.0, error="timeout"),)), state(2, energy=0.0)],
            {"e1": 0.5, "e2": 0.5},
        ),
    ],
)
def test_power_scorer(candidates: list[EndpointState], expected: dict[str, float]) -> None:
    scores = PowerScorer().score(REQUEST, CycleState(), candidates)
    assert scores == pytest.approx(expected)


def test_power_reserve() -> None:
    near = [state(1, energy=1.0, power=capped(560.0))]  # 20 % under the cap
    assert PowerScorer().score(REQUEST, CycleState(), near) == {"e1": pytest.approx(1.0)}
    wide = PowerScorer(params=PowerParams(reserve=0.4)).score(REQUEST, CycleState(), near)
    assert wide == {"e1": pytest.approx(0.5)}
    with pytest.raises(ValueError, match="reserve"):
        PowerParams(reserve=0.0)


def test_headroom_takes_the_tightest_cap() -> None:
    bmc = Power("bmc", "redfish", watts=900.0, limit_w=1000.0, at=1.0)
    assert headroom((*capped(350.0), bmc)) == pytest.approx(0.1)
    assert headroom((Power("x", "ipmi", watts=10.0, at=1.0),)) is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_reading_without_a_finite_figure_gives_no_headroom(bad: float) -> None:
    """An agent's reading with a non-finite watts or cap (msgspec lets NaN and infinities through) says
    nothing of the headroom, in whatever order the readings come: the other readings', else none (the
    ``power`` scorer's room is then 1, as without a cap), never 0 nor NaN."""
    bmc = Power("bmc", "redfish", watts=900.0, limit_w=1000.0, at=1.0)
    for odd in (capped(bad)[0], capped(350.0, limit=bad)[0]):
        assert headroom((odd,)) is None
        assert headroom((odd, bmc)) == pytest.approx(0.1)
        assert headroom((bmc, odd)) == pytest.approx(0.1)
    scores = PowerScorer().score(REQUEST, CycleState(), [state(1, power=capped(bad)), state(2)])
    assert scores == {"e1": NEUTRAL, "e2": NEUTRAL}


@pytest.mark.parametrize(
    ("power", "params", "over"),
    [
        (capped(600.0), PowerCapParams(), False),
        (capped(690.0), PowerCapParams(), True),  # within 2 % of the cap
        (capped(690.0), PowerCapParams(cap_margin=0.0), False),
        (capped(400.0, throttled=True), PowerCapParams(), True),
        (capped(400.0, throttled=True), PowerCapParams(throttled=False), False),
        (capped(400.0, temperature_c=91.0), PowerCapParams(max_temperature_c=90.0), True),
        (capped(400.0, temperature_c=91.0), PowerCapParams(), False),
        ((Power("bmc", "ipmi", at=1.0, error="no answer"),), PowerCapParams(), False),
        ((), PowerCapParams(), False),
    ],
)
def test_power_cap_filter(power: tuple[Power, ...], params: PowerCapParams, over: bool) -> None:
    flt = PowerCapFilter(params=params)
    hot, cool = state(1, power=power), state(2)
    assert [c.id for c in flt.filter(REQUEST, CycleState(), [hot, cool])] == (
        ["e2"] if over else ["e1", "e2"]
    )
    assert [c.id for c in flt.filter(REQUEST, CycleState(), [hot])] == ["e1"]  # nothing else: kept


def test_power_cap_params_are_checked() -> None:
    with pytest.raises(ValueError, match="cap_margin"):
        PowerCapParams(cap_margin=1.0)
    with pytest.raises(ValueError, match="max_temperature_c"):
        PowerCapParams(max_temperature_c=0.0)


def test_energy_model_fits_the_marginal_energy_per_token() -> None:
    model = EnergyModel(half_life_s=300.0)
    for i, tps in enumerate([100.0, 400.0, 250.0, 800.0, 50.0, 600.0]):
        model.observe("a", 300.0 + 0.8 * tps, tps, now=float(i), reading_at=float(i))
    assert model.marginal("a") == pytest.approx(0.8)
    model.observe("a", 10_000.0, 10_000.0, now=6.0, reading_at=5.0)  # a reading already counted
    assert model.marginal("a") == pytest.approx(0.8)
    # one load level only: the slope is unknown, the average energy per token stands in
    for i in range(5):
        model.observe("b", 500.0, 250.0, now=float(i))
    assert model.marginal("b", 500.0, 250.0) == 2.0
    assert model.marginal("b", 120.0, 0.5) is None  # idle: no estimate
    assert model.marginal("unknown") is None


def test_node_watts_prefers_gpu_sources_and_skips_errors() -> None:
    ipmi = Power("bmc", "ipmi", watts=900.0, at=1.0)
    dcgm = Power("dcgm", "dcgm", watts=610.0, at=1.0)
    broken = Power("nv", "nvml", at=1.0, error="no GPU")
    assert node_watts((ipmi, broken, dcgm)) == dcgm
    assert node_watts((ipmi, broken)) == ipmi
    assert node_watts((broken,)) is None


def pick(policy: Policy, candidates: list[EndpointState]) -> str:
    profile = build_profile(policy.scheduling)
    result = profile.schedule(REQUEST, CycleState(), candidates, random.Random(0))
    return result.endpoints[0].id


def test_the_lower_energy_per_token_gets_the_work() -> None:
    store = PolicyStore(DEFAULT_SCHEDULING)
    thrifty, hungry = state(1, energy=0.4, waiting=1.0), state(2, energy=1.2)
    assert pick(store.policy, [thrifty, hungry]) == "e2"  # the power weight is 0 by default: queue decides
    policy = store.put("weights/power", b"2")
    assert policy is not None and pick(policy, [thrifty, hungry]) == "e1"


def test_a_replica_over_its_cap_gets_no_new_requests_while_another_has_room() -> None:
    policy = PolicyStore(DEFAULT_SCHEDULING).policy  # the default profile has the power-cap filter
    over = state(1, power=capped(699.0), energy=0.1)  # even the most efficient
    room = state(2, power=capped(300.0), waiting=4.0)
    profile = build_profile(policy.scheduling)
    rng = random.Random(1)
    picks = [profile.schedule(REQUEST, CycleState(), [over, room], rng).endpoints[0].id for _ in range(50)]
    assert set(picks) == {"e2"}
    result = profile.schedule(REQUEST, CycleState(), [over, room], rng)
    assert [e.id for e in result.endpoints] == ["e2", "e1"]  # still a fallback if e2 fails
    assert pick(policy, [over]) == "e1"  # nothing else can take it


async def test_a_power_weight_in_etcd_takes_effect_without_restart(
    etcd_settings: EtcdSettings, etcd_client: etcd3aio.Etcd3Client
) -> None:
    assert etcd_client.kv is not None
    kv, prefix = etcd_client.kv, etcd_settings.prefix
    store = PolicyStore(DEFAULT_SCHEDULING)
    policies: list[Policy] = []
    plane = ControlPlane(etcd_settings, Fleet(), store, on_policy=policies.append, probe_interval_s=0.2)
    thrifty, hungry = state(1, energy=0.4, waiting=1.0), state(2, energy=1.2)
    await plane.start()
    try:
        assert await plane.wait_synced(5.0)
        assert pick(store.policy, [thrifty, hungry]) == "e2"
        await kv.put(f"{prefix}policy/weights/power", b"3")
        await until(lambda: store.policy.weight("power") == 3.0, 2.0)
        assert pick(store.policy, [thrifty, hungry]) == "e1"
        await kv.put(f"{prefix}policy/weights/power", b"-1")  # refused: the last good weight stays
        await until(lambda: plane.counters["rejected"] == 1, 2.0)
        assert store.policy.weight("power") == 3.0
        await kv.put(f"{prefix}policy/plugins/power-cap/cap_margin", b"0.5")
        await until(lambda: store.policy.scheduling.plugin("power-cap").params == PowerCapParams(0.5), 2.0)
    finally:
        await plane.aclose()


def test_average_watts_from_the_energy_counter() -> None:
    from extproc.scheduling.energy import average_watts

    first = Power("dcgm", "dcgm", watts=70.0, energy_j=1000.0, at=10.0)
    second = Power("dcgm", "dcgm", watts=70.0, energy_j=1450.0, at=11.5)  # a busy 1.5 s, idle at the read
    assert average_watts(first, second) == 300.0
    assert average_watts(None, second) == 70.0
    assert average_watts(second, first) == 70.0  # backwards in time / counter reset: the reading itself
    other = Power("bmc", "redfish", watts=500.0, energy_j=1.0, at=12.0)
    assert average_watts(second, other) == 500.0  # another source's counter is not comparable
