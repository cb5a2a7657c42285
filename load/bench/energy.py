"""Energy-aware routing in simulated time (issue 20): a heterogeneous fleet of simulated replicas with GPU
power models, driven as a discrete-event simulation in one process, routed by kvgate's real scheduling
profile (with and without the ``power`` scorer and the ``power-cap`` filter), round robin and least loaded.

No sockets, no sleeping: each replica is a :class:`load.sim.engine.Engine` with a
:class:`load.sim.power.PowerModel` stepped on a shared virtual clock, so a run of minutes of traffic takes
seconds. What the gateway would learn from its agents' feeds is produced the same way once per simulated
second: each node's watts (its energy counter's growth), its output tokens/s (its generated-tokens counter),
its power limit and whether it ran capped; :class:`extproc.scheduling.energy.EnergyModel` turns them into
J/token exactly as :class:`extproc.control.feeds.FeedManager` does. Load signals (waiting, running, KV use)
are read from the engines at each decision, as a fresh scrape. Prefix matches are the engines' own caches
(a precise index).

Workload: shared prefix: ``groups`` system prompts of ``prefix_tokens`` tokens, each request one of them
plus ``question_tokens`` of its own, ``output_tokens`` out, Poisson arrivals. Figures per target and load:
energy per output token (J/token: every replica's energy over the run, idle included, over the output
tokens), TTFT p90, output tokens/s, time at the power cap (replica-seconds the cap held the clocks down).

Targets: ``kvgate-power`` (the default profile plus the ``power`` scorer at ``power_weight``), ``kvgate``
(the default profile without the ``power`` scorer and the ``power-cap`` filter: kvgate before issue 20),
round robin, least loaded (running + waiting); with ``--references`` two bounds that know the power model
(:data:`REFERENCES`). ``--sweep`` runs the four targets again with each key parameter of the simulator
halved and doubled (:data:`SWEEP`) and reports per variant the goals' ratios and whether the routers' J/token
order holds. The result carries the power model's parameters and their sources (``power_model``).

    python -m load.bench.energy --references --sweep --out results/energy.json   # ~1 min CPU
    python -m load.bench.energy --quick                          # seconds; the figures mean nothing

The full-stack counterpart (agents, feeds, Envoy, the peer router) is :mod:`load.bench.energy_stack`.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from contracts.digest import block_digests, chain_seed
from contracts.events import EndpointId, Power
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.fleet import EndpointState
from extproc.scheduling.energy import EnergyModel
from extproc.scheduling.interface import CycleState, SchedulingRequest
from extproc.scheduling.predict import TTFTPredictor
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile, parse_scheduling
from load.bench import machine, percentile, revision
from load.sim.engine import Engine, EngineConfig, Step
from load.sim.power import GPU_CLASSES, PowerModel, describe
from load.sim.timing import TimingModel

MODEL = "bench"
TARGETS = ("kvgate-power", "kvgate", "round-robin", "least-loaded")
#: Reference points, not routers (they know the power model): ``pack`` sends each request to the most
#: efficient GPU at full load (the capped A100, capped H100, A100, H100) that runs fewer than
#: ``max_num_seqs`` requests; ``kvgate-efficient-two`` is kvgate's default profile over the two capped
#: replicas only (the other two idle). They bound what consolidation can save in this model.
REFERENCES = ("pack", "kvgate-efficient-two")
#: The sweep's variants: a Config field and the factors applied to its default.
SWEEP = (
    ("idle_scale", (0.5, 2.0)),
    ("floor", (0.5, 2.0)),
    ("a100_speed_scale", (0.5, 2.0)),
    ("cap_scale", (0.5, 2.0)),
    ("step_scale", (0.5, 2.0)),
    ("prefill_scale", (0.5, 2.0)),
)


@dataclass(frozen=True, slots=True)
class Config:
    """Fleet (GPU class and cap per replica), workload and loads (requests/s), run length (s)."""

    gpus: tuple[str, ...] = ("h100", "h100", "a100", "a100")
    caps_w: tuple[float | None, ...] = (None, 450.0, None, 250.0)
    loads_rps: tuple[float, ...] = (5.0, 20.0)
    duration_s: float = 60.0
    groups: int = 16
    prefix_tokens: int = 1024
    question_tokens: int = 128
    output_tokens: int = 256
    power_weight: float = 4.0
    #: kvgate-power's energy scorer: ``marginal-energy`` (busy increment or idle wake-up, consolidating
    #: within the TTFT target) or ``power`` (the straight-line J/token fit x headroom).
    power_scorer: str = "marginal-energy"
    #: ``marginal-energy``'s ``ttft_target_s``, ``ttft_ratio`` and ``scale_j`` (``None``: its defaults).
    #: The target is an SLO input: here about 1.6x kvgate's TTFT p90 in this simulation (0.031 s at 5
    #: req/s); the full-stack benchmark uses the scorer's default 0.25 s (BENCHMARKS.md has both).
    ttft_target_s: float | None = 0.05
    ttft_ratio: float | None = None
    scale_j: float | None = None
    #: kvgate-power's ``power-cap`` filter ``throttled`` param: ``False`` acts on watts against the cap
    #: only (with its hysteresis), not on the clocks-throttled bit, which one capped prefill step sets for
    #: a whole 1-second reading (BENCHMARKS.md: with it, the capped GPUs dropped out at 5 req/s).
    cap_throttled: bool = False
    block_size: int = 16
    seed: int = 7
    #: The simulator's key parameters (the sweep halves and doubles each): as multiples of their defaults,
    #: every GPU's idle draw, the A100's speed (the gap between the efficiency classes), the power caps,
    #: the decode step (base and per-sequence cost) and the prefill time per token; ``floor`` itself.
    idle_scale: float = 1.0
    floor: float = 0.35
    a100_speed_scale: float = 1.0
    cap_scale: float = 1.0
    step_scale: float = 1.0
    prefill_scale: float = 1.0


@dataclass(slots=True)
class Replica:
    engine: Engine
    state: EndpointState
    step: Step | None = None
    energy_j: float = 0.0
    tokens: int = 0
    capped_s: float = 0.0
    #: The engine's time-to-first-token histogram (sum of seconds, count), as a scrape reads it.
    ttft_sum: float = 0.0
    ttft_count: int = 0
    ttfts: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Outcome:
    ttfts: list[float] = field(default_factory=list)
    output_tokens: int = 0


def scheduling(
    power_weight: float | None,
    scorer: str = "power",
    params: Mapping[str, Any] | None = None,
    cap_params: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The default scheduling section as a dict: with the ``scorer`` (``power`` or ``marginal-energy``)
    at ``power_weight`` (the ``power-cap`` filter kept), or (``None``) without the scorer and without the
    ``power-cap`` filter (kvgate before issue 20). ``params``: the scorer's params; ``cap_params``: the
    ``power-cap`` filter's."""
    profile = DEFAULT_SCHEDULING.profiles[0]
    refs: list[dict[str, Any]] = []
    for r in profile.plugins:
        if r.ref == "power-cap" and power_weight is None:
            continue
        if r.ref == "max-score" and power_weight is not None:
            refs.append({"ref": scorer, "weight": power_weight})
        refs.append({"ref": r.ref} if r.weight is None else {"ref": r.ref, "weight": r.weight})
    plugins: list[dict[str, Any]] = []
    for p in DEFAULT_SCHEDULING.plugins:
        entry: dict[str, Any] = {"type": p.type, "name": p.name}
        if p.name == scorer and params:
            entry["params"] = dict(params)
        if p.name == "power-cap" and cap_params:
            entry["params"] = dict(cap_params)
        plugins.append(entry)
    return {
        "plugins": plugins,
        "profiles": [{"name": profile.name, "plugins": refs}],
    }


