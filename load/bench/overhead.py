"""Gateway overhead: requests through Envoy + ext_proc against the same requests sent straight to an engine.

One run starts the stack users get (:class:`kvgate.dev.up.Stack`: simulated replicas, the ext_proc, Envoy)
with the simulator's step time scaled to 0 so engines answer at once, and beside it, over the same
replicas, every other target. It then alternates rounds over the targets (order rotated each round):

* ``direct``: one simulator replica;
* ``envoy_rr``: a plain Envoy (the gateway's bootstrap without the ext_proc filter), round-robin;
* ``empty``: the floor: the gateway's own Envoy bootstrap (same ext_proc filter, processing mode,
  message timeout and clusters, rendered by :func:`kvgate.envoy.bootstrap.render`) in front of an empty
  grpc.aio processor (:mod:`load.bench.empty_extproc`) that routes every request to replica 0;
* ``gateway``: Envoy + ext_proc (kvgate);
* ``gateway_2w``: the same gateway with 2 ext_procs (``StackOptions(extprocs=2)``) over the same replicas;
* ``sglang-router``, ``vllm-router``: the peer routers (:mod:`load.bench.peers`, ``cache_aware``) over the
  same replicas; one that cannot be installed or started is reported under ``skipped`` with the reason.

Requests are short chats with ``max_tokens: 1``, non-streamed and streamed, in a closed loop at
concurrency 1 and 32, from a load client in its own process (``python -m load.bench.overhead client``,
aiohttp, keep-alive connections, 127.0.0.1 only, bounded in count and time). Around each round the CPU
time (utime + stime from ``/proc/PID/stat``) of every process is read; a target's own processes (its
Envoy and ext_procs, or the peer router and its children) give its CPU per request.

    python -m load.bench.overhead --out results/overhead.json [--quick] [--targets a,b] [--no-peers]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvgate.dev.procs import Child, http_get, start_envoy
from kvgate.dev.up import DEFAULT_MODEL, Stack, StackOptions
from kvgate.envoy.bootstrap import EnvoyParams, render_baseline, render_yaml
from load.bench import (
    CpuSample,
    Pids,
    add_quiet_arguments,
    cpu_seconds,
    idle_cpu,
    machine,
    peers,
    percentile,
    quietest,
    ratio,
    revision,
    summary,
    write_json,
)

PATH = "/v1/chat/completions"
SIM_ARGS = ("--time-scale", "0")
PEERS = tuple(peers.PEERS)
TARGETS = ("direct", "envoy_rr", "empty", "gateway", "gateway_2w", *PEERS)
"""Every target, in the order of the first round."""
CLIENT_TIMEOUT_S = 30.0
"""Per-request timeout of the load client."""
EMPTY_READY_S = 60.0


@dataclass(frozen=True, slots=True)
class Goals:
    """Issue 27's goals. Added latency: gateway minus direct, non-streamed, concurrency 1 (us, below the
    goal). ``rps_vs_envoy_rr``: gateway req/s over plain Envoy's at the saturating concurrency (at least).
    ``extproc_cpu_ms``: the gateway's ext_proc CPU per request, net of idle, saturating (at most).
    kvgate's own share, gateway minus ``empty``: ``own_added_us`` (p50 at concurrency 1) and
    ``own_cpu_ms`` (ext_proc CPU per request), at most."""

    added_p50_us: float = 1000.0
    added_p99_us: float = 2000.0
    rps_vs_envoy_rr: float = 0.6
    extproc_cpu_ms: float = 0.35
    own_added_us: float = 200.0
    own_cpu_ms: float = 0.1


GOALS = Goals()


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


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants now (``/proc/PID/task/*/children``): a peer's script may run the
    router as its child."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo.extend(int(c) for c in children.read_text().split())
    return out


def decision_totals(metrics_urls: Sequence[str]) -> tuple[float, int] | None:
    """``kvgate_decision_seconds`` histogram (sum in seconds, count) over the ext_procs' Prometheus pages
    ``metrics_urls``, summed; ``None`` without pages or when one does not answer with it."""
    total, count = 0.0, 0
    for url in metrics_urls:
        got = http_get(url)
        if got is None or got[0] != 200:
            return None
        seconds, decisions = None, None
        for line in got[1].decode().splitlines():
            if line.startswith("kvgate_decision_seconds_sum "):
                seconds = float(line.split()[1])
            elif line.startswith("kvgate_decision_seconds_count "):
                decisions = int(float(line.split()[1]))
        if seconds is None or decisions is None:
            return None
        total, count = total + seconds, count + decisions
    return (total, count) if metrics_urls else None


def start_plain_envoy(workdir: Path, addresses: Sequence[str]) -> tuple[Child, str]:
    """Start the round-robin Envoy (kvgate's bootstrap without the ext_proc); return it and its base URL."""
    child, _admin, port = start_envoy("envoy-plain", render_baseline(addresses), workdir, listener="openai")
    return child, f"http://127.0.0.1:{port}"


def start_empty(workdir: Path, upstream: str, later: contextlib.ExitStack) -> tuple[Child, Child, str]:
    """Start the empty processor (routing to ``upstream``) and, in front of it, Envoy on the bootstrap
    ``kvgate up`` renders (defaults: same filter, processing mode, message timeout, clusters, access
    log), each stopped by ``later``; return both and Envoy's base URL."""
    ready = workdir / "empty-extproc.ready.json"
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "load.bench.empty_extproc", "--port", "0", "--ready-file", str(ready)]
    extproc = Child("empty-extproc", [*argv, "--upstream", upstream], workdir / "empty-extproc.log")
    later.callback(extproc.stop)
    port = int(extproc.wait_for_json_file(ready, EMPTY_READY_S)["extproc"])
    params = EnvoyParams(
        listen_port=0,
        admin_port=0,
        extproc_port=port,
        access_log_path=str(workdir / "envoy-empty.access.log"),
    )
    envoy, _admin, listen = start_envoy("envoy-empty", render_yaml(params), workdir, listener="openai")
    later.callback(envoy.stop)
    return extproc, envoy, f"http://127.0.0.1:{listen}"


