"""Prefill/decode disaggregation (issue 18): long shared-prefix prompts at a load where prefill
interferes with decode, the same number of replicas for every target, one run.

    python -m load.bench.disagg --out results/disagg.json          # a few minutes on a 2-core VM
    python -m load.bench.disagg --quick --out /tmp/disagg.json     # seconds; figures mean nothing
    python -m load.bench.disagg --prefill 5 --decode 3 --max-num-batched-tokens 512 ...  # see --help
    python -m load.bench.disagg --repeats 3 ...   # each target 3 times, interleaved; medians per metric

Fleet: ``total`` simulated vLLM replicas (``load.sim``, one process each, started by ``kvgate up``'s
:class:`~kvgate.dev.up.Stack`), the H100/8B step model slowed ``time_scale`` times. Targets, each over a
fresh fleet (so no cache carries over):

* ``kvgate-aggregated``: kvgate over ``total`` ``both`` replicas;
* ``kvgate-disaggregated``: kvgate over ``prefill`` prefill + ``decode`` decode replicas, every request
  prefilled on a prefill replica (``mode = "disaggregated"``);
* ``kvgate-conditional``: the same fleet, disaggregated only when the decode pick lacks at least
  ``min_uncached_tokens`` prompt tokens (``mode = "conditional"``);
* ``round-robin``: a plain Envoy (``ROUND_ROBIN``) over ``total`` ``both`` replicas;
* ``kvgate-disaggregated-sglang``: ``kvgate-disaggregated`` over replicas speaking SGLang's protocol
  (``--disaggregation-mode``, registered as SGLang engines): both halves sent at once with a bootstrap
  room, the decode replica waiting for the prefill's KV (``load/sim/bootstrap.py``);
* ``sglang-router-pd``: sglang-router (the peer install of :mod:`load.bench.peers`) in its own
  prefill/decode mode (``--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL``, ``--policy
  cache_aware`` for both pools) over the same SGLang-protocol fleet.

Workload: Poisson arrivals (seeded) at ``rate_req_s`` for ``duration_s``, open loop, streamed; each
prompt is one of ``prefixes`` shared prefixes (``prefix_tokens`` long) and a unique suffix
(``suffix_min``..``suffix_max`` tokens), ``output_tokens`` out. Per target: TTFT and inter-token latency
(ITL: gaps between streamed chunks after the first) p50/p90/p99 in ms, output tok/s (completion tokens of
served requests over the run's wall time), errors.

Goals (``goals``): conditional ITL p90 <= 0.5 x aggregated with TTFT p90 <= 1.2 x aggregated;
disaggregated TTFT p90 <= 0.6 x sglang-router's PD mode, both over the SGLang-protocol fleet
(``kvgate-disaggregated-sglang`` / ``sglang-router-pd``: the same engine protocol; the ratio of the vLLM
protocol's ``kvgate-disaggregated`` is reported beside it). The ratios are over served requests, so
``success_100pct_every_run`` (:func:`load.bench.success_goal`, as the routing bench judges it) is judged
beside them: not met when any run of any target lost a request (:func:`failed_runs`); a sweep variant's
``goals_met`` and ``peer_goal_met`` need it too.

``--repeats N`` runs every target ``N`` times, interleaved (round 1 runs each target once, then round 2,
...: a slow spell of the shared machine hits every target alike). Each target's row is then the median of
its runs, metric by metric (``median_row``: every number in it, each percentile of TTFT and ITL
separately; ``errors``/``replicas`` summed over the runs), with the runs themselves under ``runs``; the goals
are judged on those medians, and ``goals_per_repeat`` holds each round's own ratios (their spread is the
run-to-run noise). The sweep repeats each variant's two targets the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvgate.dev.procs import ChildFailed
from kvgate.dev.up import DEFAULT_MODEL, Stack, StackOptions
from load.bench import (
    SUCCESS_GOAL,
    TIMING_SOURCES,
    chosen_targets,
    counts,
    finish,
    opening,
    peers,
    ranking_holds_all,
    skipped,
    step_args,
    step_variants,
    success_goal,
    summary,
)
from load.bench import targets as tg
from load.client import FixedRoute, LoadOptions, RequestRecord, RunResult, run_load
from load.workloads import smollm2_text
from load.workloads.session import Session, Turn, poisson_arrivals

log = logging.getLogger(__name__)

TARGETS = (
    "kvgate-aggregated",
    "kvgate-disaggregated",
    "kvgate-conditional",
    "round-robin",
    "kvgate-disaggregated-sglang",
    "sglang-router-pd",
)
#: Targets over replicas speaking SGLang's prefill/decode protocol.
SGLANG_FLEET = ("kvgate-disaggregated-sglang", "sglang-router-pd")
#: The simulator's parameters: what each means and where its value comes from (``load/sim/timing.py``,
#: ``load/sim/README.md``, "Timing model" and "Prefill/decode disaggregation").
SIM_SOURCES = {
    **TIMING_SOURCES,
    "prefill_tokens_per_s": "20,000 tokens/s: compute-bound prefill at ~30% of the H100's bf16 peak; every"
    " step carrying prefill tokens is that much longer for all sequences decoding in it (chunked-prefill"
    " interference; load/sim/timing.py, load/sim/README.md)",
    "max_num_batched_tokens": "2,048 prompt tokens per step (vLLM's chunked-prefill default; the sim's)",
    "kv_bytes_per_token": "131,072 B: K and V x 32 layers x 8 KV heads x 128 dims x 2 bytes (Llama-3.1-8B"
    " bf16; load/sim/README.md, Prefill/decode disaggregation)",
    "link_gbps": "400 Gb/s: one RDMA NIC's line rate (NIXL over UCX), not a measured NIXL throughput"
    " (load/sim/README.md; NVIDIA ConnectX-7 datasheet: up to 400 Gb/s InfiniBand/Ethernet,"
    " https://www.nvidia.com/en-us/networking/ethernet/connectx-7/)",
    "time_scale": "every step (and transfer) stretched this many times so 2 CPU cores can drive the fleet"
    " and a router",
    "max_num_seqs": "the engine's running-batch limit (vLLM --max-num-seqs)",
}


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """One benchmark's fleet and workload (see the module docstring)."""

    total: int = 8
    prefill: int = 2
    decode: int = 6
    min_uncached_tokens: int = 1024
    time_scale: float = 4.0
    step_base_ms: float = 6.0
    decode_ms_per_seq: float = 0.15
    prefill_tokens_per_s: float = 20_000.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    kv_bytes_per_token: int = 131_072
    link_gbps: float = 400.0
    max_model_len: int = 8192
    rate_req_s: float = 2.0
    duration_s: float = 40.0
    drain_s: float = 120.0
    prefixes: int = 8
    prefix_tokens: int = 1536
    suffix_min: int = 512
    suffix_max: int = 6144
    output_tokens: int = 96
    seed: int = 1

    def sim_args(self) -> tuple[str, ...]:
        return (
            "--time-scale", str(self.time_scale),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--max-model-len", str(self.max_model_len),
            *step_args(self),
            "--kv-bytes-per-token", str(self.kv_bytes_per_token),
            "--link-gbps", str(self.link_gbps),
            "--log-level", "WARNING",
        )  # fmt: skip