def power_scheduling(config: Config, weight: float | None) -> dict[str, Any]:
    """kvgate-power's scheduling section (``weight``) or kvgate's (``None``) from the config's scorer,
    its params and the ``power-cap`` filter's ``throttled``."""
    if config.power_scorer != "marginal-energy":
        return scheduling(weight, config.power_scorer, None, {"throttled": config.cap_throttled})
    params = {
        k: v
        for k, v in (
            ("ttft_target_s", config.ttft_target_s),
            ("ttft_ratio", config.ttft_ratio),
            ("scale_j", config.scale_j),
        )
        if v is not None
    }
    return scheduling(weight, config.power_scorer, params, {"throttled": config.cap_throttled})


def power_models(config: Config) -> dict[str, PowerModel]:
    """Each replica's power model (its id: ``<gpu>-<i>``), the config's scales applied."""
    models = {}
    for i, (name, cap) in enumerate(zip(config.gpus, config.caps_w, strict=True)):
        gpu = GPU_CLASSES[name]
        speed = gpu.speed * (config.a100_speed_scale if name == "a100" else 1.0)
        gpu = replace(gpu, idle_w=gpu.idle_w * config.idle_scale, speed=speed)
        models[f"{name}-{i}"] = PowerModel(gpu, None if cap is None else cap * config.cap_scale, config.floor)
    return models


