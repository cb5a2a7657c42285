"""Flow control under overload (issue 17): two classes at 1.5x the fleet's capacity, five targets, one run.

    python -m load.bench.flow --out results/flow.json            # ~5 min on a 2-core VM
    python -m load.bench.flow --sweep --out results/flow.json    # + the sim-parameter sweep (~17 min more)
    python -m load.bench.flow --sweep-only --out results/flow-sweep.json  # the sweep alone
    python -m load.bench.flow --quick --out /tmp/flow.json       # seconds; figures mean nothing
    python -m load.bench.flow --engine-priority --sweep --out results/flow.json  # engines preempt by priority
    python -m load.bench.flow --targets kvgate-flow,kvgate-flow-priority,kvgate-no-flow --out results/f.json
                                                   # + kvgate-flow-priority: vLLM's priority scheduling

Fleet: ``replicas`` simulated vLLM replicas (``load.sim``, one process) running the H100/8B step model
slowed ``time_scale`` times, each running at most ``max_num_seqs`` sequences (the rest wait in the
engine's FIFO queue). Its capacity is measured first: a closed loop of ``2 x replicas x max_num_seqs``
concurrent requests of the workload's mix through a round-robin Envoy, completions per second between
``capacity_warmup_s`` and the loop's end (the figure the step model predicts is recorded beside it).

Workload: Poisson arrivals (seeded) at ``multiplier`` (1.5) x the measured capacity for ``duration_s``,
open loop, every request streamed:

* interactive, ``interactive_share`` of arrivals: header ``x-llm-d-inference-objective: interactive``
  (objective priority 1, ``ttft_ms`` = ``ttft_ms``, a target an unloaded replica meets many times over),
  short prompts (``interactive_prompt`` tokens, ``interactive_output`` out);
* batch, the rest: objective ``batch`` (priority 0), longer (``batch_prompt`` / ``batch_output``), split
  4:1 between fairness ids ``batch-a`` and ``batch-b`` (``x-llm-d-inference-fairness-id``).

The headers go to every target (the peers ignore them). Targets, each started fresh over the same fleet
(prefix caches reset before each): ``kvgate-flow`` (``kvgate up``'s Envoy + ext_proc with the ``[flow]``
settings of :func:`flow_overlay`: at most ``max_num_seqs`` requests in flight per engine, of which batch
fills at most ``(1 - batch_headroom)`` (the rest kept for interactive arrivals), batch queued at most
``batch_max_wait_s`` and ``batch_max_requests`` deep, then 429), ``kvgate-no-flow`` (the same
stack with the objectives and no ``[flow]`` limits), ``round-robin`` (plain Envoy), ``sglang-router`` and
``vllm-router`` (``--policy cache_aware``; skipped with the reason when they cannot be installed).

Per target and class (every request sent counts; ``requests`` = served + 429 + lost):

* ``goodput``: interactive, the share served with TTFT <= ``ttft_ms`` (429s and errors are misses);
  batch, the share served;
* ``ttft_s``: p50/p90/p99 of served requests; ``output_tok_s``: completion tokens of served requests
  over the run's wall time (first send to last token), per class and in total;
* ``shed``: 429 answers by ``error.code``; ``errors``: other failures by status; ``lost``: neither
  served nor 429 (the goal: 0);
* ``fairness``: the batch flows over the overloaded window (``warmup_s`` to ``duration_s``): each flow's
  output tokens served in the window and its demand (``max_tokens`` of its requests sent then); ``jain``
  is Jain's index of served / max-min fair share (the water-filling of the window's served batch tokens
  over the demands: a flow asking less than an equal split is owed all it asked), 1.0 = max-min fair;
  ``jain_raw`` the index of the served tokens themselves; ``shed_by_flow`` each flow's 429s by code
  (whole run).

With ``--engine-priority`` the fleet's engines schedule by priority and preempt for a full batch (the
simulator's ``--scheduling-policy priority --priority-preemption``, every target), and ``kvgate-flow``
writes each request's band into its body (``flow/engine_priority``), lets batch fill every slot (headroom
0 unless ``--batch-headroom`` is given) and lets interactive go past the limit (headroom
``-interactive_overcommit``); the other targets send no priority, so the engines serve them first come,
first served. ``--vllm-priority`` makes those engines schedule as vLLM's v1 scheduler does instead
(``--scheduling-policy priority`` alone: the queue ordered by ``(priority, arrival)``, no preemption for a
waiting request: an interactive arrival waits for the next free slot, ahead of every queued batch one).

Target ``kvgate-flow-priority`` (not among the defaults; name it in ``--targets``): ``kvgate-flow``'s
settings, but the fleet's engines schedule by priority as vLLM does (every target then runs over that
fleet; requests without a ``priority`` are all 0 there, so the others are served first come, first served
as before), the gateway writes each request's band into its body (``flow/engine_priority``, the engines'
order ``low_first``), batch fills every slot (headroom ``priority_batch_headroom``, 0) and interactive
may go past the limit into the engine's queue (headroom ``-interactive_overcommit``). Its goals are
reported beside the others (``goals_priority``: the same goals with it in ``kvgate-flow``'s place).

Goals (``goals``, each ``{value, goal, met}``): interactive goodput >= 0.95 with flow control and < 0.5
without; total output tok/s with flow control >= 0.95 x without; Jain's index with flow control >= 0.95;
no request lost by any target.

Sweep (``--sweep``): ``kvgate-flow``, ``kvgate-no-flow`` and ``round-robin`` again with each key
parameter halved and doubled (prefill rate; the decode step: base and per-sequence cost together; the
arrival multiplier), the capacity re-measured for each fleet; ``ranking_holds``: interactive goodput with
flow control >= without (the multiplier halved is under capacity, where both may meet the target).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engines.gguf import ensure_model_dir, smollm2_gguf_path
from kvgate.dev.procs import ChildFailed
from kvgate.dev.up import DEFAULT_MODEL, Stack, StackOptions
from load.bench import (
    TIMING_SOURCES,
    CpuSample,
    chosen_targets,
    counts,
    finish,
    header,
    skipped,
    step_args,
    step_variants,
    summary,
)
from load.bench import targets as tg
from load.client import FixedRoute, LoadOptions, RequestRecord, RunResult, run_load
from load.workloads import smollm2_text
from load.workloads.session import Session, Turn, closed_arrivals, poisson_arrivals

log = logging.getLogger(__name__)

DEFAULT_TARGETS = ("kvgate-flow", "kvgate-no-flow", "round-robin", "sglang-router", "vllm-router")
PRIORITY_TARGET = "kvgate-flow-priority"
TARGETS = (*DEFAULT_TARGETS, PRIORITY_TARGET)
SWEEP_TARGETS = ("kvgate-flow", "kvgate-no-flow", "round-robin")
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
CLASSES = ("interactive", "batch")
BATCH_FLOWS = ("batch-a", "batch-b")
#: The simulator's timing parameters: what each means and where its value comes from
#: (``load/sim/timing.py`` and ``load/sim/README.md``, "Timing model").
SIM_SOURCES = {
    **TIMING_SOURCES,
    "prefill_tokens_per_s": "20,000 tokens/s: compute-bound prefill at ~30% of the H100's bf16 peak"
    " (load/sim/timing.py, load/sim/README.md)",
    "time_scale": "every step stretched this many times so 2 CPU cores can drive the fleet and a router",
    "max_num_seqs": "the engine's running-batch limit (vLLM --max-num-seqs), kept small so a few replicas"
    " saturate at a request rate 2 cores can send",
    "engine_priority": "with it, the engines order their queue by (priority, arrival) (vLLM's"
    " --scheduling-policy priority, v1 scheduler) and a waiting request preempts the latest running one of"
    " lower priority when the batch is full (SGLang's --enable-priority-scheduling: schedule_policy.py"
    " preempt_to_schedule, threshold 0 here); a preempted request recomputes from its last cached full block"
    " (load/sim/engine.py)",
    "engine_preemption": "false (--vllm-priority, or the fleet of kvgate-flow-priority without"
    " --engine-priority): the engines schedule as vLLM's v1 scheduler: the waiting queue a heap by"
    " (priority, arrival) (vllm/v1/core/sched/request_queue.py PriorityRequestQueue), a waiting request"
    " admitted only into a free slot, preemption only when KV blocks run out (vllm/v1/core/sched/scheduler.py"
    " schedule(); this simulator reserves a request's blocks on admission, so never)",
}


@dataclass(frozen=True, slots=True)
class FlowConfig:
    """One benchmark's fleet, workload and flow settings (see the module docstring)."""

    replicas: int = 2
    max_num_seqs: int = 8
    time_scale: float = 4.0
    step_base_ms: float = 6.0
    decode_ms_per_seq: float = 0.15
    prefill_tokens_per_s: float = 20_000.0
    kv_blocks: int = 2048
    max_model_len: int = 1024
    multiplier: float = 1.5
    duration_s: float = 30.0
    warmup_s: float = 5.0
    drain_s: float = 60.0
    capacity_s: float = 14.0
    capacity_warmup_s: float = 4.0
    interactive_share: float = 0.3
    interactive_prompt: int = 64
    interactive_output: int = 32
    batch_prompt: int = 256
    batch_output: int = 128
    batch_b_share: float = 0.2
    ttft_ms: float = 1000.0
    batch_max_requests: int = 32
    batch_max_wait_s: float = 10.0
    batch_headroom: float = 0.125
    #: Engines schedule by priority and preempt lower priorities for a full batch (SGLang's
    #: --enable-priority-scheduling; the simulator's --scheduling-policy priority --priority-preemption);
    #: kvgate-flow writes each request's band into its body (flow/engine_priority) and lets interactive
    #: go past the in-flight limit by ``interactive_overcommit`` (a negative headroom).
    engine_priority: bool = False
    interactive_overcommit: float = 0.5
    #: The engines of a priority fleet also preempt for a full batch (SGLang); False: vLLM's v1 scheduler.
    engine_preemption: bool = True
    #: The kvgate-flow-priority target's batch headroom.
    priority_batch_headroom: float = 0.0
    seed: int = 1

    def sim_args(self, priority_fleet: bool = False) -> tuple[str, ...]:
        """The simulator's flags; with ``engine_priority`` or ``priority_fleet`` its engines schedule by
        priority (and preempt, with ``engine_preemption``)."""
        priority: tuple[str, ...] = ()
        if self.engine_priority or priority_fleet:
            priority = ("--scheduling-policy", "priority")
            if self.engine_preemption:
                threshold = str(SGLANG_PREEMPTION_THRESHOLD)
                priority += ("--priority-preemption", "--priority-preemption-threshold", threshold)
        return (
            "--time-scale", str(self.time_scale),
            "--max-num-seqs", str(self.max_num_seqs),
            *step_args(self),
            *priority,
        )  # fmt: skip

    def derived_capacity_req_s(self) -> float:
        """Requests/s the step model predicts for the fleet: ``max_num_seqs`` sequences always running,
        each step decoding all of them and prefilling the prompts of those that start (mean mix)."""
        share = self.interactive_share
        out = share * self.interactive_output + (1 - share) * self.batch_output
        prompt = share * self.interactive_prompt + (1 - share) * self.batch_prompt
        n = self.max_num_seqs
        step_ms = (
            self.step_base_ms
            + self.decode_ms_per_seq * n
            + 1e3 / self.prefill_tokens_per_s * n * prompt / out
        )
        step_s = self.time_scale * step_ms / 1e3
        return self.replicas * n / (out * step_s)