@dataclass(frozen=True, slots=True)
class Target:
    """A started target: the URL the client sends to, its own processes (name -> PIDs: Envoy, ext_procs,
    a peer router; none for ``direct``), which of them are ext_procs, and the ext_procs' Prometheus pages
    (the decision time of kvgate's)."""

    url: str
    procs: Mapping[str, Pids] = field(default_factory=dict)
    extprocs: tuple[str, ...] = ()
    metrics_urls: tuple[str, ...] = ()


def start_targets(
    names: Sequence[str], stack: Stack, workdir: Path, replicas: int, later: contextlib.ExitStack
) -> tuple[dict[str, Target], dict[str, str]]:
    """Start ``names`` over ``stack``'s replicas (processes stopped by ``later``); return the started
    targets and the skipped ones' reasons (a peer that could not be installed or launched)."""
    assert stack.extproc is not None and stack.envoy is not None, "the stack runs the gateway"
    addresses = [e["address"] for e in stack.engines]
    started: dict[str, Target] = {}
    skipped: dict[str, str] = {}
    for name in names:
        if name == "direct":
            started[name] = Target(f"http://{addresses[0]}{PATH}")
        elif name == "envoy_rr":
            plain, plain_url = start_plain_envoy(workdir, addresses)
            later.callback(plain.stop)
            started[name] = Target(plain_url + PATH, {"envoy_rr": plain.pid})
        elif name == "empty":
            extproc, envoy, url = start_empty(workdir, addresses[0], later)
            procs: dict[str, Pids] = {"empty_extproc": extproc.pid, "empty_envoy": envoy.pid}
            started[name] = Target(url + PATH, procs, ("empty_extproc",))
        elif name == "gateway":
            procs = {"extproc": stack.extproc.pid, "envoy": stack.envoy.pid}
            started[name] = Target(stack.url + PATH, procs, ("extproc",), _metrics_urls(stack))
        elif name == "gateway_2w":
            two = Stack(
                StackOptions(
                    replicas=replicas,
                    extprocs=2,
                    port=0,
                    model=DEFAULT_MODEL,
                    endpoints=tuple(f"http://{a}" for a in addresses),
                    engine="sim",
                    workdir=workdir / "gateway_2w",
                )
            )
            later.callback(two.stop)
            two.start()
            assert two.envoy is not None
            procs = {"extproc_2w": [e.pid for e in two.extprocs], "envoy_2w": two.envoy.pid}
            started[name] = Target(two.url + PATH, procs, ("extproc_2w",), _metrics_urls(two))
        elif name in peers.PEERS:
            spec = peers.PEERS[name]
            try:
                bin_dir = peers.install(spec)
                child, url = peers.launch(spec, bin_dir, [f"http://{a}" for a in addresses], workdir)
            except peers.PeerUnavailable as exc:
                skipped[name] = str(exc)
                print(f"{name}: skipped: {exc}", file=sys.stderr)
                continue
            later.callback(child.stop)
            started[name] = Target(url + PATH, {name: process_tree(child.pid)})
        else:
            raise ValueError(f"unknown target {name!r}")
    return started, skipped