def timing(config: Config) -> TimingModel:
    t = TimingModel()
    return replace(
        t,
        base_s=t.base_s * config.step_scale,
        decode_s_per_seq=t.decode_s_per_seq * config.step_scale,
        prefill_s_per_token=t.prefill_s_per_token * config.prefill_scale,
    )


def _fleet(config: Config) -> list[Replica]:
    replicas = []
    for i, power in enumerate(power_models(config).values()):
        gpu = config.gpus[i]
        engine = Engine(
            EngineConfig(block_size=config.block_size), timing(config), chain_seed(MODEL), power=power
        )
        ep = Endpoint(EndpointId(f"{gpu}-{i}"), f"127.0.0.1:{9000 + i}", frozenset({MODEL}), node=f"node-{i}")
        replicas.append(Replica(engine, EndpointState(ep)))
    return replicas


def _telemetry(replicas: Sequence[Replica], model: EnergyModel, now: float, period_s: float) -> None:
    """What the agents' feeds would tell the gateway about the last ``period_s`` seconds."""
    for r in replicas:
        power, meter = r.engine.power, r.engine.meter
        assert power is not None and meter is not None
        energy, tokens, capped = meter.energy_j(now), r.engine.stats.generation_tokens, meter.capped_s
        watts = (energy - r.energy_j) / period_s
        tps = (tokens - r.tokens) / period_s
        throttled = capped > r.capped_s
        r.energy_j, r.tokens, r.capped_s = energy, tokens, capped
        reading = Power("dcgm", "dcgm", watts=watts, limit_w=power.limit_w, throttled=throttled, at=now)
        node = r.state.endpoint.node or r.state.id
        r.state.power, r.state.output_tps = (reading,), tps
        model.observe(node, watts, tps, now, reading_at=now, running=float(r.engine.num_running))
        r.state.energy_per_token = model.marginal(node, watts, tps)
        r.state.power_curve = model.curve(node)