#: SGLang's ``--priority-scheduling-preemption-threshold`` default (``server_args.py``): a waiting request
#: preempts a running one only when their priorities differ by more than this. The preempting fleet runs
#: with it, and kvgate-flow spreads the bands past it (``flow/engine_priority`` ``scale``), as an operator
#: of SGLang engines with default flags would.
SGLANG_PREEMPTION_THRESHOLD = 10


def quick_config() -> FlowConfig:
    """The smoke run: a fast fleet and a few seconds of arrivals (figures mean nothing)."""
    return FlowConfig(
        time_scale=0.5,
        duration_s=3.0,
        warmup_s=1.0,
        drain_s=30.0,
        capacity_s=3.0,
        capacity_warmup_s=1.0,
        interactive_prompt=16,
        interactive_output=8,
        batch_prompt=32,
        batch_output=16,
        batch_max_wait_s=2.0,
    )


def flow_overlay(config: FlowConfig, limits: bool, engine_priority: bool | None = None) -> dict[str, Any]:
    """The gateway config laid over ``kvgate up``'s: the two objectives (an unknown objective is a 400),
    and with ``limits`` flow control: the interactive TTFT target (a deadline: predicted or past, a 429
    ``slo_unattainable``) and the ``[flow]`` settings (per engine at most ``max_num_seqs`` in flight;
    batch band bounds and headroom). Without ``limits`` the objectives carry no deadline, so nothing is
    held or shed. ``engine_priority`` (``None``: ``config.engine_priority``): the band goes to the engines
    (whose order, ``low_first``, the overlay states: the bench's endpoints are given by URL and declare
    none), interactive may go past the limit, and batch keeps ``priority_batch_headroom`` (with
    ``config.engine_priority``: ``batch_headroom``)."""
    telling = config.engine_priority if engine_priority is None else engine_priority
    headroom = config.batch_headroom
    if telling and not config.engine_priority:
        headroom = config.priority_batch_headroom
    interactive: dict[str, Any] = {"priority": 1}
    if limits:
        interactive["ttft_ms"] = config.ttft_ms
    overlay: dict[str, Any] = {"objectives": {"interactive": interactive, "batch": {"priority": 0}}}
    if limits:
        overlay["flow"] = {
            "saturation": {"max_in_flight": config.max_num_seqs},
            "bands": {
                "0": {
                    "max_requests": config.batch_max_requests,
                    "max_wait_s": config.batch_max_wait_s,
                    "headroom": headroom,
                }
            },
            "fairness": "tokens",
        }
        if telling:
            overlay["flow"]["bands"]["1"] = {"headroom": -config.interactive_overcommit}
            # SGLang preempts only for a priority more than its threshold apart: bands spread past it.
            scale = SGLANG_PREEMPTION_THRESHOLD + 1 if config.engine_preemption else 1
            overlay["flow"]["engine_priority"] = {"order": "low_first", "scale": scale}
    return overlay


