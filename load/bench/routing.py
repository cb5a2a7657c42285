"""Routing quality: kvgate against round robin, least-loaded, the peer routers and an oracle, one run.

    kvgate bench routing --out results/routing            # default: ~8 min on 2 cores
    kvgate bench routing --full --out results/routing-full
    kvgate bench routing --smoke --out /tmp/smoke          # seconds; what CI runs
    kvgate bench routing --repeats 3 --workloads shared-prefix --loads 24 --out results/routing-r3
                                                           # medians of 3 rounds (noisy machines)
    kvgate bench routing --sweep --out results/routing-sweep  # + the 2x sweep (7x the run's time)

For each workload it starts a simulated fleet (``load.sim``, one process, ``replicas`` replicas) sized
for that workload, then for each load level and each target: resets every replica's prefix cache,
starts the target fresh, sends the same sessions (same seed, so byte-identical requests at the same
times) with :mod:`load.client`, stops the target. Results: ``routing.json`` (every run's metrics and
the goals), ``routing-summary.json`` (the quoted figures: ``python -m load.bench.plots`` draws them),
``routing.md`` (the table), and one PNG per workload and metric.

Fleet capacity (see ``load/sim/README.md`` for the timing model): each replica runs the H100/8B step
model slowed ``time_scale`` times (default 5, so 2 CPU cores can drive 8 replicas and a router), with
``kv_blocks`` 16-token blocks chosen so the fleet's KV is ``kv_fraction`` of the workload's working
set at its highest load (shared-prefix: 0.7, the memory-pressure case; agentic and multi-turn: a
multiple, as those goals are about balance and affinity, not eviction).

``--sweep``: after the run, the same run again with each key parameter of the simulated fleet halved,
then doubled (:func:`load.bench.step_variants`: the prefill rate; the decode step, base and per-sequence cost
together; every scenario's ``kv_fraction``, which decides the hit ratios), each variant ``--repeats``
times. Each variant records its parameters, fleets, goals and kvgate's standing against each peer router
on each goal's metric (:func:`standings`); ``ranking_holds`` when every standing is the reference's (the
main run's), and ``sweep_ranking_holds_all`` when that is so in every variant. ``--sweep-only`` runs the
reference at the unvaried parameters as part of the sweep (``sweep_reference``) and writes routing.json
alone (no table, summary or plots).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from engines.gguf import ensure_model_dir, smollm2_gguf_path
from kvgate.dev.procs import ChildFailed
from kvgate.dev.up import DEFAULT_MODEL
from load.bench import (
    DECODE_STEP,
    TIMING_SOURCES,
    machine,
    ranking_holds_all,
    revision,
    scaled,
    step_args,
    step_variants,
    write_json,
)
from load.bench import report as rep
from load.bench import targets as tg
from load.client import LoadOptions, run_load
from load.workloads import (
    Agentic,
    MultiTurn,
    SharedPrefix,
    Trace,
    Workload,
    read_trace,
    smollm2_text,
    synthesize,
)
from load.workloads.session import Session, closed_arrivals, poisson_arrivals

log = logging.getLogger(__name__)
BLOCK = 16
#: Where the fleet's step-model values come from (the goals are judged on the simulator).
SIM_SOURCES = {
    **TIMING_SOURCES,
    "prefill_tokens_per_s": "20,000 tokens/s at time scale 1: compute-bound prefill, 2 x 8.03 GFLOP a token"
    " at ~30 % of the H100's 989 TFLOPS bf16 peak (load/sim/timing.py, load/sim/README.md)",
    "kv_fraction_scale": "every scenario's kv_fraction (fleet KV blocks over the working set at its highest"
    " load: a benchmark choice, config.scenarios) times this; 1 except in the sweep",
}


@dataclass(frozen=True, slots=True)
class Scenario:
    """One workload at several loads. ``loads``: session arrival rates (per second) in the open loop,
    concurrent sessions in the closed loop. ``duration_s``: arrivals span (open) or how long workers
    start sessions (closed). ``kv_fraction``: fleet KV blocks / working set at the highest load.
    ``warmup_s``: requests sent before this are run but not measured (each target starts cold, and a
    short run's percentiles would otherwise be those of its first requests)."""

    workload: Workload
    loads: tuple[float, ...]
    duration_s: float
    kv_fraction: float
    mode: Literal["open", "closed"] = "open"
    warmup_s: float = 0.0

    @property
    def name(self) -> str:
        """The workload's name, ``-closed`` appended in the closed loop (rows, tables and plots keep the
        two apart: their loads are in different units)."""
        return f"{self.workload.name}-closed" if self.mode == "closed" else self.workload.name


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """A whole benchmark: fleet shape, timing, targets, scenarios; ``drain_s`` bounds each run's tail;
    ``kvgate_scheduling`` replaces kvgate's default scheduling section (for tuning experiments)."""

    scenarios: tuple[Scenario, ...]
    targets: tuple[str, ...] = tg.TARGETS
    replicas: int = 8
    time_scale: float = 5.0
    max_num_seqs: int = 64
    seed: int = 1
    drain_s: float = 90.0
    kvgate_scheduling: dict[str, Any] | None = None
    repeats: int = 1
    #: The step model (the simulator's defaults, :class:`~load.sim.timing.TimingModel`, at time scale 1).
    step_base_ms: float = 6.0
    decode_ms_per_seq: float = 0.15
    prefill_tokens_per_s: float = 20_000.0
    #: Every scenario's ``kv_fraction`` times this (the sweep's third parameter).
    kv_fraction_scale: float = 1.0


def default_config() -> BenchConfig:
    """The short run (under 10 minutes here): shared-prefix open loop at 24 requests/s (TTFT, the high-load
    case) and closed loop at 64 concurrent sessions (output throughput: a saturated fleet's output/s is its
    capacity, while an open loop's is the arrival rate for every router that keeps up), agentic at 2
    sessions/s."""
    return BenchConfig(
        (
            Scenario(SharedPrefix(), (24.0,), 15.0, 0.7, warmup_s=5.0),
            Scenario(SharedPrefix(), (64.0,), 15.0, 0.7, mode="closed", warmup_s=5.0),
            Scenario(Agentic(output=32), (2.0,), 20.0, 3.0, warmup_s=5.0),
        )
    )


def full_config() -> BenchConfig:
    return BenchConfig(
        (
            Scenario(SharedPrefix(), (4.0, 8.0, 12.0, 16.0, 20.0, 24.0), 60.0, 0.7, warmup_s=15.0),
            Scenario(SharedPrefix(), (32.0, 64.0, 128.0), 60.0, 0.7, mode="closed", warmup_s=15.0),
            Scenario(Agentic(output=32), (1.0, 2.0, 3.0), 60.0, 3.0, warmup_s=15.0),
            Scenario(MultiTurn(), (2.0, 4.0), 60.0, 3.0, warmup_s=15.0),
        ),
        drain_s=180.0,
    )


def smoke_config() -> BenchConfig:
    return BenchConfig(
        (
            Scenario(SharedPrefix(groups=4, prefix=128, users=2, question=32, output=8), (8.0,), 2.0, 0.7),
            Scenario(
                SharedPrefix(groups=4, prefix=128, users=2, question=32, output=8),
                (4.0,),
                1.0,
                0.7,
                mode="closed",
            ),
            Scenario(
                Agentic(system=96, tools=96, task=16, steps=2, output=8, tool_result=16, tool_s=0.05),
                (4.0,),
                1.0,
                3.0,
            ),
        ),
        targets=("kvgate", "round-robin", "oracle"),
        replicas=2,
        time_scale=0.05,
        drain_s=30.0,
    )


def make_sessions(sc: Scenario, load: float, seed: int) -> list[Session]:
    """The sessions of one (scenario, load): identical for every target."""
    if isinstance(sc.workload, Trace):
        arrivals: list[float] = []  # the trace has its own timestamps
    elif sc.mode == "closed":
        arrivals = closed_arrivals(int(load * sc.duration_s * 50) + 1)
    else:
        arrivals = poisson_arrivals(load, sc.duration_s, random.Random(f"{seed}-arrivals-{load}"))
    return sc.workload.sessions(smollm2_text(), arrivals, seed)


def sim_section(config: BenchConfig) -> dict[str, Any]:
    """The result's ``sim``: the step model every replica ran (``config``'s values at time scale 1, the
    simulator's defaults unless a sweep varied them; ``time_scale`` multiplies each step) and where each
    value comes from."""
    parameters = {
        "replicas": config.replicas,
        "max_num_seqs": config.max_num_seqs,
        "time_scale": config.time_scale,
        "block_size": BLOCK,
        "step_base_ms": config.step_base_ms,
        "decode_ms_per_seq": config.decode_ms_per_seq,
        "prefill_tokens_per_s": config.prefill_tokens_per_s,
        "kv_fraction_scale": config.kv_fraction_scale,
    }
    return {"parameters": parameters, "sources": SIM_SOURCES}


def fleet_spec(sc: Scenario, config: BenchConfig) -> tg.FleetSpec:
    """Replica KV sized to ``kv_fraction`` (times ``kv_fraction_scale``) of the working set at the highest
    load (documented above); the step model's values passed to the simulator."""
    top = max(sc.loads)
    sessions = len(make_sessions(sc, top, config.seed)) if not isinstance(sc.workload, Trace) else 0
    ws_blocks = math.ceil(sc.workload.working_set_tokens(sessions) / BLOCK)
    max_len = 512 * math.ceil(sc.workload.largest_request_tokens() / 512)
    fraction = sc.kv_fraction * config.kv_fraction_scale
    kv = max(math.ceil(fraction * ws_blocks / config.replicas), math.ceil(max_len / BLOCK))
    sim_args = (
        "--time-scale", str(config.time_scale),
        "--max-num-seqs", str(config.max_num_seqs),
        *step_args(config),
    )  # fmt: skip
    return tg.FleetSpec(config.replicas, kv, max_len, sim_args)


def run_one(
    sc: Scenario,
    load: float,
    target: str,
    fleet: tg.Fleet,
    config: BenchConfig,
    workdir: Path,
    progress: bool,
    repeat: int = 0,
) -> dict[str, Any]:
    """Reset the fleet, start ``target``, send the sessions, stop it; a result row. Each ``repeat``
    gets a fresh work directory (a target's ready files and data from an earlier run must not be
    mistaken for this one's)."""
    name = sc.name
    unit = "concurrent sessions" if sc.mode == "closed" else "sessions/s"
    if isinstance(sc.workload, SharedPrefix) and sc.mode == "open":
        unit = "requests/s"  # one request per session
    row: dict[str, Any] = {
        "workload": name,
        "load": load,
        "load_label": f"{load:g} {unit}",
        "load_unit": unit,
        "mode": sc.mode,
        "target": target,
    }
    fleet.reset()
    model_dir = ensure_model_dir(smollm2_gguf_path())
    started = time.monotonic()
    try:
        running = tg.start(
            target,
            fleet,
            DEFAULT_MODEL,
            model_dir,
            workdir / f"{name}-{load:g}-{target}" / f"run-{repeat}",
            config.kvgate_scheduling,
        )
    except (tg.TargetUnavailable, ChildFailed) as exc:
        row["skipped"] = str(exc).splitlines()[0][:300]
        log.warning("%s %s: skipped: %s", name, target, row["skipped"])
        return row
    try:
        options = LoadOptions(
            DEFAULT_MODEL,
            mode=sc.mode,
            concurrency=max(1, int(load)),
            duration_s=sc.duration_s,
            drain_s=config.drain_s,
            progress=progress,
            label=f"{name} {load:g} {target}",
        )
        result = asyncio.run(run_load(make_sessions(sc, load, config.seed), running.route, options))
    finally:
        running.stop()
    row["metrics"] = rep.summarize(result, fleet.ids, sc.warmup_s)
    row["run_s"] = round(time.monotonic() - started, 1)
    m = row["metrics"]
    print(
        f"{name:<13} {load:>5g} {target:<14} ttft p90 {m['ttft_p90_s']:7.3f}s  "
        f"out {m['output_tok_s']:7.1f} tok/s  "
        f"hit {m['hit_ratio']:.3f}  busiest/mean {m['max_over_mean']:.2f}  ok {m['ok']}/{m['requests']}",
        file=sys.stderr,
        flush=True,
    )
    return row


def measure(
    config: BenchConfig, workdir: Path, progress: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Every scenario x load x target, ``repeats`` rounds: the rows, their per-target medians (the rows
    themselves for one round) and each scenario's fleet."""
    rows: list[dict[str, Any]] = []
    fleets = {}
    for sc in config.scenarios:
        spec = fleet_spec(sc, config)
        fleets[sc.name] = asdict(spec)
        fleet = tg.Fleet(spec, DEFAULT_MODEL, ensure_model_dir(smollm2_gguf_path()), workdir / sc.name)
        try:
            for load in sc.loads:
                for repeat in range(config.repeats):  # rounds: every target once, then again
                    for target in config.targets:
                        row = run_one(sc, load, target, fleet, config, workdir, progress, repeat)
                        rows.append({**row, "repeat": repeat} if config.repeats > 1 else row)
        finally:
            fleet.stop()
    merged = rep.merge_repeats(rows) if config.repeats > 1 else rows
    return rows, merged, fleets


#: The targets kvgate is ranked against in the sweep: the routers (the oracle is a reference, kept out).
RANKED_PEERS = ("round-robin", "least-loaded", "sglang-router", "vllm-router")
KVGATE_TARGETS = ("kvgate", "kvgate-precise")


def goal_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, tuple[dict[str, float], bool]]:
    """The metrics the goals are judged on (:func:`load.bench.report.goals`), each at its workload's
    highest load: ``{label: ({target: value}, higher_is_better)}``; the output goal's from the closed
    loop when the run has it. Targets without the metric (skipped, NaN) are left out."""
    wanted = [("shared-prefix", "ttft_p90_s", False)]
    closed = any(r["workload"] == "shared-prefix-closed" and r.get("metrics") for r in rows)
    wanted.append(("shared-prefix-closed" if closed else "shared-prefix", "output_tok_s", True))
    wanted += [("agentic", "hit_ratio", True), ("agentic", "max_over_mean", False)]
    out: dict[str, tuple[dict[str, float], bool]] = {}
    for workload, key, higher in wanted:
        mine = [r for r in rows if r["workload"] == workload and r.get("metrics")]
        if not mine:
            continue
        top = max(r["load"] for r in mine)
        values = {
            r["target"]: float(r["metrics"][key])
            for r in mine
            if r["load"] == top and not math.isnan(float(r["metrics"][key]))
        }
        out[f"{workload} {key}"] = (values, higher)
    return out


def standings(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, str]]]:
    """kvgate's standing against each peer router on each goal's metric: ``{kvgate target: {metric:
    {peer: "better" | "worse" | "equal"}}}`` (kvgate's side: ``better`` when its value is the better one)."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for label, (values, higher) in goal_metrics(rows).items():
        for mine in KVGATE_TARGETS:
            if mine not in values:
                continue
            for peer in RANKED_PEERS:
                if peer not in values:
                    continue
                diff = values[mine] - values[peer] if higher else values[peer] - values[mine]
                side = "better" if diff > 0 else "worse" if diff < 0 else "equal"
                out.setdefault(mine, {}).setdefault(label, {})[peer] = side
    return out


def ranking_changes(
    reference: dict[str, dict[str, dict[str, str]]], variant: dict[str, dict[str, dict[str, str]]]
) -> list[str]:
    """Each (kvgate target, metric, peer) of ``reference`` whose standing differs in ``variant`` (or
    that the variant did not measure), as ``"kvgate/shared-prefix ttft_p90_s/sglang-router: better ->
    worse"``; empty: the ranking holds."""
    changed = []
    for mine, metrics in reference.items():
        for label, peers in metrics.items():
            for peer, side in peers.items():
                now = variant.get(mine, {}).get(label, {}).get(peer, "not measured")
                if now != side:
                    changed.append(f"{mine}/{label}/{peer}: {side} -> {now}")
    return changed


