"""Gateway overhead: requests through Envoy + ext_proc against the same requests sent straight to an engine.

One run starts the stack users get (:class:`kvgate.dev.up.Stack`: simulated replicas, the ext_proc, Envoy)
with the simulator's step time scaled to 0 so engines answer at once, plus, as a second baseline, a plain
Envoy with the same listener and a round-robin cluster over the same replicas (no ext_proc). It then
alternates rounds over the targets (order rotated each round):

* ``direct``: one simulator replica;
* ``envoy_rr``: the plain round-robin Envoy;
* ``gateway``: Envoy + ext_proc (kvgate).

Requests are short chats with ``max_tokens: 1``, non-streamed and streamed, in a closed loop at
concurrency 1 and 32, from a load client in its own process (``python -m load.bench.overhead client``,
aiohttp, keep-alive connections, 127.0.0.1 only, bounded in count and time). Around each round the CPU
time (utime + stime from ``/proc/PID/stat``) of the ext_proc, Envoy and simulator processes is read.

    python -m load.bench.overhead --out results/overhead.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvgate.dev.procs import Child, http_get, start_envoy
from kvgate.dev.up import DEFAULT_MODEL, Stack, StackOptions
from kvgate.envoy.bootstrap import render_baseline
from load.bench import CpuSample, add_quiet_arguments, machine, quietest, ratio, revision, summary, write_json

PATH = "/v1/chat/completions"
SIM_ARGS = ("--time-scale", "0")
GOAL_ADDED_P50_US = 1500.0
GOAL_ADDED_P99_US = 3000.0
CLIENT_TIMEOUT_S = 30.0
"""Per-request timeout of the load client."""

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def request_body(stream: bool) -> bytes:
    """A short chat request (one block of prompt, one output token)."""
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "Say hello to the gateway benchmark, briefly please."}],
        "max_tokens": 1,
        "stream": stream,
    }
    return json.dumps(body).encode()


# --- the load client (its own process) ---------------------------------------------------------------


async def _load(
    url: str, body: bytes, concurrency: int, warmup: int, requests: int, stream: bool, max_s: float
) -> dict[str, Any]:
    """Closed loop: ``concurrency`` workers send ``warmup`` then ``requests`` requests, until ``max_s``."""
    deadline = time.monotonic() + max_s
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    headers = {"content-type": "application/json"}
    statuses: dict[str, int] = {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:

        async def one() -> int:
            started = time.perf_counter_ns()
            try:
                async with session.post(url, data=body) as resp:
                    if stream:
                        async for _chunk in resp.content.iter_any():
                            pass
                    else:
                        await resp.read()
                    status = str(resp.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                status = type(exc).__name__
            statuses[status] = statuses.get(status, 0) + 1
            return time.perf_counter_ns() - started

        async def phase(total: int) -> list[int]:
            tickets = iter(range(total))
            latencies: list[int] = []

            async def worker() -> None:
                for _ in tickets:
                    if time.monotonic() > deadline:
                        return
                    latencies.append(await one())

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return latencies

        await phase(warmup)
        warm_statuses = dict(statuses)
        statuses.clear()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        latencies = await phase(requests)
        wall = time.perf_counter() - started
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {
        "latencies_us": [round(ns / 1e3, 1) for ns in latencies],
        "wall_s": wall,
        "statuses": statuses,
        "warmup_statuses": warm_statuses,
        "client_cpu_s": cpu,
        "truncated": len(latencies) < requests,
    }


def client_main(argv: Sequence[str]) -> int:
    """``python -m load.bench.overhead client --url URL ...``: one round, JSON on stdout."""
    p = argparse.ArgumentParser(prog="python -m load.bench.overhead client")
    p.add_argument("--url", required=True)
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--requests", type=int, required=True)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--max-s", type=float, default=60.0, help="stop sending after this many seconds")
    args = p.parse_args(argv)
    if urlsplit(args.url).hostname != "127.0.0.1":
        p.error("the load client only targets 127.0.0.1")
    result = asyncio.run(
        _load(
            args.url,
            request_body(args.stream),
            args.concurrency,
            args.warmup,
            args.requests,
            args.stream,
            args.max_s,
        )
    )
    sys.stdout.write(json.dumps(result))
    return 0


def run_client(
    url: str, concurrency: int, requests: int, warmup: int, stream: bool, max_s: float
) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "load.bench.overhead",
        "client",
        f"--url={url}",
        f"--concurrency={concurrency}",
        f"--requests={requests}",
        f"--warmup={warmup}",
        f"--max-s={max_s}",
        *(["--stream"] if stream else []),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=max_s + 60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"load client failed ({done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


# --- the processes measured ---------------------------------------------------------------------------


def cpu_seconds(pids: int | Sequence[int]) -> float:
    """utime + stime of process ``pids`` (all its threads; several processes: their sum), in seconds."""
    total = 0
    for pid in [pids] if isinstance(pids, int) else pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])
    return total / _CLK_TCK


def decision_totals(metrics_url: str | None) -> tuple[float, int] | None:
    """``kvgate_decision_seconds`` histogram (sum in seconds, count) from the ext_proc's Prometheus page."""
    got = http_get(metrics_url) if metrics_url else None
    if got is None or got[0] != 200:
        return None
    total, count = None, None
    for line in got[1].decode().splitlines():
        if line.startswith("kvgate_decision_seconds_sum "):
            total = float(line.split()[1])
        elif line.startswith("kvgate_decision_seconds_count "):
            count = int(float(line.split()[1]))
    return None if total is None or count is None else (total, count)