def flow_of(session: Session) -> str:
    """``interactive``, ``batch-a`` or ``batch-b``: the session's key."""
    return session.key


def headers_for(session: Session, turn: int) -> Mapping[str, str]:
    """The objective (and for batch, the fairness id) a request of ``session`` carries."""
    if session.key == "interactive":
        return {OBJECTIVE_HEADER: "interactive"}
    return {OBJECTIVE_HEADER: "batch", FAIRNESS_HEADER: session.key}


def make_sessions(config: FlowConfig, arrivals: Sequence[float], tag: str) -> list[Session]:
    """One single-turn session per arrival: its class drawn by ``interactive_share`` and, for batch, its
    flow by ``batch_b_share`` (seeded; ``tag`` keeps capacity and overload prompts apart). Prompts are
    distinct random words (no prefix-cache hits to favour one router)."""
    rng = random.Random(f"{config.seed}-{tag}-classes")
    text = smollm2_text()
    sessions = []
    for i, start in enumerate(arrivals):
        if rng.random() < config.interactive_share:
            key, prompt, out = "interactive", config.interactive_prompt, config.interactive_output
        else:
            key = "batch-b" if rng.random() < config.batch_b_share else "batch-a"
            prompt, out = config.batch_prompt, config.batch_output
        content = text.words(prompt, rng)
        turn = Turn(({"role": "user", "content": content},), out)
        sessions.append(Session(f"{tag}-{i}", key, start, (), (turn,)))
    return sessions