def sweep_variants(config: BenchConfig) -> list[tuple[str, float, BenchConfig]]:
    """The sweep's configurations: :func:`load.bench.step_variants` with ``kv_fraction_scale`` third."""
    return step_variants(config, "kv_fraction_scale")


def sweep(
    config: BenchConfig, reference_rows: Sequence[dict[str, Any]], workdir: Path, progress: bool
) -> list[dict[str, Any]]:
    """Each variant of :func:`sweep_variants` run like the main one (``config.repeats`` rounds): its
    parameters, fleets, goals, kvgate's standings, and whether they are ``reference_rows``' (the run at
    the unvaried parameters)."""
    reference = standings(reference_rows)
    out = []
    for i, (param, factor, varied) in enumerate(sweep_variants(config)):
        print(f"sweep: {param} x{factor:g}", file=sys.stderr, flush=True)
        _, merged, fleets = measure(varied, workdir / f"sweep-{i}", progress)
        got = standings(merged)
        changed = ranking_changes(reference, got)
        out.append(
            {
                "parameter": param,
                "factor": factor,
                "sim": sim_section(varied)["parameters"],
                "kv_fractions": {
                    sc.name: round(sc.kv_fraction * varied.kv_fraction_scale, 4) for sc in varied.scenarios
                },
                "fleets": fleets,
                "goals": rep.goals(merged),
                "standings": got,
                "ranking_changes": changed,
                "ranking_holds": bool(reference) and not changed,
                "runs": merged,
            }
        )
    return out