def _metrics_urls(stack: Stack) -> tuple[str, ...]:
    return tuple(
        f"http://127.0.0.1:{p['metrics']}/metrics" for p in stack.extproc_listeners if "metrics" in p
    )


# --- the benchmark ------------------------------------------------------------------------------------

#: Added-latency comparisons per cell besides every target's over ``direct``: (name, over, base).
COMPARISONS = (
    ("gateway_vs_envoy_rr", "gateway", "envoy_rr"),
    ("gateway_vs_empty", "gateway", "empty"),
    ("empty_vs_envoy_rr", "empty", "envoy_rr"),
    ("gateway_2w_vs_gateway", "gateway_2w", "gateway"),
)


def aggregate(rounds: Sequence[Mapping[str, Any]], targets: Sequence[str]) -> dict[str, Any]:
    """Pooled latency percentiles, rounds' requests/s and added latency per (stream, concurrency)."""
    out: dict[str, Any] = {}
    keys = sorted({(r["stream"], r["concurrency"]) for r in rounds})
    pairs = [(f"{t}_vs_direct", t, "direct") for t in targets if t != "direct"] + list(COMPARISONS)
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
                "rps_median": round(percentile(rps, 50), 1),
                "rps_rounds": [round(x, 1) for x in rps],
                "p50_us_rounds": [r["latency_us"]["p50"] for r in mine],
                "completed": sum(len(r["latencies_us"]) for r in mine),
                "errors": sum(r["errors"] for r in mine),
            }
        added: dict[str, Any] = {}
        for name, over, base in pairs:
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
    rounds: Sequence[Mapping[str, Any]],
    saturating: int,
    idle_ms_per_s: Mapping[str, float],
    targets: Mapping[str, Target],
) -> dict[str, Any]:
    """CPU milliseconds per request in each target's non-streamed rounds at ``saturating`` concurrency.

    ``<proc>_ms_per_req``, for the target's own processes and the simulators (``sim``): the process's CPU
    over the rounds (client start-up included) divided by the requests sent; ``<proc>_net_ms_per_req``:
    the same less its idle rate ``idle_ms_per_s`` (metrics scraping, timers) over the rounds' span, i.e.
    what the requests themselves cost. ``router_[net_]ms_per_req``: all the target's own processes
    (Envoy and ext_procs, or the peer router); ``extproc_total_[net_]ms_per_req``: its ext_procs alone.
    """
    sat = [r for r in rounds if r["concurrency"] == saturating and not r["stream"]]
    out: dict[str, Any] = {}
    for target, spec in targets.items():
        mine = [r for r in sat if r["target"] == target]
        if not mine:
            continue
        sent = sum(r["sent"] for r in mine)
        span = sum(r["span_s"] for r in mine)
        entry: dict[str, float] = {}
        gross: dict[str, float] = {}
        net: dict[str, float] = {}
        for proc in [*spec.procs, "sim"]:
            gross[proc] = sum(r["cpu_s"][proc] for r in mine)
            net[proc] = max(0.0, gross[proc] - idle_ms_per_s.get(proc, 0.0) / 1e3 * span)
            entry[f"{proc}_ms_per_req"] = round(gross[proc] / sent * 1e3, 3)
            entry[f"{proc}_net_ms_per_req"] = round(net[proc] / sent * 1e3, 3)
        for label, procs in (("router", tuple(spec.procs)), ("extproc_total", spec.extprocs)):
            if procs:
                entry[f"{label}_ms_per_req"] = round(sum(gross[p] for p in procs) / sent * 1e3, 3)
                entry[f"{label}_net_ms_per_req"] = round(sum(net[p] for p in procs) / sent * 1e3, 3)
        entry["client_ms_per_req"] = round(
            sum(r["client_cpu_s"] for r in mine) / sum(len(r["latencies_us"]) for r in mine) * 1e3, 3
        )
        decided = [r["extproc_decision_us_mean"] for r in mine if r.get("extproc_decision_us_mean")]
        if decided:
            entry["extproc_decision_us_mean"] = round(sum(decided) / len(decided), 1)
        out[target] = entry
    return out


def _goal(value: float | None, goal: float, met: bool) -> dict[str, Any]:
    return {"value": value, "goal": goal, "met": met}