def overload_sessions(config: FlowConfig, capacity_req_s: float) -> list[Session]:
    rate = config.multiplier * capacity_req_s
    arrivals = poisson_arrivals(rate, config.duration_s, random.Random(f"{config.seed}-arrivals"))
    return make_sessions(config, arrivals, "overload")


def measure_capacity(config: FlowConfig, fleet: tg.Fleet, workdir: Path) -> dict[str, Any]:
    """Closed loop at twice the fleet's running slots through round robin: completions per second."""
    concurrency = 2 * config.replicas * config.max_num_seqs
    fleet.reset()
    running = tg.start("round-robin", fleet, DEFAULT_MODEL, ensure_model_dir(smollm2_gguf_path()), workdir)
    sessions = make_sessions(
        config, closed_arrivals(int(concurrency * config.capacity_s * 4) + 1), "capacity"
    )
    options = LoadOptions(
        DEFAULT_MODEL,
        mode="closed",
        concurrency=concurrency,
        duration_s=config.capacity_s,
        drain_s=config.drain_s,
        progress=False,
    )
    try:
        result = asyncio.run(run_load(sessions, running.route, options))
    finally:
        running.stop()
    window = config.capacity_s - config.capacity_warmup_s
    done = [
        r
        for r in result.records
        if r.ok and config.capacity_warmup_s <= r.sent_s + (r.e2e_s or 0) <= config.capacity_s
    ]
    measured = len(done) / window
    return {
        "method": f"closed loop, {concurrency} concurrent requests of the mix via round robin, completions"
        f" per second from {config.capacity_warmup_s:g} s to {config.capacity_s:g} s",
        "measured_req_s": round(measured, 3),
        "measured_output_tok_s": round(sum(r.completion_tokens for r in done) / window, 1),
        "derived_req_s": round(config.derived_capacity_req_s(), 3),
    }


