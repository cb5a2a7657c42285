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

    python -m load.bench.energy --out results/energy.json        # ~1 min on a 2-core VM
    python -m load.bench.energy --quick                          # seconds; the figures mean nothing
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from contracts.digest import block_digests, chain_seed
from contracts.events import EndpointId, Power
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.control.policy import PolicyStore
from extproc.fleet import EndpointState
from extproc.scheduling.energy import EnergyModel
from extproc.scheduling.interface import CycleState, SchedulingRequest
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile
from load.bench import machine, revision
from load.sim.engine import Engine, EngineConfig, Step
from load.sim.power import GPU_CLASSES, PowerModel
from load.sim.timing import TimingModel

MODEL = "bench"
TARGETS = ("kvgate-power", "kvgate", "round-robin", "least-loaded")


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
    power_weight: float = 1.0
    block_size: int = 16
    seed: int = 7


@dataclass(slots=True)
class Replica:
    engine: Engine
    state: EndpointState
    step: Step | None = None
    energy_j: float = 0.0
    tokens: int = 0
    capped_s: float = 0.0


@dataclass(slots=True)
class Outcome:
    ttfts: list[float] = field(default_factory=list)
    output_tokens: int = 0


def _fleet(config: Config) -> list[Replica]:
    replicas = []
    for i, (gpu, cap) in enumerate(zip(config.gpus, config.caps_w, strict=True)):
        engine = Engine(
            EngineConfig(block_size=config.block_size),
            TimingModel(),
            chain_seed(MODEL),
            power=PowerModel(GPU_CLASSES[gpu], cap),
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
        model.observe(node, watts, tps, now, reading_at=now)
        r.state.energy_per_token = model.marginal(node, watts, tps)


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
    store = PolicyStore(DEFAULT_SCHEDULING)
    if target == "kvgate-power":
        store.put("weights/power", json.dumps(config.power_weight).encode())
    else:
        store.put("plugins/power-cap/throttled", b"false")
        store.put("plugins/power-cap/cap_margin", b"0")
    profile = build_profile(store.policy.scheduling)
    pick_rng, energy_model, outcome = random.Random(config.seed), EnergyModel(), Outcome()
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
            ended = max(ended, now)
        else:  # an arrival
            prompt = [
                *prefixes[rng.randrange(config.groups)],
                *(rng.randrange(1000, 30000) for _ in range(config.question_tokens)),
            ]
            n = next(order)
            index = _route(target, replicas, profile, prompt, seed, config.block_size, now, n, pick_rng)
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
    ttfts = sorted(outcome.ttfts)
    return {
        "target": target,
        "load_rps": rps,
        "requests": len(arrivals),
        "completed": len(ttfts),
        "joules_per_token": total_j / max(1, outcome.output_tokens),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
        "output_tokens_per_s": outcome.output_tokens / max(ended, 1e-9),
        "time_at_cap_s": capped,
        "share_per_replica": [r.engine.stats.requests_finished for r in replicas],
    }


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
) -> int:
    if target == "round-robin":
        return n % len(replicas)
    if target == "least-loaded":
        loads = [r.engine.num_running + r.engine.num_waiting for r in replicas]
        return loads.index(min(loads))
    digests = block_digests(seed, prompt, block_size)
    for r in replicas:  # a fresh scrape
        e = r.engine
        r.state.metrics = EngineMetrics(float(e.num_waiting), float(e.num_running), e.kv_usage, now)
    state = CycleState(
        prefix_blocks={r.state.id: r.engine.cache.match(digests) for r in replicas}, exact=True
    )
    request = SchedulingRequest(f"r{n}", MODEL, digests, len(prompt), now)
    result = profile.schedule(request, state, [r.state for r in replicas], rng)
    picked = result.endpoints[0].id
    return next(i for i, r in enumerate(replicas) if r.state.id == picked)


def run(config: Config, targets: Sequence[str] = TARGETS) -> dict[str, Any]:
    started = time.monotonic()
    cells = [run_one(config, target, rps) for rps in config.loads_rps for target in targets]
    summary: dict[str, Any] = {}
    for rps in config.loads_rps:
        by = {c["target"]: c for c in cells if c["load_rps"] == rps}
        if "kvgate-power" in by and "round-robin" in by and "kvgate" in by:
            power, rr, plain = by["kvgate-power"], by["round-robin"], by["kvgate"]
            summary[str(rps)] = {
                "j_per_token_vs_round_robin": rr["joules_per_token"] / power["joules_per_token"],
                "j_per_token_vs_kvgate": plain["joules_per_token"] / power["joules_per_token"],
                "ttft_p90_vs_kvgate": (power["ttft_p90_s"] or 0) / max(plain["ttft_p90_s"] or 1e-9, 1e-9),
                "time_at_cap_cut": 1 - power["time_at_cap_s"] / max(plain["time_at_cap_s"], 1e-9),
            }
    return {
        "benchmark": "energy",
        "machine": machine(),
        "revision": revision(),
        "config": asdict(config),
        "cells": cells,
        "summary": summary,
        "wall_s": time.monotonic() - started,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m load.bench.energy", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the result JSON here")
    p.add_argument("--quick", action="store_true", help="a few seconds of traffic (a smoke run)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument(
        "--power-weight", type=float, default=Config().power_weight, help="kvgate-power's weights/power"
    )
    args = p.parse_args(argv)
    config = Config(power_weight=args.power_weight)
    if args.quick:
        config = replace(config, duration_s=10.0, loads_rps=(2.0,))
    result = run(config, [t for t in args.targets.split(",") if t])
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
