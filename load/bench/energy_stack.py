"""Energy-aware routing, full stack (issue 20): five targets side by side over one heterogeneous fleet of
simulated engines run by node agents, at two loads, energy read from the engines' dcgm-exporter endpoints.

    python -m load.bench.energy_stack --out results/energy-stack.json     # ~12 min on a 2-core VM
    python -m load.bench.energy_stack --quick --out /tmp/energy-stack.json  # 1-2 min; figures mean nothing

Fleet: ``kvgate up --agents 4 --gpu h100,h100,a100,a100 --power-cap-w 0,450,0,250`` as a
:class:`kvgate.dev.up.Stack`: a local etcd, four node agents each supervising one simulated engine
(``load.sim``) with that GPU's power model (``load/sim/README.md``, "Power model"), each agent reading its
engine's dcgm-exporter endpoint every second (``[[power]] kind = "dcgm"``) and sending the readings with
its load on its feed to the gateway. The model's parameters and their sources are in the result
(``power_model``), as the simulated-time benchmark (:mod:`load.bench.energy`) states them.

Targets, per load, each over a fleet whose prefix caches were reset:

* ``kvgate-power``: Envoy + the ext_proc, the default profile plus the ``marginal-energy`` scorer (or,
  with ``--power-scorer power``, the ``power`` scorer) at ``--power-weight``, its ``power-cap`` filter
  acting on watts with hysteresis (``throttled`` off), on a stack of its own (started and stopped
  for the cell, so its energy model starts cold, as every target does);
* ``kvgate``: the default profile without the ``power`` scorer and without the ``power-cap`` filter
  (kvgate before issue 20), on a second stack whose engines then serve the three below;
* ``round-robin`` / ``least-loaded``: plain Envoy (``ROUND_ROBIN`` / ``LEAST_REQUEST``) over those engines;
* ``sglang-router``: the peer (``--policy cache_aware``, :mod:`load.bench.peers`); skipped with the
  reason when it cannot be installed or started.

Workload: shared prefix (:class:`load.workloads.shapes.SharedPrefix`: ``groups`` system prompts of
``prefix`` tokens, ``users`` questions of ``question`` tokens each, ``output`` tokens out), Poisson
arrivals for ``duration_s`` at each load, every request streamed, the same requests for every target.

Figures per cell: ``joules_per_token``: every engine's energy over the cell (its
``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` counter, the integral of its draw, read just before the first
request and just after the last one ended; idle included) over the output tokens served; TTFT p90;
output tokens/s (served tokens over the cell's wall time); ``time_over_cap_s``: replica-seconds the cap
held clocks down (the ``DCGM_FI_DEV_POWER_VIOLATION`` counters' growth). ``goals`` per load: the issue's
three ratios. One run of each, no repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from engines.gguf import ensure_model_dir, smollm2_gguf_path
from kvgate.dev.options import DEFAULT_MODEL, StackOptions
from kvgate.dev.procs import ChildFailed
from kvgate.dev.up import Stack
from load.bench import machine, peers, percentile, revision, skipped
from load.bench import targets as tg
from load.bench.energy import Config as SimTimeConfig
from load.bench.energy import cut as cut_of
from load.bench.energy import over, power_models, power_scheduling
from load.client import FixedRoute, LoadOptions, RunResult, run_load
from load.sim.power import describe
from load.sim.server import DCGM_PATH
from load.sim.timing import TimingModel
from load.workloads.session import Session, poisson_arrivals
from load.workloads.shapes import SharedPrefix
from load.workloads.text import TokenText

log = logging.getLogger("load.bench.energy_stack")

TARGETS = ("kvgate-power", "kvgate", "round-robin", "least-loaded", "sglang-router")
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
VIOLATION = "DCGM_FI_DEV_POWER_VIOLATION"


@dataclass(frozen=True, slots=True)
class StackConfig:
    """Fleet (GPU class and cap per node, 0: none), workload, loads (requests/s), run lengths (s)."""

    gpus: tuple[str, ...] = ("h100", "h100", "a100", "a100")
    caps_w: tuple[float, ...] = (0.0, 450.0, 0.0, 250.0)
    loads_rps: tuple[float, ...] = (5.0, 20.0)
    duration_s: float = 45.0
    drain_s: float = 60.0
    groups: int = 16
    prefix: int = 1024
    users: int = 32
    question: int = 128
    output: int = 256
    power_weight: float = 4.0
    #: kvgate-power's energy scorer, its ``ttft_target_s`` (``None``: the scorer's default, 0.25 s; kvgate's
    #: own TTFT p90 here was 0.04-0.17 s, by machine load) and the ``power-cap`` filter's ``throttled``
    #: (:class:`load.bench.energy.Config` says why off).
    power_scorer: str = "marginal-energy"
    ttft_target_s: float | None = None
    cap_throttled: bool = False
    seed: int = 7


def quick_config() -> StackConfig:
    return replace(
        StackConfig(), gpus=("h100", "a100"), caps_w=(0.0, 250.0), loads_rps=(2.0,), duration_s=4.0, output=16
    )


def start_stack(config: StackConfig, power_weight: float | None, workdir: Path) -> Stack:
    options = StackOptions(
        port=0,
        agents=len(config.gpus),
        gpus=config.gpus,
        power_caps_w=config.caps_w,
        scheduling=power_scheduling(
            replace(
                SimTimeConfig(),
                power_scorer=config.power_scorer,
                ttft_target_s=config.ttft_target_s,
                cap_throttled=config.cap_throttled,
            ),
            power_weight,
        ),
        workdir=workdir,
    )
    stack = Stack(options)
    try:
        stack.start()
    except BaseException:
        stack.stop()
        raise
    return stack


def read_dcgm(address: str) -> tuple[float, float]:
    """An engine's energy counter (J) and power-violation counter (s) from its exporter."""
    with urllib.request.urlopen(f"http://{address}{DCGM_PATH}", timeout=5) as resp:
        text = resp.read().decode()
    energy_j = violation_s = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(ENERGY):
                energy_j = sample.value / 1000.0
            elif sample.name.startswith(VIOLATION):
                violation_s = sample.value / 1e6
    return energy_j, violation_s