def _start(name: str, config: FlowConfig, fleet: tg.Fleet, workdir: Path) -> tg.Running:
    model_dir = ensure_model_dir(smollm2_gguf_path())
    if name in ("kvgate-flow", "kvgate-no-flow", PRIORITY_TARGET):
        options = StackOptions(
            port=0,
            model=DEFAULT_MODEL,
            endpoints=tuple(f"http://{a}" for a in fleet.addresses),
            engine="vllm",
            model_dir=str(model_dir),
            index={"mode": "approximate"},
            overlay=flow_overlay(
                config,
                limits=name != "kvgate-no-flow",
                engine_priority=True if name == PRIORITY_TARGET else None,
            ),
            workdir=workdir,
        )
        stack = Stack(options)
        try:
            stack.start()
        except BaseException:
            stack.stop()
            raise
        return tg.Running(FixedRoute(stack.url), stack=stack)
    return tg.start(name, fleet, DEFAULT_MODEL, model_dir, workdir)


def _ttft_ms(samples: Sequence[float]) -> dict[str, float | int]:
    return summary([s * 1e3 for s in samples])


def class_metrics(
    records: Sequence[RequestRecord], klass: str, wall_s: float, ttft_ms: float
) -> dict[str, Any]:
    """One class's figures (see the module docstring)."""
    ok = [r for r in records if r.ok]
    shed = [r for r in records if r.status == "429"]
    other = [r for r in records if not r.ok and r.status != "429"]
    if klass == "interactive":
        good = sum(1 for r in ok if r.ttft_s is not None and r.ttft_s * 1e3 <= ttft_ms)
    else:
        good = len(ok)
    return {
        "requests": len(records),
        "served": len(ok),
        "goodput": round(good / len(records), 4) if records else float("nan"),
        "ttft_ms": _ttft_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "output_tok_s": round(sum(r.completion_tokens for r in ok) / wall_s, 1) if wall_s > 0 else 0.0,
        "shed": counts([r.error_code or "none" for r in shed]),
        "shed_total": len(shed),
        "errors": counts([r.status for r in other]),
        "lost": len(other),
    }