def quick_config() -> DisaggConfig:
    """The smoke run: 4 fast replicas (1P+3D), short prompts, a few seconds of arrivals."""
    return DisaggConfig(
        total=4,
        prefill=1,
        decode=3,
        min_uncached_tokens=64,
        time_scale=0.2,
        rate_req_s=3.0,
        duration_s=2.0,
        drain_s=30.0,
        prefixes=2,
        prefix_tokens=64,
        suffix_min=32,
        suffix_max=128,
        output_tokens=8,
    )


def make_sessions(config: DisaggConfig) -> list[Session]:
    """One single-turn session per Poisson arrival: a shared prefix (one of ``prefixes``, drawn) and a
    unique suffix of ``suffix_min``..``suffix_max`` tokens."""
    rng = random.Random(f"{config.seed}-disagg")
    text = smollm2_text()
    prefixes = [text.block(config.prefix_tokens, f"disagg-prefix-{i}") for i in range(config.prefixes)]
    arrivals = poisson_arrivals(
        config.rate_req_s, config.duration_s, random.Random(f"{config.seed}-arrivals")
    )
    sessions = []
    for i, start in enumerate(arrivals):
        group = rng.randrange(config.prefixes)
        suffix = text.words(rng.randint(config.suffix_min, config.suffix_max), rng)
        turn = Turn(({"role": "user", "content": prefixes[group] + suffix},), config.output_tokens)
        sessions.append(Session(f"r{i}", f"prefix-{group}", start, (), (turn,)))
    return sessions