#: ``--vary``'s names for the parameters :func:`sweep_variants` scales.
VARY = {"prefill": "prefill_tokens_per_s", "decode": DECODE_STEP, "kv": "kv_fraction_scale"}


def varied(config: BenchConfig, spec: str) -> BenchConfig:
    """``config`` with one step-model parameter scaled as the sweep scales it (:func:`load.bench.scaled`):
    ``spec`` is ``prefill=F`` (the prefill rate), ``decode=F`` (the decode step's base and per-sequence
    cost together) or ``kv=F`` (every workload's ``kv_fraction``), ``F`` a positive finite factor."""
    name, _, text = spec.partition("=")
    if name not in VARY:
        raise ValueError(f"unknown parameter {name!r}: prefill, decode or kv")
    try:
        factor = float(text)
    except ValueError:
        raise ValueError(f"the factor {text!r} is not a number") from None
    if not 0 < factor < math.inf:
        raise ValueError(f"the factor must be positive and finite, got {text}")
    return scaled(config, VARY[name], factor)


def run(
    config: BenchConfig,
    out_dir: Path,
    progress: bool = True,
    command: str = "",
    sweeping: Literal["no", "also", "only"] = "no",
) -> dict[str, Any]:
    """Every scenario x load x target; writes the JSON, table and plots to ``out_dir``. ``sweeping``:
    ``also`` the sweep after the run (the run is its reference), ``only`` the sweep alone (its reference
    run first, then the variants; routing.json alone)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = out_dir / "work"
    info = machine()
    rev = revision()
    started = time.monotonic()

    def head(fleets: dict[str, Any]) -> dict[str, Any]:
        """What every routing.json opens with: the command, machine, revision, config and step model."""
        return {
            "benchmark": "routing",
            "command": command,
            "machine": info,
            "revision": rev,
            "config": _config_section(config, fleets),
            "sim": sim_section(config),
            "repeats": config.repeats,
        }

    if sweeping == "only":
        print("sweep: reference (the unvaried parameters)", file=sys.stderr, flush=True)
        _, merged, fleets = measure(config, workdir / "sweep-reference", progress)
        result: dict[str, Any] = {
            **head(fleets),
            "sweep_reference": {
                "goals": rep.goals(merged),
                "standings": standings(merged),
                "runs": merged,
            },
        }
        variants = sweep(config, merged, workdir, progress)
        result["sweep"] = variants
        result["sweep_ranking_holds_all"] = ranking_holds_all(variants)
        result["wall_s"] = round(time.monotonic() - started, 1)
        write_json(out_dir / "routing.json", result)
        return result
    rows, merged, fleets = measure(config, workdir, progress)
    result = {
        **head(fleets),
        "runs": rows,
        **({"merged": merged} if config.repeats > 1 else {}),
        "goals": rep.goals(merged),
        **(
            {
                "goals_by_round": [
                    rep.goals([r for r in rows if r["repeat"] == i]) for i in range(config.repeats)
                ]
            }
            if config.repeats > 1
            else {}
        ),
    }
    if sweeping == "also":
        result["sweep_reference"] = {"source": "the main run (runs)", "standings": standings(merged)}
        variants = sweep(config, merged, workdir, progress)
        result["sweep"] = variants
        result["sweep_ranking_holds_all"] = ranking_holds_all(variants)
    result["wall_s"] = round(time.monotonic() - started, 1)
    write_json(out_dir / "routing.json", result)
    day = time.strftime("%Y-%m-%d", time.gmtime())
    write_json(out_dir / "routing-summary.json", rep.summary(result, out_dir.resolve().name, day))
    table = rep.markdown_table(merged)
    if config.repeats > 1:
        table = f"Each cell: the median of {config.repeats} runs (rounds of every target in turn).\n\n{table}"
    (out_dir / "routing.md").write_text(table)
    rep.plot(merged, out_dir)
    return result


def _config_section(config: BenchConfig, fleets: dict[str, Any]) -> dict[str, Any]:
    """The result's ``config``: the fleet, targets and scenarios run."""
    return {
        "replicas": config.replicas,
        "time_scale": config.time_scale,
        "max_num_seqs": config.max_num_seqs,
        "seed": config.seed,
        "targets": list(config.targets),
        "kvgate_scheduling": config.kvgate_scheduling or "default",
        "scenarios": [
            {
                "workload": sc.name,
                "params": _params(sc.workload),
                "loads": list(sc.loads),
                "mode": sc.mode,
                "duration_s": sc.duration_s,
                "kv_fraction": sc.kv_fraction,
                "warmup_s": sc.warmup_s,
            }
            for sc in config.scenarios
        ],
        "fleets": fleets,
    }