def max_min_shares(demands: Sequence[float], capacity: float) -> list[float]:
    """Water-filling: each flow gets min(its demand, an equal split of what the others leave)."""
    shares = [0.0] * len(demands)
    left = capacity
    order = sorted(range(len(demands)), key=lambda i: demands[i])
    for k, i in enumerate(order):
        shares[i] = min(demands[i], left / (len(order) - k))
        left -= shares[i]
    return shares


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n sum x^2); 1.0 = all equal; NaN with nothing."""
    squares = sum(v * v for v in values)
    return round(sum(values) ** 2 / (len(values) * squares), 4) if squares > 0 else float("nan")


def fairness(
    records: Sequence[RequestRecord],
    flows: Mapping[str, str],
    demand: Mapping[str, int],
    start_s: float,
    end_s: float,
) -> dict[str, Any]:
    """The batch flows over ``[start_s, end_s]``: served output tokens finished in it, demand (``max_tokens``
    of requests sent in it), Jain's index of served over max-min share and of served alone; and each
    flow's 429s by code over the whole run."""
    served = {f: 0 for f in BATCH_FLOWS}
    asked = {f: 0 for f in BATCH_FLOWS}
    shed: dict[str, list[str]] = {f: [] for f in BATCH_FLOWS}
    for r in records:
        flow = flows[r.session]
        if flow not in served:
            continue
        if r.status == "429":
            shed[flow].append(r.error_code or "none")
        if start_s <= r.sent_s <= end_s:
            asked[flow] += demand[r.session]
        if r.ok and start_s <= r.sent_s + (r.e2e_s or 0.0) <= end_s:
            served[flow] += r.completion_tokens
    shares = max_min_shares([asked[f] for f in BATCH_FLOWS], sum(served.values()))
    normalized = [served[f] / s if s > 0 else 0.0 for f, s in zip(BATCH_FLOWS, shares, strict=True)]
    return {
        "window_s": [start_s, end_s],
        "served_tokens": served,
        "demand_tokens": asked,
        "max_min_share_tokens": dict(zip(BATCH_FLOWS, [round(s, 1) for s in shares], strict=True)),
        "shed_by_flow": {f: counts(codes) for f, codes in shed.items()},
        "jain": jain(normalized),
        "jain_raw": jain([float(served[f]) for f in BATCH_FLOWS]),
    }


def target_metrics(result: RunResult, sessions: Sequence[Session], config: FlowConfig) -> dict[str, Any]:
    """Every figure of one target's run."""
    flows = {s.id: flow_of(s) for s in sessions}
    demand = {s.id: s.turns[0].max_tokens for s in sessions}
    records = result.records
    by_class = {
        "interactive": [r for r in records if flows[r.session] == "interactive"],
        "batch": [r for r in records if flows[r.session] != "interactive"],
    }
    ok = [r for r in records if r.ok]
    sent = sum(1 for s in sessions if s.start_s <= config.duration_s)
    return {
        "sent": sent,
        "recorded": len(records),
        "wall_s": round(result.wall_s, 2),
        "output_tok_s": round(sum(r.completion_tokens for r in ok) / result.wall_s, 1)
        if result.wall_s
        else 0.0,
        "lost": sent - sum(1 for r in records if r.ok or r.status == "429"),
        "classes": {k: class_metrics(v, k, result.wall_s, config.ttft_ms) for k, v in by_class.items()},
        "fairness": fairness(records, flows, demand, config.warmup_s, config.duration_s),
    }


def run_target(
    name: str, config: FlowConfig, fleet: tg.Fleet, sessions: list[Session], workdir: Path, progress: bool
) -> dict[str, Any]:
    """Reset the fleet, start ``name``, send ``sessions``, stop it; its row (``skipped`` if it cannot run)."""
    fleet.reset()
    started = time.monotonic()
    try:
        running = _start(name, config, fleet, workdir / name)
    except (tg.TargetUnavailable, ChildFailed) as exc:
        return skipped(name, exc, log)
    before = CpuSample.take()
    options = LoadOptions(
        DEFAULT_MODEL,
        duration_s=config.duration_s,
        drain_s=config.drain_s,
        progress=progress,
        label=name,
        headers=headers_for,
    )
    try:
        result = asyncio.run(run_load(sessions, running.route, options))
    finally:
        other = before.other_cores(CpuSample.take())
        running.stop()
    row = {"target": name, **target_metrics(result, sessions, config), "other_cpu_cores": other}
    row["run_s"] = round(time.monotonic() - started, 1)
    inter, batch = row["classes"]["interactive"], row["classes"]["batch"]
    print(
        f"{name:<15} interactive goodput {inter['goodput']:.3f} ttft p90 {inter['ttft_ms']['p90']:8.1f} ms"
        f"  batch served {batch['goodput']:.3f} shed {batch['shed_total']:4d}  out {row['output_tok_s']:7.1f}"
        f" tok/s  jain {row['fairness']['jain']:.3f}  lost {row['lost']}",
        file=sys.stderr,
        flush=True,
    )
    return row