def run_one(config: Config, target: str, rps: float) -> dict[str, Any]:
    """One target at one load: the figures of the module docstring."""
    rng = random.Random(config.seed)
    replicas = _fleet(config)
    prefixes = [
        [rng.randrange(1000, 30000) for _ in range(config.prefix_tokens)] for _ in range(config.groups)
    ]
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rps)
        if t >= config.duration_s:
            break
        arrivals.append(t)
    weight = config.power_weight if target == "kvgate-power" else None
    profile = build_profile(parse_scheduling(power_scheduling(config, weight)))
    pick_rng, energy_model, outcome = random.Random(config.seed), EnergyModel(), Outcome()
    predictor = TTFTPredictor()
    events: list[tuple[float, int, int]] = [(a, 0, i) for i, a in enumerate(arrivals)]  # (time, kind, index)
    events += [(float(s), 1, -1) for s in range(1, int(config.duration_s * 3))]  # telemetry every second
    heapq.heapify(events)
    order = itertools.count()
    seed = chain_seed(MODEL)
    ended = 0.0
    while events:
        now, kind, index = heapq.heappop(events)
        if kind == 1:
            if now > config.duration_s and not any(r.engine.has_work() for r in replicas):
                continue
            _telemetry(replicas, energy_model, now, 1.0)
            continue
        if kind == 2:  # a replica's step ended
            r = replicas[index]
            step, r.step = r.step, None
            assert step is not None
            for ev in r.engine.complete(step):
                outcome.output_tokens += len(ev.token_ids)
                if ev.ttft_s is not None:
                    outcome.ttfts.append(ev.ttft_s)
                    r.ttft_sum += ev.ttft_s
                    r.ttft_count += 1
                    r.ttfts.append(ev.ttft_s)
            ended = max(ended, now)
        else:  # an arrival
            prompt = [
                *prefixes[rng.randrange(config.groups)],
                *(rng.randrange(1000, 30000) for _ in range(config.question_tokens)),
            ]
            n = next(order)
            index = _route(
                target, replicas, profile, prompt, seed, config.block_size, now, n, pick_rng, predictor
            )
            replicas[index].engine.add_request(f"r{n}", prompt, [7] * config.output_tokens, now)
        r = replicas[index]
        if r.step is None:
            r.step = r.engine.schedule(now)
            if r.step is not None:
                heapq.heappush(events, (r.step.end, 2, index))
    for r in replicas:
        r.state.power = ()
    total_j = sum(r.engine.meter.energy_j(ended) for r in replicas if r.engine.meter is not None)
    capped = sum(r.engine.meter.capped_s for r in replicas if r.engine.meter is not None)
    return {
        "target": target,
        "load_rps": rps,
        "requests": len(arrivals),
        "completed": len(outcome.ttfts),
        "joules_per_token": total_j / max(1, outcome.output_tokens),
        "ttft_p90_s": _p90(outcome.ttfts),
        "output_tokens_per_s": outcome.output_tokens / max(ended, 1e-9),
        "time_at_cap_s": capped,
        "share_per_replica": [r.engine.stats.requests_finished for r in replicas],
        "ttft_p90_per_replica_s": [_p90(r.ttfts) for r in replicas],
    }


def _p90(values: Sequence[float]) -> float | None:
    """The 90th percentile by the rule every load bench uses (:func:`load.bench.percentile`: linear
    interpolation between ranks, as ``energy_stack`` computes it); ``None`` without values."""
    return percentile(sorted(values), 90) if values else None


def _route(
    target: str,
    replicas: Sequence[Replica],
    profile: Any,
    prompt: Sequence[int],
    seed: Any,
    block_size: int,
    now: float,
    n: int,
    rng: random.Random,
    predictor: TTFTPredictor,
) -> int:
    if target == "round-robin":
        return n % len(replicas)
    if target == "least-loaded":
        loads = [r.engine.num_running + r.engine.num_waiting for r in replicas]
        return loads.index(min(loads))
    if target == "pack":
        return _pack(replicas)
    digests = block_digests(seed, prompt, block_size)
    for r in replicas:  # a fresh scrape
        e = r.engine
        r.state.metrics = EngineMetrics(
            float(e.num_waiting), float(e.num_running), e.kv_usage, now, r.ttft_sum, float(r.ttft_count)
        )
    candidates = list(replicas)
    if target == "kvgate-efficient-two":
        candidates = [r for r in replicas if r.engine.power is not None and r.engine.power.cap_w is not None]
    matched = {r.state.id: r.engine.cache.match(digests) for r in candidates}
    uncached = {k: max(0, len(prompt) - v * block_size) for k, v in matched.items()}
    predicted = (
        {r.state.id: predictor.predict(r.state, uncached[r.state.id], now) for r in candidates}
        if profile.predicts
        else {}
    )
    state = CycleState(prefix_blocks=matched, exact=True, predicted_ttft=predicted)
    request = SchedulingRequest(f"r{n}", MODEL, digests, len(prompt), now)
    result = profile.schedule(request, state, [r.state for r in candidates], rng)
    picked = result.endpoints[0]
    if profile.predicts:
        predictor.routed(f"r{n}", picked, uncached[picked.id], now)
    return next(i for i, r in enumerate(replicas) if r.state.id == picked.id)


