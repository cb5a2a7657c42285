"""The cascade's cost arithmetic (extproc/cascade/cost.py) against its closed forms and the recorded runs."""

from __future__ import annotations

import math

import pytest

from extproc.cascade.cost import (
    BUFFERED,
    PERFECT,
    Costs,
    Policy,
    busy_ratio,
    first_k,
    fleet_busy_per_request,
    sweep,
    token_ratio,
)

C = Costs()


@pytest.mark.parametrize(
    ("costs", "policy", "expected"),
    [
        (C, PERFECT, 0.3 + 0.7 / 8),  # h + (1 - h) / c
        (C, BUFFERED, 0.3 + 1 / 8),  # every request pays the whole small step: h + 1 / c
        (Costs(ratio=4), PERFECT, 0.3 + 0.7 / 4),
        (Costs(hard_share=0.6), PERFECT, 0.6 + 0.4 / 8),  # above 0.5 whatever the policy
        (C, Policy(false_skip=1.0, recall=1.0), 1.0),  # everything straight to large
        (C, Policy(recall=0.5), 0.3 + 0.7 / 8 + 0.15 / 8),
    ],
)
def test_token_ratio_closed_forms(costs: Costs, policy: Policy, expected: float) -> None:
    assert token_ratio(costs, policy) == pytest.approx(expected)


def test_a_first_k_gate_wastes_the_prompt_and_k_tokens_on_what_it_escalates() -> None:
    cl = C.lone_s(small=False)
    wasted = C.time_scale * (339 / 20_000 + 0.006 + 3 * 0.00615) / 8
    assert first_k(4).wasted(C) == pytest.approx(wasted)
    assert token_ratio(C, first_k(4)) == pytest.approx(0.3 + 0.7 / 8 + 0.3 * wasted / cl)
    assert first_k(1000).wasted(C) == BUFFERED.wasted(C)


def test_replay_adds_the_cut_attempts_tokens_to_what_the_small_step_answers() -> None:
    """``replay``: an answered request pays its whole small answer plus the cut first attempt's ``k``
    tokens (its prompt counted once: cached for the replay); what it escalates is unchanged."""
    cl, cs = C.lone_s(small=False), C.lone_s(small=True)
    extra = C.time_scale * (0.006 + 3 * 0.00615) / 8
    replay = first_k(4, replay=True)
    assert replay.answered(C) == pytest.approx(cs + extra) and first_k(4).answered(C) == cs
    assert replay.wasted(C) == first_k(4).wasted(C)
    assert token_ratio(C, replay) == pytest.approx(token_ratio(C, first_k(4)) + 0.7 * extra / cl)
    assert busy_ratio(C, first_k(4)) < busy_ratio(C, replay) < busy_ratio(C, first_k(4)) + 0.02
    with pytest.raises(ValueError, match="replay needs cut_at"):
        Policy(replay=True)


@pytest.mark.parametrize(
    ("lam", "run_s", "replicas", "expected"),
    [
        (0.0, 2.0, 1, 2.0),  # alone: a request pays its whole run
        (1.0, 2.0, 1, 1 - math.exp(-2.0)),
        (2.0, 2.0, 2, 2 * (1 - math.exp(-2.0)) / 2),
        (1000.0, 2.0, 2, 2 / 1000),  # always busy: the fleet's time shared by every request
    ],
)
def test_fleet_busy_per_request(lam: float, run_s: float, replicas: int, expected: float) -> None:
    assert fleet_busy_per_request(lam, run_s, replicas) == pytest.approx(expected, rel=1e-9)


def test_busy_time_tends_to_the_token_ratio_when_idle_and_to_one_when_saturated() -> None:
    for policy in (PERFECT, BUFFERED, first_k(4)):
        assert busy_ratio(Costs(lam=1e-6), policy) == pytest.approx(token_ratio(C, policy), rel=1e-4)
        assert busy_ratio(Costs(lam=1e4), policy) == pytest.approx(1.0, abs=1e-3)


# The recorded runs (BENCHMARKS.md, "SLM -> LLM cascade"): hard share, gate, measured cascade / all-large.
RECORDED = [
    ("cascade-c12fa66-hard0.1.json", 0.1, BUFFERED, 0.466),
    ("cascade-c12fa66.json", 0.3, BUFFERED, 0.669),
    ("cascade-c12fa66-hard0.5.json", 0.5, BUFFERED, 0.729),
    ("cascade-547c33c-first4.json", 0.3, first_k(4), 0.638),
    ("cascade-ef9e7e6-first4-plain-r1.json", 0.3, first_k(4), 0.626),
    ("cascade-ef9e7e6-first4-plain-r2.json", 0.3, first_k(4), 0.622),
    ("cascade-ef9e7e6-first4-replay-r1.json", 0.3, first_k(4, replay=True), 0.635),
    ("cascade-ef9e7e6-first4-replay-r2.json", 0.3, first_k(4, replay=True), 0.637),
]


@pytest.mark.parametrize(("record", "hard", "policy", "measured"), RECORDED)
def test_the_busy_time_model_reproduces_the_recorded_runs(
    record: str, hard: float, policy: Policy, measured: float
) -> None:
    # 121 requests in 40 s; each run's own hard count would move these by < 0.01
    assert busy_ratio(Costs(hard_share=hard, lam=121 / 40), policy) == pytest.approx(measured, abs=0.03)


def test_no_escalator_meets_half_at_the_default_load_in_busy_time() -> None:
    assert busy_ratio(C, PERFECT) > 0.6
    assert busy_ratio(Costs(lam=1.0), PERFECT) < 0.5


def test_sweep_halves_and_doubles_each_parameter() -> None:
    got = [(name, f) for name, f, _ in sweep(C)]
    assert ("ratio", 0.5) in got and ("lam", 2.0) in got and ("hard_share", 2.0) in got
    assert len(got) == 16
    assert all(c.hard_share <= 1 for _, _, c in sweep(Costs(hard_share=0.8)))


def test_the_defaults_are_the_simulators_and_the_benchmarks() -> None:
    # extproc may not import the simulator (docs/ARCHITECTURE.md's room map), so Costs repeats its
    # defaults; this pins the copies together: a change to load/sim/timing.py or to the cascade
    # benchmark's configuration without the other fails here.
    from load.bench.cascade import CascadeConfig
    from load.sim.timing import TimingModel

    sim = TimingModel()
    assert (C.base_s, C.decode_s, C.prefill_s_per_token) == pytest.approx(
        (sim.base_s, sim.decode_s_per_seq, sim.prefill_s_per_token), rel=1e-12
    )
    bench = CascadeConfig()
    assert (bench.step_base_ms / 1e3, bench.decode_ms_per_seq / 1e3, 1 / bench.prefill_tokens_per_s) == (
        pytest.approx((sim.base_s, sim.decode_s_per_seq, sim.prefill_s_per_token), rel=1e-12)
    )
    # 339: the default prompt as the engines count it (extproc/cascade/README.md)
    derived = bench.costs(C.prompt_tokens)
    for name in C.__slots__:
        assert getattr(derived, name) == pytest.approx(getattr(C, name), rel=1e-12), name
