"""Soak (issue 24 part 5): mixed load through a whole local stack for ``--duration`` seconds while the RSS
and open file descriptors of every process are sampled every ``--interval`` seconds.

The stack is ``kvgate up --agents N --kvcached`` (:class:`kvgate.dev.up.Stack`): a local etcd, N node agents
each supervising one simulated engine, one kvcached daemon per node, the ext_proc and Envoy. Every process of
it is sampled, the engines too (they are the agents' children: the whole process tree under each child the
stack started, read from ``/proc``). The load is an open loop at ``--rate`` requests/s (at most
``--concurrency`` in flight): streamed and non-streamed chats, completions, and chats sharing one of a few
long system prompts (prefix reuse), each with a unique suffix.

Each engine's KV cache is kept small (``--kv-blocks``, 1,024 blocks) so that it, and the state mirroring
it in the agents and the gateway, is full within about the warm-up: a bounded cache still filling would
read as growth. The ext_proc's own bounded caches (tokenizer segments, digest chain memo, the index's
blocks per endpoint) are kept small for the same reason (``--ext-caches small``, the default here;
:data:`SMALL_EXT_CACHES`). Growth is judged after a warm-up (``--warmup``, default 20 % of the duration): per
process, the median of the last ``--window`` samples over the median of the first ``--window`` samples
after the warm-up, minus one
(the goal: below 5 % for RSS; file descriptors are also given as a difference in count). The goal also
needs every process to last to the end with enough samples to judge, and every request sent to be answered
200 (:func:`goals_of`). The series are in the JSON (``processes[].samples``: seconds since the start, RSS in
KiB, open fds).

    python -m load.bench.soak --out results/soak.json                 # 10 minutes
    python -m load.bench.soak --quick --out /tmp/soak.json            # seconds: the JSON shape only
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from kvgate.dev.options import DEFAULT_MODEL
from kvgate.dev.up import Stack, StackOptions
from load.bench import machine, revision, summary, write_json

GOAL_GROWTH = 0.05
KINDS = ("chat", "chat_stream", "completion", "shared_prefix")
#: The mix: each request's kind with these weights.
MIX = {"chat": 3, "chat_stream": 3, "completion": 2, "shared_prefix": 2}
_PAGE = os.sysconf("SC_PAGE_SIZE") // 1024
#: Each simulated engine's KV capacity (blocks of 16 tokens; at least its 8,192-token context): small
#: enough that the engines' caches, and the state that mirrors them (each agent's translator, the
#: gateway's precise index), are full within about the warm-up at the default rate (~3 new blocks a
#: request), so that growth after it is not a cache still filling. The simulator's own 28,000 blocks take
#: this load about half an hour to fill (``--kv-blocks 0``).
KV_BLOCKS = 1024
#: ``--ext-caches small``: the ext_proc's bounded caches, made small for the same reason (at the default
#: rate each request adds about one tokenizer segment, its unique number, and ~3 new blocks to the digest
#: memo and to the index's blocks of the endpoint it went to), so that they are full within the warm-up.
#: The defaults (``--ext-caches default``: 100,000 segments, 200,000 memo entries a generation, 200,000
#: blocks per endpoint) take this load hours to fill.
SMALL_EXT_CACHES: dict[str, dict[str, int]] = {
    "index": {"capacity_blocks": 512, "chain_memo_entries": 1024},
    "tokenizer": {"segment_cache_entries": 512, "segment_cache_tokens": 16_384},
}


# --- sampling /proc ----------------------------------------------------------------------------------------


def _children_of() -> dict[int, list[int]]:
    """Every process's children, from each ``/proc/<pid>/stat``'s parent pid."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out.setdefault(ppid, []).append(int(entry))
    return out


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def tree(roots: Mapping[str, int]) -> dict[str, int]:
    """``name -> pid`` for each root and every descendant of it (``name/comm-pid``)."""
    kids = _children_of()
    out: dict[str, int] = {}
    for name, root in roots.items():
        out[name] = root
        todo = list(kids.get(root, []))
        while todo:
            pid = todo.pop()
            out[f"{name}/{_comm(pid)}-{pid}"] = pid
            todo.extend(kids.get(pid, []))
    return out