def idle_cpu(pids: Mapping[str, int | Sequence[int]], seconds: float) -> dict[str, float]:
    """CPU milliseconds per second each process uses with no traffic (scrapers, timers), over ``seconds``."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    started = time.monotonic()
    time.sleep(seconds)  # a measurement window, not a wait for readiness
    wall = time.monotonic() - started
    return {name: round((cpu_seconds(pid) - before[name]) / wall * 1e3, 2) for name, pid in pids.items()}


def start_plain_envoy(workdir: Path, addresses: Sequence[str]) -> tuple[Child, str]:
    """Start the round-robin Envoy (kvgate's bootstrap without the ext_proc); return it and its base URL."""
    child, _admin, port = start_envoy("envoy-plain", render_baseline(addresses), workdir, listener="openai")
    return child, f"http://127.0.0.1:{port}"


# --- the benchmark ------------------------------------------------------------------------------------


def aggregate(rounds: Sequence[Mapping[str, Any]], targets: Sequence[str]) -> dict[str, Any]:
    """Pooled latency percentiles, rounds' requests/s and added latency per (stream, concurrency)."""
    out: dict[str, Any] = {}
    keys = sorted({(r["stream"], r["concurrency"]) for r in rounds})
    for stream, concurrency in keys:
        per_target: dict[str, Any] = {}
        for target in targets:
            mine = [
                r
                for r in rounds
                if (r["stream"], r["concurrency"], r["target"]) == (stream, concurrency, target)
            ]
            pooled = [x for r in mine for x in r["latencies_us"]]
            rps = sorted(r["rps"] for r in mine)
            per_target[target] = {
                "latency_us": summary(pooled),
                "rps_median": round(rps[len(rps) // 2], 1),
                "rps_rounds": [round(x, 1) for x in rps],
                "p50_us_rounds": [r["latency_us"]["p50"] for r in mine],
                "errors": sum(r["errors"] for r in mine),
            }
        added: dict[str, Any] = {}
        for name, over, base in (
            ("gateway_vs_direct", "gateway", "direct"),
            ("envoy_rr_vs_direct", "envoy_rr", "direct"),
            ("gateway_vs_envoy_rr", "gateway", "envoy_rr"),
        ):
            if over in per_target and base in per_target:
                a, b = per_target[over]["latency_us"], per_target[base]["latency_us"]
                added[name] = {
                    "p50_us": round(a["p50"] - b["p50"], 1),
                    "p99_us": round(a["p99"] - b["p99"], 1),
                    "p50_ratio": ratio(a["p50"], b["p50"]),
                    "p99_ratio": ratio(a["p99"], b["p99"]),
                    "rps_ratio": ratio(per_target[over]["rps_median"], per_target[base]["rps_median"]),
                }
        label = f"{'stream' if stream else 'non_stream'}/c{concurrency}"
        out[label] = {"stream": stream, "concurrency": concurrency, "targets": per_target, "added": added}
    return out


def cpu_at_saturation(
    rounds: Sequence[Mapping[str, Any]], saturating: int, idle_ms_per_s: Mapping[str, float]
) -> dict[str, Any]:
    """CPU milliseconds per request of each process in non-streamed rounds at ``saturating`` concurrency.

    ``<proc>_ms_per_req``: the process's CPU over the rounds (client start-up included) divided by the
    requests sent; ``<proc>_net_ms_per_req``: the same less its idle rate ``idle_ms_per_s`` (metrics
    scraping, timers) over the rounds' span, i.e. what the requests themselves cost.
    """
    sat = [r for r in rounds if r["concurrency"] == saturating and not r["stream"]]
    out: dict[str, Any] = {}
    for target in ("direct", "envoy_rr", "gateway"):
        mine = [r for r in sat if r["target"] == target]
        if not mine:
            continue
        sent = sum(r["sent"] for r in mine)
        span = sum(r["span_s"] for r in mine)
        entry: dict[str, float] = {}
        for proc in mine[0]["cpu_s"]:
            used = sum(r["cpu_s"][proc] for r in mine)
            entry[f"{proc}_ms_per_req"] = round(used / sent * 1e3, 3)
            net = used - idle_ms_per_s.get(proc, 0.0) / 1e3 * span
            entry[f"{proc}_net_ms_per_req"] = round(max(0.0, net) / sent * 1e3, 3)
        entry["client_ms_per_req"] = round(
            sum(r["client_cpu_s"] for r in mine) / sum(len(r["latencies_us"]) for r in mine) * 1e3, 3
        )
        decided = [r["extproc_decision_us_mean"] for r in mine if r.get("extproc_decision_us_mean")]
        if decided:
            entry["extproc_decision_us_mean"] = round(sum(decided) / len(decided), 1)
        out[target] = entry
    return out


def measure_round(
    url: str,
    pids: Mapping[str, int | Sequence[int]],
    metrics_url: str | None,
    concurrency: int,
    requests: int,
    warmup: int,
    stream: bool,
    max_s: float,
) -> dict[str, Any]:
    """One client run against ``url`` with the CPU of each process in ``pids`` read around it."""
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    decided0 = decision_totals(metrics_url)
    machine0 = CpuSample.take()
    started = time.monotonic()
    got = run_client(url, concurrency, requests, warmup, stream, max_s)
    span = time.monotonic() - started
    delta = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
    other = machine0.other_cores(CpuSample.take(), sum(delta.values()))
    decided1 = decision_totals(metrics_url) if decided0 is not None else None
    decision_us = None
    if decided0 is not None and decided1 is not None and decided1[1] > decided0[1]:
        decision_us = (decided1[0] - decided0[0]) / (decided1[1] - decided0[1]) * 1e6
    n = len(got["latencies_us"])
    return {
        "latencies_us": got["latencies_us"],
        "latency_us": summary(got["latencies_us"]),
        "rps": n / got["wall_s"] if got["wall_s"] > 0 else 0.0,
        "errors": n - got["statuses"].get("200", 0),
        "statuses": got["statuses"],
        "truncated": got["truncated"],
        "sent": n + sum(got["warmup_statuses"].values()),
        "span_s": span,
        "cpu_s": delta,
        "other_cpu_cores": other,
        "client_cpu_s": got["client_cpu_s"],
        "extproc_decision_us_mean": decision_us,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["client"]:
        return client_main(argv[1:])
    doc = (__doc__ or "").split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m load.bench.overhead", description=doc)
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (seconds, figures meaningless)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per target and cell")
    p.add_argument("--requests-c1", type=int, default=400, help="timed requests per round at concurrency 1")
    p.add_argument("--requests-sat", type=int, default=1500, help="timed requests per saturating round")
    p.add_argument("--saturating", type=int, default=32, help="the high concurrency")
    p.add_argument("--no-plain-envoy", action="store_true", help="skip the round-robin Envoy baseline")
    p.add_argument("--max-round-s", type=float, default=60.0, help="a round's client stops after this")
    p.add_argument("--idle-s", type=float, default=3.0, help="window measuring each process's idle CPU")
    p.add_argument(
        "--replicas", type=int, default=4, help="simulated replicas (the fleet the ext_proc scrapes)"
    )
    p.add_argument("--idle-only", action="store_true", help="only measure idle CPU (no load rounds)")
    add_quiet_arguments(p, "round")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.requests_c1, args.requests_sat, args.saturating = 1, 10, 20, 4
        args.idle_s, args.max_attempts, args.quiet_wait_s = 0.2, 1, 0.0
    info = machine()
    started = time.monotonic()
    targets = ["direct", *([] if args.no_plain_envoy else ["envoy_rr"]), "gateway"]
    rounds: list[dict[str, Any]] = []
    idle: dict[str, float] = {}
    idle_other = 0.0
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        workdir = Path(tmp)
        stack = Stack(StackOptions(replicas=args.replicas, port=0, sim_args=SIM_ARGS, workdir=workdir))
        plain: Child | None = None
        try:
            stack.start()
            if stack.extproc is None or stack.envoy is None:
                raise RuntimeError("the stack has no ext_proc or no Envoy")
            urls = {"direct": f"http://{stack.engines[0]['address']}{PATH}", "gateway": stack.url + PATH}
            # "sim": every replica's process together (one process per replica).
            pids: dict[str, int | Sequence[int]] = {
                "extproc": stack.extproc.pid,
                "envoy": stack.envoy.pid,
                "sim": [s.pid for s in stack.sims],
            }
            if not args.no_plain_envoy:
                plain, plain_url = start_plain_envoy(workdir, [e["address"] for e in stack.engines])
                urls["envoy_rr"] = plain_url + PATH
                pids["envoy_rr"] = plain.pid
            metrics_port = stack.extproc_ports.get("metrics")
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None

            def unreaped() -> float:
                return sum(cpu_seconds(pid) for pid in pids.values())

            machine0 = CpuSample.take()
            idle = idle_cpu(pids, args.idle_s)
            idle_other = machine0.other_cores(CpuSample.take(), sum(idle.values()) / 1e3 * args.idle_s)
            for stream in () if args.idle_only else (False, True):
                for concurrency in (1, args.saturating):
                    requests = args.requests_c1 if concurrency == 1 else args.requests_sat
                    warmup = max(20, 4 * concurrency) if not args.quick else 2
                    for r in range(args.rounds):
                        order = targets[r % len(targets) :] + targets[: r % len(targets)]
                        for target in order:
                            best = quietest(
                                partial(
                                    measure_round,
                                    urls[target],
                                    pids,
                                    metrics_url if target == "gateway" else None,
                                    concurrency,
                                    requests,
                                    warmup,
                                    stream,
                                    args.max_round_s,
                                ),
                                args.quiet_threshold,
                                args.max_attempts,
                                args.quiet_wait_s,
                                unreaped,
                            )
                            rounds.append(
                                {
                                    "target": target,
                                    "stream": stream,
                                    "concurrency": concurrency,
                                    "round": r,
                                    **best,
                                }
                            )
                            lat = best["latency_us"]
                            print(
                                f"{'stream' if stream else 'plain ':<6} c{concurrency:<3} r{r} {target:<9} "
                                f"p50 {lat['p50']:>8.1f} p99 {lat['p99']:>8.1f} us "
                                f"{best['rps']:>7.1f} req/s errors {best['errors']} "
                                f"(other tenants {best['other_cpu_cores']:.2f} cores)",
                                file=sys.stderr,
                            )
        finally:
            if plain is not None:
                plain.stop()
            stack.stop()
    cells = aggregate(rounds, targets)
    goals: dict[str, Any] = {}
    c1 = cells.get("non_stream/c1", {}).get("added", {}).get("gateway_vs_direct")
    if c1 is not None:
        goals["added_p50_us_c1"] = {
            "value": c1["p50_us"],
            "goal": GOAL_ADDED_P50_US,
            "met": c1["p50_us"] < GOAL_ADDED_P50_US,
        }
        goals["added_p99_us_c1"] = {
            "value": c1["p99_us"],
            "goal": GOAL_ADDED_P99_US,
            "met": c1["p99_us"] < GOAL_ADDED_P99_US,
        }
    result = {
        "benchmark": "overhead",
        "command": " ".join(["python -m load.bench.overhead", *argv]),
        "machine": info,
        "revision": revision(),
        "parameters": {
            "quick": args.quick,
            "rounds": args.rounds,
            "requests_c1": args.requests_c1,
            "requests_saturating": args.requests_sat,
            "saturating_concurrency": args.saturating,
            "targets": targets,
            "replicas": args.replicas,
            "sim_args": list(SIM_ARGS),
            "envoy_concurrency": 1,
            "request": json.loads(request_body(False)),
            "client": "aiohttp, keep-alive, closed loop, separate process",
            "quiet_threshold_cores": args.quiet_threshold,
            "max_attempts": args.max_attempts,
        },
        "unit": "microseconds",
        "cells": cells,
        "idle_cpu_ms_per_s": idle,
        "idle_other_cpu_cores": idle_other,
        "cpu_at_saturation": cpu_at_saturation(rounds, args.saturating, idle),
        "goals": goals,
        "other_cpu_cores_rounds": summary([r["other_cpu_cores"] for r in rounds], 3),
        "rounds": [{k: v for k, v in r.items() if k != "latencies_us"} for r in rounds],
        "wall_s": round(time.monotonic() - started, 1),
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