def _pack(replicas: Sequence[Replica]) -> int:
    """The ``pack`` reference: the GPU with the lowest watts per unit of speed at full load (capped)
    that runs fewer than ``max_num_seqs`` requests, else the least loaded."""

    def full_load_w_per_speed(r: Replica) -> float:
        power = r.engine.power
        assert power is not None
        watts, ratio = power.step(1, 0, 1, 1)
        return watts / (power.gpu.speed * ratio)

    loads = [r.engine.num_running + r.engine.num_waiting for r in replicas]
    for i in sorted(range(len(replicas)), key=lambda i: full_load_w_per_speed(replicas[i])):
        if loads[i] < replicas[i].engine.config.max_num_seqs:
            return i
    return loads.index(min(loads))


def over(value: float | None, baseline: float | None) -> float:
    """``value / baseline``; NaN (a goal not met, JSON ``null``) when either is missing or the baseline is
    not positive: a figure without its baseline is not a ratio."""
    if value is None or baseline is None or baseline <= 0:
        return float("nan")
    return value / baseline


def cut(value: float, baseline: float) -> float:
    """How much of ``baseline`` ``value`` cut (``1 - value / baseline``); NaN when the baseline is not
    positive (nothing to cut: not a met 100 %)."""
    return 1 - over(value, baseline)


def goals(cells: Sequence[Mapping[str, Any]], loads: Sequence[float]) -> dict[str, Any]:
    """Per load, the issue's three ratios (kvgate-power against round robin and against kvgate) and
    whether each goal is met, and whether kvgate-power has the lowest J/token of the routers."""
    summary: dict[str, Any] = {}
    for rps in loads:
        by = {c["target"]: c for c in cells if c["load_rps"] == rps and "joules_per_token" in c}
        if not {"kvgate-power", "round-robin", "kvgate"} <= by.keys():
            continue
        power, rr, plain = by["kvgate-power"], by["round-robin"], by["kvgate"]
        vs_rr = rr["joules_per_token"] / power["joules_per_token"]
        ttft = over(power["ttft_p90_s"], plain["ttft_p90_s"])
        cut_plain = cut(power["time_at_cap_s"], plain["time_at_cap_s"])
        cut_rr = cut(power["time_at_cap_s"], rr["time_at_cap_s"])
        routers = [t for t in by if t not in REFERENCES]
        summary[str(rps)] = {
            "j_per_token_vs_round_robin": vs_rr,
            "j_per_token_vs_kvgate": plain["joules_per_token"] / power["joules_per_token"],
            "ttft_p90_vs_kvgate": ttft,
            "time_at_cap_cut": cut_plain,
            "time_at_cap_cut_vs_round_robin": cut_rr,
            "met": {"j_per_token": vs_rr >= 1.5, "ttft_p90": ttft <= 1.1, "time_at_cap": cut_plain >= 0.9},
            "lowest_j_per_token": min(routers, key=lambda t: by[t]["joules_per_token"]),
            "j_per_token_order": sorted(routers, key=lambda t: by[t]["joules_per_token"]),
        }
    return summary