def run_fleet(config: FlowConfig, targets: Sequence[str], workdir: Path, progress: bool) -> dict[str, Any]:
    """Start the fleet, measure its capacity, run every target at ``multiplier`` x capacity."""
    sim_args = config.sim_args(priority_fleet=PRIORITY_TARGET in targets)
    spec = tg.FleetSpec(config.replicas, config.kv_blocks, config.max_model_len, sim_args)
    fleet = tg.Fleet(spec, DEFAULT_MODEL, ensure_model_dir(smollm2_gguf_path()), workdir / "fleet")
    try:
        capacity = measure_capacity(config, fleet, workdir / "capacity")
        sessions = overload_sessions(config, capacity["measured_req_s"])
        rows = [run_target(t, config, fleet, sessions, workdir, progress) for t in targets]
    finally:
        fleet.stop()
    return {
        "sim_args": list(sim_args),
        "capacity": capacity,
        "arrival_req_s": round(config.multiplier * capacity["measured_req_s"], 3),
        "requests": len(sessions),
        "targets": {r["target"]: r for r in rows},
    }


def _goal(value: float, goal: str, met: bool) -> dict[str, Any]:
    return {"value": value, "goal": goal, "met": met}


def goals(targets: Mapping[str, Mapping[str, Any]], flow_target: str = "kvgate-flow") -> dict[str, Any]:
    """Issue 17's goals from the ``flow_target`` and kvgate-no-flow rows (every run target for ``lost``)."""
    flow, plain = targets.get(flow_target, {}), targets.get("kvgate-no-flow", {})
    out: dict[str, Any] = {}
    if "classes" in flow:
        g = flow["classes"]["interactive"]["goodput"]
        out["interactive_goodput_flow"] = _goal(g, ">= 0.95", g >= 0.95)
        j = flow["fairness"]["jain"]
        out["jain_flow"] = _goal(j, ">= 0.95", j >= 0.95)
    if "classes" in plain:
        g = plain["classes"]["interactive"]["goodput"]
        out["interactive_goodput_no_flow"] = _goal(g, "< 0.5", g < 0.5)
    if "classes" in flow and "classes" in plain and plain["output_tok_s"] > 0:
        r = round(flow["output_tok_s"] / plain["output_tok_s"], 3)
        out["output_tok_s_flow_over_no_flow"] = _goal(r, ">= 0.95", r >= 0.95)
    lost = sum(int(t["lost"]) for t in targets.values() if "lost" in t)
    out["lost_all_targets"] = _goal(lost, "== 0", lost == 0)
    return out