def make_sessions(config: StackConfig, text: TokenText, rps: float) -> list[Session]:
    shape = SharedPrefix(config.groups, config.prefix, config.users, config.question, config.output)
    arrivals = poisson_arrivals(rps, config.duration_s, random.Random(f"{config.seed}-{rps}"))
    return shape.sessions(text, arrivals, config.seed)


def measure(
    name: str, url: str, addresses: Sequence[str], sessions: list[Session], config: StackConfig, rps: float
) -> dict[str, Any]:
    """One cell: counters before, the load, counters after (module docstring)."""
    tg.reset_caches(addresses, timeout_s=60.0)
    before = [read_dcgm(a) for a in addresses]
    load_before = os.getloadavg()[0]
    options = LoadOptions(DEFAULT_MODEL, duration_s=config.duration_s, drain_s=config.drain_s, progress=False)
    result: RunResult = asyncio.run(run_load(sessions, FixedRoute(url), options))
    after = [read_dcgm(a) for a in addresses]
    ok = [r for r in result.records if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    energy = [e1 - e0 for (e0, _), (e1, _) in zip(before, after, strict=True)]
    capped = [v1 - v0 for (_, v0), (_, v1) in zip(before, after, strict=True)]
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    row = {
        "target": name,
        "load_rps": rps,
        "requests": len(sessions),
        "completed": len(ok),
        "joules_per_token": sum(energy) / max(1, tokens),
        "ttft_p90_s": percentile(ttfts, 90) if ttfts else None,
        "output_tokens_per_s": tokens / result.wall_s if result.wall_s else 0.0,
        "time_over_cap_s": sum(capped),
        "energy_j_per_replica": [round(e, 1) for e in energy],
        "time_over_cap_s_per_replica": [round(c, 2) for c in capped],
        "wall_s": round(result.wall_s, 2),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(
        f"{rps:>5} req/s {name:<14} {row['joules_per_token']:.3f} J/token  TTFT p90 "
        f"{row['ttft_p90_s'] or 0:.3f} s  {row['output_tokens_per_s']:.0f} tok/s  over cap "
        f"{row['time_over_cap_s']:.1f} s  {len(ok)}/{len(sessions)} ok  energy {row['energy_j_per_replica']}",
        file=sys.stderr,
        flush=True,
    )
    return row


def run_load_level(
    config: StackConfig, rps: float, names: Sequence[str], text: TokenText, workdir: Path
) -> list[dict[str, Any]]:
    """Every target at one load (module docstring: which stack serves which)."""
    sessions = make_sessions(config, text, rps)
    rows: list[dict[str, Any]] = []
    if "kvgate-power" in names:
        stack = start_stack(config, config.power_weight, workdir / f"{rps:g}" / "kvgate-power")
        try:
            addresses = [e["address"] for e in stack.engines]
            rows.append(measure("kvgate-power", stack.url, addresses, sessions, config, rps))
        finally:
            stack.stop()
    others = [n for n in names if n != "kvgate-power"]
    if not others:
        return rows
    base = workdir / f"{rps:g}" / "kvgate"
    stack = start_stack(config, None, base)
    try:
        addresses = [e["address"] for e in stack.engines]
        for name in others:
            if name == "kvgate":
                rows.append(measure(name, stack.url, addresses, sessions, config, rps))
                continue
            running: tg.Running | None = None
            try:
                (base / name).mkdir(parents=True, exist_ok=True)
                if name in ("round-robin", "least-loaded"):
                    policy = "ROUND_ROBIN" if name == "round-robin" else "LEAST_REQUEST"
                    child, url = tg.start_baseline_envoy(base / name, addresses, policy)
                    running = tg.Running(FixedRoute(url), [child])
                elif name in peers.PEERS:
                    spec = peers.PEERS[name]
                    child, url = peers.launch(
                        spec, peers.install(spec), [f"http://{a}" for a in addresses], base
                    )
                    running = tg.Running(FixedRoute(url), [child])
                else:
                    raise tg.TargetUnavailable(f"unknown target {name!r}")
                rows.append(measure(name, url, addresses, sessions, config, rps))
            except (tg.TargetUnavailable, peers.PeerUnavailable, ChildFailed) as exc:
                rows.append(skipped(name, exc, log, load_rps=rps))
            finally:
                if running is not None:
                    running.stop()
    finally:
        stack.stop()
    return rows


def goals(cells: Sequence[Mapping[str, Any]], loads: Sequence[float]) -> dict[str, Any]:
    """Per load: J/token of kvgate-power against round robin (goal >= 1.5x), TTFT p90 against kvgate
    (<= 1.1x), time over the cap cut against kvgate and round robin (>= 90 %)."""
    out: dict[str, Any] = {}
    for rps in loads:
        by = {c["target"]: c for c in cells if c["load_rps"] == rps and "joules_per_token" in c}
        if not {"kvgate-power", "kvgate", "round-robin"} <= by.keys():
            continue
        power, plain, rr = by["kvgate-power"], by["kvgate"], by["round-robin"]
        vs_rr = rr["joules_per_token"] / power["joules_per_token"]
        ttft = over(power["ttft_p90_s"], plain["ttft_p90_s"])
        cut = cut_of(power["time_over_cap_s"], plain["time_over_cap_s"])
        cut_rr = cut_of(power["time_over_cap_s"], rr["time_over_cap_s"])
        out[f"{rps:g}"] = {
            "j_per_token_vs_round_robin": {"value": round(vs_rr, 3), "goal": ">= 1.5", "met": vs_rr >= 1.5},
            "j_per_token_vs_kvgate": round(plain["joules_per_token"] / power["joules_per_token"], 3),
            "ttft_p90_vs_kvgate": {"value": round(ttft, 3), "goal": "<= 1.1", "met": ttft <= 1.1},
            "time_over_cap_cut_vs_kvgate": {"value": round(cut, 3), "goal": ">= 0.9", "met": cut >= 0.9},
            "time_over_cap_cut_vs_round_robin": round(cut_rr, 3),
            "j_per_token_order": sorted(by, key=lambda t: by[t]["joules_per_token"]),
        }
    return out


def power_model(config: StackConfig) -> dict[str, Any]:
    """The fleet's power model as :func:`load.sim.power.describe` states it, with the timing model."""
    caps = tuple(None if c <= 0 else c for c in config.caps_w)
    models = power_models(SimTimeConfig(gpus=config.gpus, caps_w=caps))
    return {**describe(models), "timing_model": asdict(TimingModel())}


def run(config: StackConfig, names: Sequence[str], workdir: Path) -> dict[str, Any]:
    started = time.monotonic()
    text = TokenText.from_model_dir(ensure_model_dir(smollm2_gguf_path()))
    cells: list[dict[str, Any]] = []
    for rps in config.loads_rps:
        cells += run_load_level(config, rps, names, text, workdir)
    return {
        "benchmark": "energy-stack",
        "machine": machine(),
        "revision": revision(),
        "config": asdict(config),
        "power_model": power_model(config),
        "cells": cells,
        "goals": goals(cells, config.loads_rps),
        "wall_s": round(time.monotonic() - started, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m load.bench.energy_stack", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, help="write the result JSON here")
    p.add_argument(
        "--quick", action="store_true", help="two nodes, one load, seconds of traffic (a smoke run)"
    )
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--power-weight", type=float, default=StackConfig().power_weight, help="kvgate-power's")
    p.add_argument("--power-scorer", default=StackConfig().power_scorer, choices=("marginal-energy", "power"))
    p.add_argument("--ttft-target", type=float, help="marginal-energy's ttft_target_s (default: its own)")
    p.add_argument("--duration", type=float, help="seconds of arrivals per cell")
    p.add_argument("--loads", help="comma-separated requests/s (default 5,20)")
    p.add_argument("--workdir", type=Path, default=Path("results/energy-stack-work"), help="logs, configs")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = quick_config() if args.quick else StackConfig()
    config = replace(
        config, power_weight=args.power_weight, power_scorer=args.power_scorer, ttft_target_s=args.ttft_target
    )
    if args.duration:
        config = replace(config, duration_s=args.duration)
    if args.loads:
        config = replace(config, loads_rps=tuple(float(x) for x in args.loads.split(",")))
    names = [t for t in args.targets.split(",") if t]
    unknown = set(names) - set(TARGETS)
    if unknown:
        p.error(f"unknown targets: {', '.join(sorted(unknown))}")
    result = run(config, names, args.workdir)
    result["command"] = " ".join(
        ["python -m load.bench.energy_stack", *(argv if argv is not None else sys.argv[1:])]
    )
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(json.dumps(result["goals"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