def _params(workload: Workload) -> dict[str, Any]:
    if isinstance(workload, Trace):
        return {
            "records": len(workload.records),
            "block_tokens": workload.block_tokens,
            "speedup": workload.speedup,
        }
    fields: dict[str, Any] = asdict(workload)  # type: ignore[call-overload]
    return fields


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["routing"]:
        args_in = args_in[1:]
    p = argparse.ArgumentParser(prog="kvgate bench routing", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/routing"), help="results directory")
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--full",
        action="store_true",
        help="more loads, 60 s runs, multi-turn and a synthetic trace too (~2 h)",
    )
    size.add_argument(
        "--smoke", action="store_true", help="tiny: 2 replicas, kvgate/round-robin/oracle (seconds)"
    )
    p.add_argument("--targets", help=f"comma-separated subset of {','.join(tg.TARGETS)}")
    p.add_argument(
        "--workloads",
        help="comma-separated subset of the configuration's scenarios: shared-prefix, shared-prefix-closed,"
        " agentic (--full: multi-turn too)",
    )
    p.add_argument("--loads", help="comma-separated load levels replacing each workload's own")
    p.add_argument(
        "--duration", type=float, help="seconds of arrivals per run, replacing each workload's own"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every (load, target) this many times, in rounds; tables, plots and goals use the medians"
        " (goals_by_round in the JSON: each round's own ratios)",
    )
    p.add_argument("--warmup", type=float, help="seconds of each run not measured, replacing each workload's")
    sweep_group = p.add_mutually_exclusive_group()
    sweep_group.add_argument(
        "--sweep",
        action="store_true",
        help="after the run, the run again with each key step-model parameter halved and doubled (prefill"
        " rate; decode step: base and per-sequence cost together; every workload's kv_fraction), --repeats"
        " rounds each; ranking_holds: kvgate's standing against each peer router on each goal's metric is"
        " the main run's",
    )
    sweep_group.add_argument(
        "--sweep-only",
        action="store_true",
        help="the sweep alone: its reference run at the unvaried parameters, then the variants (routing.json"
        " only)",
    )
    p.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="PARAM=FACTOR",
        help="run at one of the sweep's variants (or any factor): PARAM is prefill (the prefill rate), decode"
        " (the decode step's base and per-sequence cost together) or kv (every workload's kv_fraction);"
        " repeatable; routing.json's sim records the parameters",
    )
    p.add_argument("--trace", type=Path, help="also replay this Mooncake-shaped JSONL trace")
    p.add_argument("--trace-speedup", type=float, default=1.0, help="replay the trace this many times faster")
    p.add_argument(
        "--trace-block-tokens", type=int, default=128, help="tokens per trace hash id (512 in the trace)"
    )
    p.add_argument("--replicas", type=int, help="fleet size (default 8)")
    p.add_argument("--time-scale", type=float, help="simulator step-time multiplier (default 5)")
    p.add_argument("--seed", type=int, help="workload seed (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--kvgate-scheduling", type=Path, help="JSON file: kvgate scheduling section (plugins + profiles)"
    )
    args = p.parse_args(args_in)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = full_config() if args.full else smoke_config() if args.smoke else default_config()
    if args.targets:
        chosen = tuple(t.strip() for t in args.targets.split(",") if t.strip())
        unknown = [t for t in chosen if t not in tg.TARGETS]
        if unknown:
            p.error(f"unknown targets {unknown}; known: {', '.join(tg.TARGETS)}")
        config = replace(config, targets=chosen)
    if args.workloads:
        wanted = {w.strip() for w in args.workloads.split(",")}
        config = replace(
            config,
            scenarios=tuple(s for s in config.scenarios if s.name in wanted),
        )
    if args.loads:
        loads = tuple(float(x) for x in args.loads.split(","))
        config = replace(config, scenarios=tuple(replace(s, loads=loads) for s in config.scenarios))
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    config = replace(config, repeats=args.repeats)
    if args.duration is not None:
        config = replace(
            config, scenarios=tuple(replace(s, duration_s=args.duration) for s in config.scenarios)
        )
    if args.warmup is not None:
        config = replace(config, scenarios=tuple(replace(s, warmup_s=args.warmup) for s in config.scenarios))
    trace_path = args.trace
    if trace_path is None and args.full:
        trace_path = synthesize(
            args.out / "synthetic-trace.jsonl", requests=300, rate_per_s=4.0, seed=config.seed
        )
    if trace_path is not None:
        records = tuple(read_trace(trace_path))
        trace = Trace(records, block_tokens=args.trace_block_tokens, speedup=args.trace_speedup)
        config = replace(config, scenarios=(*config.scenarios, Scenario(trace, (1.0,), 1e9, 0.7)))
    if args.kvgate_scheduling is not None:
        config = replace(config, kvgate_scheduling=json.loads(args.kvgate_scheduling.read_text()))
    for key in ("replicas", "time_scale", "seed"):
        if getattr(args, key) is not None:
            config = replace(config, **{key: getattr(args, key)})
    for spec in args.vary:
        try:
            config = varied(config, spec)
        except ValueError as exc:
            p.error(f"--vary {spec}: {exc}")
    command = " ".join(["kvgate bench routing", *args_in])
    sweeping: Literal["no", "also", "only"] = "only" if args.sweep_only else "also" if args.sweep else "no"
    result = run(config, args.out, progress=not args.no_progress, command=command, sweeping=sweeping)
    if "runs" in result:
        sys.stdout.write(rep.markdown_table(result["runs"]))
        for name, goal in result["goals"].items():
            print(f"goal {name}: {goal}")
    for variant in result.get("sweep", []):
        holds = variant["ranking_holds"]
        print(f"sweep {variant['parameter']} x{variant['factor']:g}: ranking holds {holds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