def sweep(
    config: FlowConfig, workdir: Path, progress: bool, extra: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Each key parameter halved and doubled; kvgate-flow, kvgate-no-flow and round robin each time (and
    ``extra`` targets)."""
    variants = step_variants(config, "multiplier")
    out = []
    for i, (param, factor, varied) in enumerate(variants):
        print(f"sweep: {param} x{factor:g}", file=sys.stderr, flush=True)
        got = run_fleet(varied, (*SWEEP_TARGETS, *extra), workdir / f"sweep-{i}", progress)
        rows = got["targets"]
        goodput = {t: rows[t]["classes"]["interactive"]["goodput"] for t in rows if "classes" in rows[t]}
        out.append(
            {
                "parameter": param,
                "factor": factor,
                "config": _sim_params(varied),
                "capacity": got["capacity"],
                "arrival_req_s": got["arrival_req_s"],
                "interactive_goodput": goodput,
                "output_tok_s": {t: rows[t]["output_tok_s"] for t in rows if "classes" in rows[t]},
                "jain": {t: rows[t]["fairness"]["jain"] for t in rows if "classes" in rows[t]},
                "lost": {t: rows[t]["lost"] for t in rows if "classes" in rows[t]},
                "ranking_holds": goodput.get("kvgate-flow", -1.0) >= goodput.get("kvgate-no-flow", 2.0),
                **(
                    {
                        "ranking_holds_priority": goodput.get(PRIORITY_TARGET, -1.0)
                        >= goodput.get("kvgate-no-flow", 2.0)
                    }
                    if PRIORITY_TARGET in extra
                    else {}
                ),
                "targets": rows,
            }
        )
    return out


def _sim_params(config: FlowConfig) -> dict[str, Any]:
    keys = (
        "replicas",
        "max_num_seqs",
        "time_scale",
        "step_base_ms",
        "decode_ms_per_seq",
        "prefill_tokens_per_s",
        "multiplier",
        "engine_priority",
        "engine_preemption",
    )
    return {k: getattr(config, k) for k in keys}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m load.bench.flow", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/flow.json"), help="result JSON file")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (seconds, figures meaningless)")
    sweeping = p.add_mutually_exclusive_group()
    sweeping.add_argument("--sweep", action="store_true", help="also the sim-parameter sweep (~17 min more)")
    sweeping.add_argument(
        "--sweep-only", action="store_true", help="the sim-parameter sweep alone, without the main run"
    )
    p.add_argument("--targets", help=f"comma-separated subset of {','.join(TARGETS)}")
    p.add_argument("--no-peers", action="store_true", help="leave out sglang-router and vllm-router")
    p.add_argument("--duration", type=float, help="seconds of arrivals (default 30)")
    p.add_argument("--multiplier", type=float, help="arrival rate over measured capacity (default 1.5)")
    p.add_argument("--replicas", type=int, help="simulated replicas (default 2)")
    p.add_argument("--seed", type=int, help="workload seed (default 1)")
    p.add_argument(
        "--batch-headroom",
        type=float,
        help="share of each engine's in-flight limit the batch band leaves to interactive (default 0.125)",
    )
    p.add_argument(
        "--engine-priority",
        action="store_true",
        help="engines preempt by priority and kvgate-flow passes the band (batch headroom 0 unless given)",
    )
    p.add_argument(
        "--vllm-priority",
        action="store_true",
        help="a priority fleet's engines schedule as vLLM's v1 scheduler (no preemption for a waiting one)",
    )
    p.add_argument(
        "--priority-batch-headroom",
        type=float,
        help=f"{PRIORITY_TARGET}'s batch headroom (default 0: batch fills every slot)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = quick_config() if args.quick else FlowConfig()
    for key, value in (
        ("duration_s", args.duration),
        ("multiplier", args.multiplier),
        ("replicas", args.replicas),
        ("seed", args.seed),
        ("batch_headroom", args.batch_headroom),
        ("priority_batch_headroom", args.priority_batch_headroom),
    ):
        if value is not None:
            config = replace(config, **{key: value})
    if args.engine_priority:
        config = replace(config, engine_priority=True)
        if args.batch_headroom is None:
            config = replace(config, batch_headroom=0.0)
    if args.vllm_priority:
        config = replace(config, engine_preemption=False)
    targets: tuple[str, ...] = DEFAULT_TARGETS
    if args.targets:
        targets = chosen_targets(p, args.targets, TARGETS)
    elif args.quick:
        targets = ("kvgate-flow", "kvgate-no-flow", "round-robin")
    if args.no_peers:
        targets = tuple(t for t in targets if t not in ("sglang-router", "vllm-router"))
    workdir = args.out.resolve().parent / f"{args.out.stem}-work"
    result = header("flow", argv, args.quick, config)
    started = time.monotonic()
    result |= {
        "sim": {"parameters": _sim_params(config), "sources": SIM_SOURCES},
        "kvgate_flow_overlay": flow_overlay(config, limits=True),
        "kvgate_no_flow_overlay": flow_overlay(config, limits=False),
        "kvgate_flow_priority_overlay": flow_overlay(config, limits=True, engine_priority=True),
    }
    if not args.sweep_only:
        main_run = run_fleet(config, targets, workdir / "main", not args.no_progress)
        result.update(main_run)
        result["skipped"] = {t: r["skipped"] for t, r in main_run["targets"].items() if "skipped" in r}
        result["goals"] = goals(main_run["targets"])
        if PRIORITY_TARGET in main_run["targets"]:
            result["goals_priority"] = goals(main_run["targets"], PRIORITY_TARGET)
    if args.sweep or args.sweep_only:
        extra = (PRIORITY_TARGET,) if PRIORITY_TARGET in targets else ()
        result["sweep"] = sweep(config, workdir / "sweep", not args.no_progress, extra)
        result["sweep_ranking_holds_all"] = all(v["ranking_holds"] for v in result["sweep"])
    return finish(result, args.out, started)


if __name__ == "__main__":
    raise SystemExit(main())