def sweep(config: Config, targets: Sequence[str]) -> list[dict[str, Any]]:
    """Each key parameter halved and doubled (:data:`SWEEP`), every target at every load: the goals'
    ratios per variant and whether the base run's J/token order of the routers holds."""
    base = run_variant(config, targets)
    rows = []
    for name, factors in SWEEP:
        for factor in factors:
            varied = replace(config, **{name: getattr(config, name) * factor})
            got = run_variant(varied, targets)
            row: dict[str, Any] = {"parameter": name, "factor": factor, "value": getattr(varied, name)}
            for load, s in got.items():
                row[load] = {
                    **{
                        k: s[k]
                        for k in ("j_per_token_vs_round_robin", "ttft_p90_vs_kvgate", "time_at_cap_cut")
                    },
                    "met": s["met"],
                    "j_per_token_order": s["j_per_token_order"],
                    "order_holds": s["j_per_token_order"] == base[load]["j_per_token_order"],
                    "kvgate_power_lowest": s["lowest_j_per_token"] == "kvgate-power",
                }
            rows.append(row)
    return rows


def run_variant(config: Config, targets: Sequence[str]) -> dict[str, Any]:
    cells = [run_one(config, target, rps) for rps in config.loads_rps for target in targets]
    return goals(cells, config.loads_rps)


def run(
    config: Config, targets: Sequence[str] = TARGETS, references: bool = False, with_sweep: bool = False
) -> dict[str, Any]:
    started = time.monotonic()
    names = [*targets, *(REFERENCES if references else ())]
    cells = [run_one(config, target, rps) for rps in config.loads_rps for target in names]
    result: dict[str, Any] = {
        "benchmark": "energy",
        "machine": machine(),
        "revision": revision(),
        "config": asdict(config),
        "power_model": describe(power_models(config)),
        "timing_model": asdict(timing(config)),
        "cells": cells,
        "summary": goals(cells, config.loads_rps),
    }
    if with_sweep:
        result["sweep"] = sweep(config, [t for t in targets if t not in REFERENCES])
    result["wall_s"] = time.monotonic() - started
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m load.bench.energy", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the result JSON here")
    p.add_argument("--quick", action="store_true", help="a few seconds of traffic (a smoke run)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument(
        "--power-weight", type=float, default=Config().power_weight, help="kvgate-power's weights/power"
    )
    p.add_argument(
        "--power-scorer",
        default=Config().power_scorer,
        choices=("marginal-energy", "power"),
        help="kvgate-power's energy scorer",
    )
    p.add_argument("--ttft-target", type=float, help="marginal-energy's ttft_target_s (default: its own)")
    p.add_argument("--references", action="store_true", help=f"also run {', '.join(REFERENCES)} (bounds)")
    p.add_argument("--sweep", action="store_true", help="halve and double each key sim parameter")
    args = p.parse_args(argv)
    config = Config(power_weight=args.power_weight, power_scorer=args.power_scorer)
    if args.ttft_target is not None:
        config = replace(config, ttft_target_s=args.ttft_target)
    if args.quick:
        config = replace(config, duration_s=10.0, loads_rps=(2.0,))
    result = run(config, [t for t in args.targets.split(",") if t], args.references, args.sweep)
    result["command"] = " ".join(
        ["python -m load.bench.energy", *(argv if argv is not None else sys.argv[1:])]
    )
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    for c in result["cells"]:
        print(
            f"{c['load_rps']:>5} req/s {c['target']:<13} {c['joules_per_token']:.3f} J/token  "
            f"TTFT p90 {c['ttft_p90_s'] or 0:.3f} s  {c['output_tokens_per_s']:.0f} tok/s  "
            f"at cap {c['time_at_cap_s']:.1f} s  shares {c['share_per_replica']}"
        )
    print(json.dumps(result["summary"], indent=2))
    for row in result.get("sweep", ()):
        for load in (str(r) for r in config.loads_rps):
            g = row.get(load)
            if g:
                print(
                    f"sweep {row['parameter']} x{row['factor']:g} @ {load} req/s: J/token vs RR "
                    f"{g['j_per_token_vs_round_robin']:.2f}, TTFT vs kvgate {g['ttft_p90_vs_kvgate']:.2f}, "
                    f"cap cut {g['time_at_cap_cut']:.2f}, order {','.join(g['j_per_token_order'])}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