def stack_options(name: str, config: DisaggConfig, workdir: Path) -> StackOptions:
    """``kvgate up``'s options for target ``name`` (round robin: the replicas of an aggregated stack)."""
    common: dict[str, Any] = {
        "port": 0,
        "model": DEFAULT_MODEL,
        "sim_args": config.sim_args(),
        "workdir": workdir,
    }
    if name in ("kvgate-aggregated", "round-robin"):
        return StackOptions(replicas=config.total, **common)
    mode = "conditional" if name == "kvgate-conditional" else "disaggregated"
    route: dict[str, Any] = {"mode": mode}
    if mode == "conditional":
        route["min_uncached_tokens"] = config.min_uncached_tokens
    protocol = "sglang" if name in SGLANG_FLEET else "vllm"
    return StackOptions(
        prefill=config.prefill, decode=config.decode, disaggregation=route, pd_protocol=protocol, **common
    )


def _start(name: str, config: DisaggConfig, workdir: Path) -> tg.Running:
    workdir.mkdir(parents=True, exist_ok=True)
    stack = Stack(stack_options(name, config, workdir))
    try:
        stack.start()
        if name == "sglang-router-pd":  # the stack's gateway idles: the router fronts its replicas
            spec = peers.PEERS["sglang-router"]
            prefills = [
                (f"http://{e['address']}", int(e["bootstrap_port"]))
                for e in stack.engines
                if "bootstrap_port" in e
            ]
            decodes = [f"http://{e['address']}" for e in stack.engines if e.get("role") == "decode"]
            try:
                router, url = peers.launch_pd(spec, peers.install(spec), prefills, decodes, workdir)
            except peers.PeerUnavailable as exc:
                raise tg.TargetUnavailable(str(exc)) from exc
            return tg.Running(FixedRoute(url), children=[router], stack=stack)
        if name != "round-robin":
            return tg.Running(FixedRoute(stack.url), stack=stack)
        addresses = [e["address"] for e in stack.engines]
        envoy, url = tg.start_baseline_envoy(workdir, addresses, "ROUND_ROBIN")
    except BaseException:
        stack.stop()
        raise
    return tg.Running(FixedRoute(url), children=[envoy], stack=stack)


def _ms(samples: Sequence[float]) -> dict[str, float | int]:
    return summary([s * 1e3 for s in samples])


def target_metrics(result: RunResult, sent: int) -> dict[str, Any]:
    """One target's figures (see the module docstring)."""
    records: Sequence[RequestRecord] = result.records
    ok = [r for r in records if r.ok]
    wall = result.wall_s
    return {
        "sent": sent,
        "served": len(ok),
        "errors": counts(r.status for r in records if not r.ok),
        "lost": sent - len(ok),
        "wall_s": round(wall, 2),
        "ttft_ms": _ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": _ms([g for r in ok for g in r.chunk_gaps_s]),
        "output_tok_s": round(sum(r.completion_tokens for r in ok) / wall, 1) if wall > 0 else 0.0,
        "prompt_tokens_mean": round(sum(r.prompt_tokens for r in ok) / len(ok), 1) if ok else float("nan"),
        "replicas": counts(r.replica or "?" for r in ok),
    }


def run_target(
    name: str, config: DisaggConfig, sessions: list[Session], workdir: Path, progress: bool
) -> dict[str, Any]:
    """Start ``name`` on a fresh fleet, send ``sessions``, stop it; its row (``skipped`` if it cannot run)."""
    started = time.monotonic()
    try:
        running = _start(name, config, workdir / name)
    except (tg.TargetUnavailable, ChildFailed) as exc:
        return skipped(name, exc, log)
    options = LoadOptions(
        DEFAULT_MODEL, duration_s=config.duration_s, drain_s=config.drain_s, progress=progress
    )
    try:
        result = asyncio.run(run_load(sessions, running.route, options))
    finally:
        running.stop()
    row = {"target": name, **target_metrics(result, len(sessions))}
    row["target_wall_s"] = round(time.monotonic() - started, 1)
    return row