def rss_kib(pid: int) -> int | None:
    """Resident set size of ``pid`` in KiB (``/proc/<pid>/statm``), ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def open_fds(pid: int) -> int | None:
    """Open file descriptors of ``pid`` (entries of ``/proc/<pid>/fd``), ``None`` once it is gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


@dataclass
class Series:
    """One process's samples: (seconds since the start, RSS KiB, open fds)."""

    name: str
    pid: int
    comm: str
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    gone_at: float | None = None


class Sampler:
    """Samples every process of the tree under ``roots`` each ``interval_s`` seconds, on its own thread
    (the tree is re-read each time: a process that starts later joins, one that exits is marked gone)."""

    def __init__(self, roots: Mapping[str, int], interval_s: float) -> None:
        self.roots = dict(roots)
        self.interval_s = interval_s
        self.series: dict[str, Series] = {}
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def sample(self) -> None:
        now = round(time.monotonic() - self.started, 1)
        seen = set()
        for name, pid in tree(self.roots).items():
            rss, fds = rss_kib(pid), open_fds(pid)
            if rss is None or fds is None:
                continue
            seen.add(name)
            series = self.series.setdefault(name, Series(name, pid, _comm(pid)))
            series.samples.append((now, rss, fds))
        for key, series in self.series.items():
            if key not in seen and series.gone_at is None:
                series.gone_at = now

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> None:
        self.started = time.monotonic()
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def growth(values: Sequence[tuple[float, float]], warmup_s: float, window: int) -> dict[str, Any]:
    """The growth of a series after ``warmup_s``: the median of its last ``window`` values over the median
    of its first ``window`` values after the warm-up (``None`` with fewer than two samples after it)."""
    after = [v for t, v in values if t >= warmup_s]
    if len(after) < 2:
        return {"first": None, "last": None, "growth": None}
    n = max(1, min(window, len(after) // 2))
    first, last = statistics.median(after[:n]), statistics.median(after[-n:])
    return {
        "first": first,
        "last": last,
        "growth": round(last / first - 1, 4) if first > 0 else None,
    }


def judge(series: Series, warmup_s: float, window: int) -> dict[str, Any]:
    rss = growth([(t, r) for t, r, _ in series.samples], warmup_s, window)
    fds = growth([(t, f) for t, _, f in series.samples], warmup_s, window)
    return {
        "name": series.name,
        "pid": series.pid,
        "comm": series.comm,
        "gone_at_s": series.gone_at,
        "rss_kib": rss,
        "fds": {**fds, "delta": None if fds["first"] is None else fds["last"] - fds["first"]},
        "samples": [list(s) for s in series.samples],
    }


def goals_of(processes: Sequence[Mapping[str, Any]], stats: LoadStats) -> dict[str, Any]:
    """The soak's goals, from :func:`judge`'s rows and the load's counts. ``met`` needs both:

    * RSS growth below :data:`GOAL_GROWTH` for every process sampled; a process that exited before the
      end (``processes_gone``) or has too few samples after the warm-up to judge (``processes_unjudged``:
      one that died, or was restarted, early) fails it rather than dropping out of it;
    * every request sent answered 200 (``request_success``: ok over sent, goal 1.0): a request that got
      no answer, or a cut stream, is a failure, not "not measured".
    """
    judged = [p for p in processes if p["rss_kib"]["growth"] is not None]
    worst = max(judged, key=lambda p: p["rss_kib"]["growth"], default=None)
    gone = [str(p["name"]) for p in processes if p["gone_at_s"] is not None]
    unjudged = [str(p["name"]) for p in processes if p["rss_kib"]["growth"] is None]
    rss_met = (
        worst is not None
        and not gone
        and not unjudged
        and all(p["rss_kib"]["growth"] < GOAL_GROWTH for p in judged)
    )
    sent, ok = sum(stats.sent.values()), sum(stats.ok.values())
    success_met = sent > 0 and ok == sent
    return {
        "rss_growth_below": GOAL_GROWTH,
        "worst_rss_growth": None if worst is None else worst["rss_kib"]["growth"],
        "worst_process": None if worst is None else worst["name"],
        "processes_gone": gone,
        "processes_unjudged": unjudged,
        "rss_met": rss_met,
        "request_success": {
            "value": round(ok / sent, 4) if sent else None,
            "sent": sent,
            "ok": ok,
            "goal": 1.0,
            "met": success_met,
        },
        "met": rss_met and success_met,
    }


# --- the load ----------------------------------------------------------------------------------------------


_WORDS = ("cache", "route", "token", "engine", "prefix", "block", "stream", "fleet", "digest", "queue")


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def request_for(kind: str, seq: int, rng: random.Random, prefixes: Sequence[str]) -> tuple[str, bytes, bool]:
    """(path, body, streamed) of request ``seq`` of ``kind``; each has a unique part."""
    unique = f"request {seq}: {_text(rng, rng.randint(8, 64))}"
    max_tokens = rng.randint(4, 32)
    if kind == "completion":
        body: dict[str, Any] = {"model": DEFAULT_MODEL, "prompt": unique, "max_tokens": max_tokens}
        return "/v1/completions", orjson.dumps(body), False
    messages = [{"role": "user", "content": unique}]
    if kind == "shared_prefix":
        messages.insert(0, {"role": "system", "content": rng.choice(prefixes)})
    stream = kind == "chat_stream"
    body = {"model": DEFAULT_MODEL, "messages": messages, "max_tokens": max_tokens, "stream": stream}
    return "/v1/chat/completions", orjson.dumps(body), stream


@dataclass
class LoadStats:
    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    ok: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    failed: dict[str, int] = field(default_factory=dict)  # "kind status" -> count
    latency_ms: list[float] = field(default_factory=list)


async def _one(
    session: aiohttp.ClientSession, url: str, kind: str, req: tuple[str, bytes, bool], stats: LoadStats
) -> None:
    path, body, stream = req
    started = time.monotonic()
    status: int | str
    try:
        async with session.post(url + path, data=body, headers={"content-type": "application/json"}) as resp:
            status = resp.status
            data = await resp.read()
            if status == 200 and stream and b"data: [DONE]" not in data:
                status = "truncated"
    except (aiohttp.ClientError, TimeoutError) as exc:
        status = type(exc).__name__
    if status == 200:
        stats.ok[kind] += 1
        stats.latency_ms.append((time.monotonic() - started) * 1e3)
    else:
        key = f"{kind} {status}"
        stats.failed[key] = stats.failed.get(key, 0) + 1


async def run_load(url: str, duration_s: float, rate: float, concurrency: int, seed: int) -> LoadStats:
    """An open loop of seeded Poisson arrivals at ``rate``/s for ``duration_s`` (arrivals past
    ``concurrency`` in flight wait for a slot), the kinds drawn from :data:`MIX`."""
    rng = random.Random(seed)
    prefixes = [f"You are assistant {i}. " + _text(rng, 300) for i in range(4)]
    kinds, weights = list(MIX), list(MIX.values())
    stats = LoadStats()
    slots = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def bounded(kind: str, req: tuple[str, bytes, bool]) -> None:
            async with slots:
                await _one(session, url, kind, req, stats)

        deadline = time.monotonic() + duration_s
        seq = 0
        while time.monotonic() < deadline:
            await asyncio.sleep(rng.expovariate(rate))  # the arrival process, not a readiness wait
            kind = rng.choices(kinds, weights)[0]
            stats.sent[kind] += 1
            task = asyncio.create_task(bounded(kind, request_for(kind, seq, rng, prefixes)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            seq += 1
        if tasks:
            await asyncio.gather(*tasks)
    return stats


async def _ready(url: str, timeout_s: float) -> None:
    """Poll until a chat goes through the stack (every endpoint registered, routes in place)."""
    body = orjson.dumps(
        {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
    )
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while True:
            try:
                async with session.post(
                    url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
                ) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stack at {url} did not serve a chat within {timeout_s:.0f}s")
            await asyncio.sleep(0.5)  # polling interval


# --- main ------------------------------------------------------------------------------------------------


def roots_of(stack: Stack) -> dict[str, int]:
    """The processes the stack started, by service name (the local etcd too)."""
    roots = {service.name: service.pid for service in stack.children}
    if stack.etcd is not None:
        roots["etcd"] = stack.etcd.pid
    return roots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load.bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=None, help="seconds left out of growth (20%%)")
    parser.add_argument("--window", type=int, default=3, help="samples in the first and last medians")
    parser.add_argument("--rate", type=float, default=6.0, help="requests/s (Poisson arrivals)")
    parser.add_argument("--concurrency", type=int, default=32, help="most requests in flight")
    parser.add_argument("--agents", type=int, default=2, help="nodes: agent + simulated engine + kvcached")
    parser.add_argument("--time-scale", type=float, default=0.05, help="the simulators' --time-scale")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=KV_BLOCKS,
        help="each simulated engine's KV capacity in blocks (0: the simulator's default, 28,000)",
    )
    parser.add_argument(
        "--ext-caches",
        choices=("small", "default"),
        default="small",
        help="the ext_proc's cache bounds: small (full within the warm-up) or the gateway's defaults",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="seconds; the figures mean nothing")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.interval, args.window = 6.0, 1.0, 1
    warmup = args.duration * 0.2 if args.warmup is None else args.warmup

    workdir = Path(tempfile.mkdtemp(prefix="kvgate-soak-"))
    options = StackOptions(
        port=0,
        agents=args.agents,
        kvcached=True,
        agent_args=(
            "--time-scale",
            str(args.time_scale),
            *(("--kv-blocks", str(args.kv_blocks)) if args.kv_blocks else ()),
        ),
        workdir=workdir,
        index=dict(SMALL_EXT_CACHES["index"]) if args.ext_caches == "small" else {},
        overlay=({"tokenizer": dict(SMALL_EXT_CACHES["tokenizer"])} if args.ext_caches == "small" else {}),
    )
    started, measured_revision = time.time(), revision()  # the tree measured, before anything changes it
    with Stack(options) as stack:
        asyncio.run(_ready(stack.url, 120.0))
        sampler = Sampler(roots_of(stack), args.interval)
        sampler.start()
        try:
            stats = asyncio.run(run_load(stack.url, args.duration, args.rate, args.concurrency, args.seed))
        finally:
            sampler.stop()
    shutil.rmtree(workdir, ignore_errors=True)  # kept (logs, etcd, kvcached's SSD tier) only on failure
    processes = [judge(s, warmup, args.window) for s in sampler.series.values()]
    total_series: dict[float, list[int]] = {}
    for s in sampler.series.values():
        for t, rss, _ in s.samples:
            total_series.setdefault(t, []).append(rss)
    total = growth([(t, sum(v)) for t, v in sorted(total_series.items())], warmup, args.window)
    goals = goals_of(processes, stats)
    result = {
        "benchmark": "soak",
        "command": " ".join(["python -m load.bench.soak", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(),
        "revision": measured_revision,
        "started_unix": round(started),
        "parameters": {
            "duration_s": args.duration,
            "interval_s": args.interval,
            "warmup_s": warmup,
            "window": args.window,
            "rate": args.rate,
            "concurrency": args.concurrency,
            "agents": args.agents,
            "time_scale": args.time_scale,
            "kv_blocks": args.kv_blocks,
            "ext_caches": SMALL_EXT_CACHES if args.ext_caches == "small" else "default",
            "mix": MIX,
            "seed": args.seed,
        },
        "load": {
            "sent": stats.sent,
            "ok": stats.ok,
            "failed": stats.failed,
            "latency_ms": summary(stats.latency_ms),
        },
        "processes": processes,
        "total_rss_kib": total,
        "goals": goals,
    }
    write_json(args.out, result)
    print(
        f"soak: {sum(stats.sent.values())} sent, {sum(stats.ok.values())} ok,"
        f" {stats.failed or 'no failures'}; worst RSS growth {goals['worst_rss_growth']}"
        f" ({goals['worst_process']});"
        f" total RSS growth {total['growth']}; goals {'met' if goals['met'] else 'NOT met'}; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