def goals_and_ratios(
    cells: Mapping[str, Any], cpu: Mapping[str, Any], saturating: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Issue 27's goals (:data:`GOALS`: value, goal, met) beside the figures they come from, and the
    ratios: kvgate's own share (gateway minus ``empty``), req/s of every target over plain Envoy's and
    the gateway's at the saturating concurrency, 2 ext_procs over 1. A goal whose targets did not run
    is left out."""
    goals: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    c1 = cells.get("non_stream/c1", {}).get("added", {})
    sat = cells.get(f"non_stream/c{saturating}", {})
    direct = c1.get("gateway_vs_direct")
    if direct is not None:
        goals["added_p50_us_c1"] = _goal(
            direct["p50_us"], GOALS.added_p50_us, direct["p50_us"] < GOALS.added_p50_us
        )
        goals["added_p99_us_c1"] = _goal(
            direct["p99_us"], GOALS.added_p99_us, direct["p99_us"] < GOALS.added_p99_us
        )
    vs_rr = sat.get("added", {}).get("gateway_vs_envoy_rr")
    if vs_rr is not None:
        value = vs_rr["rps_ratio"]
        goals[f"rps_vs_envoy_rr_c{saturating}"] = _goal(
            value, GOALS.rps_vs_envoy_rr, value >= GOALS.rps_vs_envoy_rr
        )
    gateway_cpu = cpu.get("gateway", {}).get("extproc_total_net_ms_per_req")
    if gateway_cpu is not None:
        goals["extproc_cpu_ms_per_req"] = _goal(
            gateway_cpu, GOALS.extproc_cpu_ms, gateway_cpu <= GOALS.extproc_cpu_ms
        )
    own: dict[str, Any] = {}
    vs_empty = c1.get("gateway_vs_empty")
    if vs_empty is not None:
        own["added_p50_us_c1"], own["added_p99_us_c1"] = vs_empty["p50_us"], vs_empty["p99_us"]
        goals["own_added_p50_us_c1"] = _goal(
            vs_empty["p50_us"], GOALS.own_added_us, vs_empty["p50_us"] <= GOALS.own_added_us
        )
    empty_cpu = cpu.get("empty", {})
    if gateway_cpu is not None and "extproc_total_net_ms_per_req" in empty_cpu:
        own_cpu = round(gateway_cpu - empty_cpu["extproc_total_net_ms_per_req"], 3)
        own["extproc_cpu_ms_per_req"] = own_cpu
        own["router_cpu_ms_per_req"] = round(
            cpu["gateway"]["router_net_ms_per_req"] - empty_cpu["router_net_ms_per_req"], 3
        )
        goals["own_cpu_ms_per_req"] = _goal(own_cpu, GOALS.own_cpu_ms, own_cpu <= GOALS.own_cpu_ms)
    if own:
        ratios["own_share"] = own
    per_target = sat.get("targets", {})
    for base in ("envoy_rr", "gateway"):
        if base in per_target:
            rps = per_target[base]["rps_median"]
            ratios[f"rps_vs_{base}_c{saturating}"] = {
                t: ratio(v["rps_median"], rps) for t, v in per_target.items() if t != base
            }
    if "gateway" in per_target and "gateway_2w" in per_target:
        ratios[f"rps_2w_over_1w_c{saturating}"] = ratio(
            per_target["gateway_2w"]["rps_median"], per_target["gateway"]["rps_median"]
        )
    return goals, ratios


def measure_round(
    url: str,
    pids: Mapping[str, Pids],
    metrics_urls: Sequence[str],
    concurrency: int,
    requests: int,
    warmup: int,
    stream: bool,
    max_s: float,
) -> dict[str, Any]:
    """One client run against ``url`` with the CPU of each process in ``pids`` read around it, and the
    mean decision time of the ext_procs at ``metrics_urls`` (if any)."""
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    decided0 = decision_totals(metrics_urls)
    machine0 = CpuSample.take()
    started = time.monotonic()
    got = run_client(url, concurrency, requests, warmup, stream, max_s)
    span = time.monotonic() - started
    delta = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
    other = machine0.other_cores(CpuSample.take(), sum(delta.values()))
    decided1 = decision_totals(metrics_urls) if decided0 is not None else None
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


def parse_targets(text: str, no_peers: bool) -> list[str]:
    """The ``--targets`` comma list (every target when empty) in :data:`TARGETS` order, less the peers
    with ``--no-peers``; an unknown name is an error."""
    names = [t.strip() for t in text.split(",") if t.strip()] or list(TARGETS)
    unknown = sorted(set(names) - set(TARGETS))
    if unknown:
        raise ValueError(f"unknown targets {', '.join(unknown)} (known: {', '.join(TARGETS)})")
    return [t for t in TARGETS if t in names and not (no_peers and t in PEERS)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["client"]:
        return client_main(argv[1:])
    doc = (__doc__ or "").split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m load.bench.overhead", description=doc)
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (seconds, figures meaningless)")
    p.add_argument("--targets", default="", help=f"comma list of targets (default all: {','.join(TARGETS)})")
    p.add_argument("--no-peers", action="store_true", help="leave out the peer routers (never installs them)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per target and cell")
    p.add_argument("--requests-c1", type=int, default=400, help="timed requests per round at concurrency 1")
    p.add_argument("--requests-sat", type=int, default=1500, help="timed requests per saturating round")
    p.add_argument("--saturating", type=int, default=32, help="the high concurrency")
    p.add_argument("--max-round-s", type=float, default=60.0, help="a round's client stops after this")
    p.add_argument("--idle-s", type=float, default=3.0, help="window measuring each process's idle CPU")
    p.add_argument(
        "--replicas", type=int, default=4, help="simulated replicas (the fleet the ext_proc scrapes)"
    )
    p.add_argument("--idle-only", action="store_true", help="only measure idle CPU (no load rounds)")
    add_quiet_arguments(p, "round")
    args = p.parse_args(argv)
    try:
        names = parse_targets(args.targets, args.no_peers)
    except ValueError as exc:
        p.error(str(exc))
    if args.quick:
        # Enough saturating requests that each ext_proc's CPU shows in 10 ms clock ticks.
        args.rounds, args.requests_c1, args.requests_sat, args.saturating = 1, 10, 100, 4
        args.idle_s, args.max_attempts, args.quiet_wait_s = 0.2, 1, 0.0
    info = machine()
    started = time.monotonic()
    rounds: list[dict[str, Any]] = []
    idle: dict[str, float] = {}
    idle_other = 0.0
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp, contextlib.ExitStack() as later:
        workdir = Path(tmp)
        # kvgate up's stack: the replicas every target fronts, and the gateway itself.
        stack = Stack(StackOptions(replicas=args.replicas, port=0, sim_args=SIM_ARGS, workdir=workdir))
        later.callback(stack.stop)
        stack.start()
        running, skipped = start_targets(names, stack, workdir, args.replicas, later)
        targets = list(running)
        # "sim": every replica's process together (one process per replica).
        pids: dict[str, Pids] = {"sim": [s.pid for s in stack.sims]}
        for spec in running.values():
            pids.update(spec.procs)

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
                                running[target].url,
                                pids,
                                running[target].metrics_urls,
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
                            f"{'stream' if stream else 'plain ':<6} c{concurrency:<3} r{r} {target:<13} "
                            f"p50 {lat['p50']:>8.1f} p99 {lat['p99']:>8.1f} us "
                            f"{best['rps']:>7.1f} req/s errors {best['errors']} "
                            f"(other tenants {best['other_cpu_cores']:.2f} cores)",
                            file=sys.stderr,
                        )
    cells = aggregate(rounds, targets)
    cpu = cpu_at_saturation(rounds, args.saturating, idle, running)
    goals, ratios = goals_and_ratios(cells, cpu, args.saturating)
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
            "target_processes": {name: sorted(t.procs) for name, t in running.items()},
            "replicas": args.replicas,
            "sim_args": list(SIM_ARGS),
            "envoy_concurrency": 1,
            "peers": {name: peers.PEERS[name].requirement for name in names if name in PEERS},
            "request": json.loads(request_body(False)),
            "client": "aiohttp, keep-alive, closed loop, separate process",
            "quiet_threshold_cores": args.quiet_threshold,
            "max_attempts": args.max_attempts,
        },
        "unit": "microseconds",
        "cells": cells,
        "skipped": skipped,
        "idle_cpu_ms_per_s": idle,
        "idle_other_cpu_cores": idle_other,
        "cpu_at_saturation": cpu,
        "goals": goals,
        "ratios": ratios,
        "other_cpu_cores_rounds": summary([r["other_cpu_cores"] for r in rounds], 3),
        "rounds": [{k: v for k, v in r.items() if k != "latencies_us"} for r in rounds],
        "wall_s": round(time.monotonic() - started, 1),
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