def run_targets(
    targets: Sequence[str],
    config: DisaggConfig,
    sessions: list[Session],
    workdir: Path,
    progress: bool,
    repeats: int = 1,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, dict[str, Any]]]]:
    """``targets`` run ``repeats`` times, interleaved (each round runs every target once, each on a fresh
    fleet); each target's row (:func:`median_row` of its runs when ``repeats`` > 1) and every round's
    rows."""
    if repeats == 1:
        rows = {t: run_target(t, config, sessions, workdir, progress) for t in targets}
        return rows, [rows]
    rounds = []
    for r in range(repeats):
        print(f"round {r + 1}/{repeats}", file=sys.stderr, flush=True)
        rounds.append({t: run_target(t, config, sessions, workdir / f"round-{r}", progress) for t in targets})
    return {t: median_row([got[t] for got in rounds]) for t in targets}, rounds


def median_row(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One target's runs as one row: every number the median of the runs that ran (nested dicts key by
    key: ``ttft_ms.p90`` is the median of the runs' p90s, not a pooled percentile); ``errors`` and
    ``replicas`` summed; ``runs`` the rows themselves. Skipped when every run was."""
    ran = [r for r in runs if "skipped" not in r]
    if not ran:
        return {**runs[0], "runs": list(runs)}
    row: dict[str, Any] = _median_of(ran)
    for key in ("errors", "replicas"):
        total: dict[str, int] = {}
        for r in ran:
            for k, v in r.get(key, {}).items():
                total[k] = total.get(k, 0) + v
        row[key] = dict(sorted(total.items()))
    row["repeats"] = len(ran)
    row["runs"] = list(runs)
    return row


def _median_of(values: Sequence[Any]) -> Any:
    first = values[0]
    if isinstance(first, dict):
        return {k: _median_of([v[k] for v in values if k in v]) for k in first}
    if isinstance(first, bool) or not isinstance(first, int | float):
        return first
    return round(statistics.median(values), 3)


def _goal(value: float | None, goal: str, met: bool | None, **extra: Any) -> dict[str, Any]:
    return {"value": value, "goal": goal, "met": met, **extra}


def _p90(row: dict[str, Any], key: str) -> float | None:
    if "skipped" in row or not row.get(key, {}).get("n"):
        return None
    return float(row[key]["p90"])


def goals(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The issue's goals: each ``{value, goal, met}`` (``met`` ``None``: not evaluated, with ``reason``)."""
    agg, cond = rows.get("kvgate-aggregated", {}), rows.get("kvgate-conditional", {})
    out: dict[str, dict[str, Any]] = {}
    itl_a, itl_c = _p90(agg, "itl_ms"), _p90(cond, "itl_ms")
    ttft_a, ttft_c = _p90(agg, "ttft_ms"), _p90(cond, "ttft_ms")
    if itl_a and itl_c is not None:
        out["conditional_itl_p90_over_aggregated"] = _goal(
            round(itl_c / itl_a, 3), "<= 0.5", itl_c / itl_a <= 0.5
        )
    else:
        out["conditional_itl_p90_over_aggregated"] = _goal(
            None, "<= 0.5", None, reason="a target did not run"
        )
    if ttft_a and ttft_c is not None:
        out["conditional_ttft_p90_over_aggregated"] = _goal(
            round(ttft_c / ttft_a, 3), "<= 1.2", ttft_c / ttft_a <= 1.2
        )
    else:
        out["conditional_ttft_p90_over_aggregated"] = _goal(
            None, "<= 1.2", None, reason="a target did not run"
        )
    ttft_s = _p90(rows.get("sglang-router-pd", {}), "ttft_ms")
    ttft_k = _p90(rows.get("kvgate-disaggregated-sglang", {}), "ttft_ms")
    ttft_v = _p90(rows.get("kvgate-disaggregated", {}), "ttft_ms")
    if ttft_s and ttft_k is not None:
        out["disaggregated_ttft_p90_over_sglang_pd"] = _goal(
            round(ttft_k / ttft_s, 3),
            "<= 0.6",
            ttft_k / ttft_s <= 0.6,
            kvgate_target="kvgate-disaggregated-sglang",
            vllm_protocol_ratio=None if ttft_v is None else round(ttft_v / ttft_s, 3),
        )
    else:
        out["disaggregated_ttft_p90_over_sglang_pd"] = _goal(
            None, "<= 0.6", None, reason="a target did not run"
        )
    out[SUCCESS_GOAL] = success_goal(failed_runs(rows))
    return out


def failed_runs(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Each run that lost a request (``lost``: sent and not served), by target (``target (run i)`` for a
    median row's ``runs``: a median of ``lost`` would hide one run's losses); skipped runs are not runs."""
    out = []
    for name, row in rows.items():
        runs = row.get("runs", [row])
        for i, run in enumerate(runs):
            if "skipped" not in run and run.get("lost", 0) > 0:
                out.append(name if len(runs) == 1 else f"{name} (run {i + 1})")
    return out


#: Workload and fleet flags: (flag, DisaggConfig field, type, help). ``--prefill``/``--decode`` set the
#: split; the aggregated targets get their sum.
FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--prefill", "prefill", int, "prefill replicas of the P/D targets"),
    ("--decode", "decode", int, "decode replicas of the P/D targets"),
    ("--min-uncached-tokens", "min_uncached_tokens", int, "kvgate-conditional's threshold"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "every replica's prompt tokens per step"),
    ("--output-tokens", "output_tokens", int, "tokens out per request"),
    ("--prefixes", "prefixes", int, "shared prefixes"),
    ("--prefix-tokens", "prefix_tokens", int, "tokens per shared prefix"),
    ("--suffix-min", "suffix_min", int, "shortest unique suffix (tokens)"),
    ("--suffix-max", "suffix_max", int, "longest unique suffix (tokens)"),
    ("--time-scale", "time_scale", float, "every simulated step stretched this many times"),
)
#: The targets the sweep runs again (the conditional goal's two).
SWEEP_TARGETS = ("kvgate-aggregated", "kvgate-conditional")
#: What ``--sweep-peers`` adds: the peer goal's two (kvgate's and sglang-router's PD modes, one fleet).
SWEEP_PEERS = ("kvgate-disaggregated-sglang", "sglang-router-pd")
SWEEP_HELP = (
    "also the sim-parameter sweep: kvgate-aggregated and kvgate-conditional again with each key parameter "
    "halved and doubled (prefill rate; the decode step: base and per-sequence cost together; the KV "
    "link); ranking_holds: conditional ITL p90 below aggregated's"
)


def sweep(
    config: DisaggConfig, workdir: Path, progress: bool, repeats: int = 1, peers: bool = False
) -> list[dict[str, Any]]:
    """Each key step-model parameter halved and doubled; the conditional goal's two targets each time
    (:data:`SWEEP_TARGETS`, ``repeats`` times interleaved: medians), their ITL and TTFT p90 ratios, and
    whether the ranking holds. With ``peers`` also :data:`SWEEP_PEERS`, kvgate's PD TTFT p90 over
    sglang-router's, and whether kvgate's stays below (``peer_ranking_holds``)."""
    variants = step_variants(config, "link_gbps")
    sessions = make_sessions(config)
    targets = SWEEP_TARGETS + (SWEEP_PEERS if peers else ())
    out = []
    for i, (param, factor, varied) in enumerate(variants):
        print(f"sweep: {param} x{factor:g}", file=sys.stderr, flush=True)
        rows, rounds = run_targets(targets, varied, sessions, workdir / f"sweep-{i}", progress, repeats)
        got = goals(rows)
        itl = got["conditional_itl_p90_over_aggregated"]["value"]
        ttft = got["conditional_ttft_p90_over_aggregated"]["value"]
        peer = got["disaggregated_ttft_p90_over_sglang_pd"]["value"]
        out.append(
            {
                "parameter": param,
                "factor": factor,
                "sim_args": list(varied.sim_args()),
                "conditional_itl_p90_over_aggregated": itl,
                "conditional_ttft_p90_over_aggregated": ttft,
                "ranking_holds": itl is not None and itl < 1.0,
                SUCCESS_GOAL: got[SUCCESS_GOAL]["met"],
                "goals_met": itl is not None
                and itl <= 0.5
                and ttft is not None
                and ttft <= 1.2
                and got[SUCCESS_GOAL]["met"],
                **(
                    {
                        "disaggregated_ttft_p90_over_sglang_pd": peer,
                        "peer_ranking_holds": peer is not None and peer < 1.0,
                        "peer_goal_met": peer is not None and peer <= 0.6 and got[SUCCESS_GOAL]["met"],
                    }
                    if peers
                    else {}
                ),
                **({"goals_per_repeat": [_ratios(goals(r)) for r in rounds]} if repeats > 1 else {}),
                "targets": rows,
            }
        )
    return out


def _ratios(got: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """A goals dict's values alone (one round's ratios)."""
    return {k: v["value"] for k, v in got.items()}


def parser() -> argparse.ArgumentParser:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(
        prog="python -m load.bench.disagg", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--out", type=Path, default=Path("results/disagg.json"), help="result JSON file")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (seconds, figures meaningless)")
    p.add_argument("--targets", help=f"comma-separated subset of {','.join(TARGETS)}")
    p.add_argument("--duration", type=float, help="seconds of arrivals")
    p.add_argument("--rate", type=float, help="arrivals per second")
    p.add_argument("--seed", type=int, help="workload seed (default 1)")
    for flag, key, kind, what in FLAGS:
        p.add_argument(flag, type=kind, dest=key, help=f"{what} (default {getattr(DisaggConfig(), key)})")
    sweeping = p.add_mutually_exclusive_group()
    sweeping.add_argument("--sweep", action="store_true", help=SWEEP_HELP)
    sweeping.add_argument("--sweep-only", action="store_true", help="the sweep alone, without the main run")
    p.add_argument(
        "--sweep-peers",
        action="store_true",
        help="the sweep also runs kvgate-disaggregated-sglang and sglang-router-pd (the peer goal's ranking)",
    )
    p.add_argument(
        "--sweep-duration", type=float, help="seconds of arrivals per sweep run (default --duration)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every target (and sweep variant) N times, interleaved; rows and goals are medians"
        " (default 1)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def config_from(args: argparse.Namespace) -> DisaggConfig:
    """The run's :class:`DisaggConfig`: the default (or ``--quick``'s) with the flags given applied; a
    ``--prefill``/``--decode`` split also sets the aggregated targets' replicas to its sum."""
    config = quick_config() if args.quick else DisaggConfig()
    for key, value in (("duration_s", args.duration), ("rate_req_s", args.rate), ("seed", args.seed)):
        if value is not None:
            config = replace(config, **{key: value})
    for _, key, _, _ in FLAGS:
        if getattr(args, key) is not None:
            config = replace(config, **{key: getattr(args, key)})
    if args.prefill is not None or args.decode is not None:
        config = replace(config, total=config.prefill + config.decode)
    return config


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = config_from(args)
    targets = chosen_targets(p, args.targets, TARGETS)
    if args.repeats < 1:
        p.error("--repeats: expected at least 1")
    workdir = args.out.resolve().parent / f"{args.out.stem}-work"
    started = time.monotonic()
    sessions = make_sessions(config)
    result = opening("disagg", argv, args.quick, config, SIM_SOURCES, len(sessions))
    if not args.sweep_only:
        rows, rounds = run_targets(targets, config, sessions, workdir, not args.no_progress, args.repeats)
        result["repeats"] = args.repeats
        result["targets"] = rows
        result["skipped"] = {t: r["skipped"] for t, r in rows.items() if "skipped" in r}
        result["goals"] = goals(rows)
        if args.repeats > 1:
            result["goals_per_repeat"] = [_ratios(goals(r)) for r in rounds]
    if args.sweep or args.sweep_only:
        sweep_config = (
            config if args.sweep_duration is None else replace(config, duration_s=args.sweep_duration)
        )
        result["sweep"] = sweep(
            sweep_config, workdir / "sweep", not args.no_progress, args.repeats, args.sweep_peers
        )
        result["sweep_ranking_holds_all"] = ranking_holds_all(result["sweep"])
        if args.sweep_peers:
            result["sweep_peer_ranking_holds_all"] = ranking_holds_all(result["sweep"], "peer_ranking_holds")
    return finish(result, args.out, started)


if __name__ == "__main__":
    raise SystemExit(main())
