"""What the migration proxy costs: the same streamed chats through Envoy straight to the engines, and
through Envoy and the migration proxy (a model with ``migration = true``), with no failure.

Two stacks run side by side (:class:`kvgate.dev.up.Stack`, the same simulated replicas' settings, one
ext_proc each); rounds alternate between them. Each round sends ``--requests`` streamed chats
(``max_tokens`` ``--tokens``, ``include_usage``) in a closed loop at ``--concurrency`` from this process
(aiohttp, keep-alive). Per target: time to the first content chunk and the gaps between content chunks
(client side, ms, p50/p90), and the CPU time (utime + stime from ``/proc/PID/stat``) of Envoy and of the
proxy per request and per token.

    python -m load.bench.migration --out results/migration.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from kvgate.dev.up import DEFAULT_MODEL, Stack, StackOptions
from load.bench import cpu_seconds, machine, percentile, revision

TARGETS = ("envoy", "envoy+migration")


def _stack(workdir: Path, migration: bool, replicas: int, time_scale: float) -> Stack:
    return Stack(
        StackOptions(
            replicas=replicas,
            port=0,
            sim_args=("--time-scale", str(time_scale)),
            workdir=workdir,
            overlay={"models": [{"name": DEFAULT_MODEL, "gguf": "smollm2", "migration": migration}]},
        )
    )


async def _one(http: aiohttp.ClientSession, url: str, tokens: int) -> tuple[float, list[float], int]:
    """One streamed chat: seconds to the first content chunk, the gaps between content chunks, and the
    completion tokens the usage reported."""
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "Write about gateways and caches."}],
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first, last, gaps, used = 0.0, 0.0, [], 0
    async with http.post(f"{url}/v1/chat/completions", data=orjson.dumps(body)) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                used = int(chunk["usage"]["completion_tokens"])
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                now = time.perf_counter()
                if first == 0.0:
                    first = now - started
                else:
                    gaps.append(now - last)
                last = now
    return first, gaps, used


async def _round(url: str, requests: int, concurrency: int, tokens: int) -> dict[str, Any]:
    ttfts: list[float] = []
    gaps: list[float] = []
    produced = 0
    left = requests

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal left, produced
        while left > 0:
            left -= 1
            first, g, used = await _one(http, url, tokens)
            ttfts.append(first)
            gaps.extend(g)
            produced += used

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return {"ttft": ttfts, "gaps": gaps, "tokens": produced, "requests": requests}


def _pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, interpolated as every other benchmark's; NaN without any."""
    return percentile(sorted(values), q * 100)


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        t: {"ttft": [], "gaps": [], "tokens": 0, "requests": 0, "cpu": {}} for t in TARGETS
    }
    with tempfile.TemporaryDirectory(prefix="kvgate-migration-bench-") as tmp:
        stacks = {
            "envoy": _stack(Path(tmp) / "envoy", False, args.replicas, args.time_scale),
            "envoy+migration": _stack(Path(tmp) / "migration", True, args.replicas, args.time_scale),
        }
        started: list[Stack] = []
        try:
            for stack in stacks.values():
                started.append(stack.start())
            for stack in stacks.values():  # warm-up: connections, tokenizer caches
                asyncio.run(_round(stack.url, args.concurrency, args.concurrency, 4))
            for r in range(args.rounds):
                order = TARGETS if r % 2 == 0 else TARGETS[::-1]
                for name in order:
                    stack = stacks[name]
                    assert stack.envoy is not None
                    pids = {"envoy": stack.envoy.pid}
                    if stack.migration is not None:
                        pids["proxy"] = stack.migration.pid
                    before = {k: cpu_seconds(p) for k, p in pids.items()}
                    got = asyncio.run(_round(stack.url, args.requests, args.concurrency, args.tokens))
                    acc = results[name]
                    for k, p in pids.items():
                        acc["cpu"][k] = acc["cpu"].get(k, 0.0) + cpu_seconds(p) - before[k]
                    acc["ttft"] += got["ttft"]
                    acc["gaps"] += got["gaps"]
                    acc["tokens"] += got["tokens"]
                    acc["requests"] += got["requests"]
        finally:
            for stack in started:
                stack.stop()
    out: dict[str, Any] = {}
    for name, acc in results.items():
        n, tokens = acc["requests"], max(1, acc["tokens"])
        out[name] = {
            "requests": n,
            "tokens": acc["tokens"],
            "ttft_ms": {"p50": 1e3 * _pct(acc["ttft"], 0.5), "p90": 1e3 * _pct(acc["ttft"], 0.9)},
            "itl_ms": {
                "mean": 1e3 * statistics.fmean(acc["gaps"]) if acc["gaps"] else float("nan"),
                "p50": 1e3 * _pct(acc["gaps"], 0.5),
                "p90": 1e3 * _pct(acc["gaps"], 0.9),
            },
            "cpu_us_per_request": {k: 1e6 * v / max(1, n) for k, v in acc["cpu"].items()},
            "cpu_us_per_token": {k: 1e6 * v / tokens for k, v in acc["cpu"].items()},
        }
    a, b = out["envoy"], out["envoy+migration"]
    out["added"] = {
        "ttft_ms_p50": b["ttft_ms"]["p50"] - a["ttft_ms"]["p50"],
        "itl_ms_mean": b["itl_ms"]["mean"] - a["itl_ms"]["mean"],
        "itl_ms_p50": b["itl_ms"]["p50"] - a["itl_ms"]["p50"],
        "proxy_cpu_us_per_request": b["cpu_us_per_request"].get("proxy", 0.0),
        "proxy_cpu_us_per_token": b["cpu_us_per_token"].get("proxy", 0.0),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m load.bench.migration", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    p.add_argument("--quick", action="store_true", help="a smoke run (seconds; figures meaningless)")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds per target")
    p.add_argument("--requests", type=int, default=100, help="streamed chats per round")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64, help="max_tokens of each chat")
    p.add_argument("--replicas", type=int, default=2, help="simulated replicas per stack")
    p.add_argument("--time-scale", type=float, default=1.0, help="the simulators' --time-scale")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.concurrency, args.tokens = 1, 4, 2, 8
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings["out"] = str(args.out)
    results = {"settings": settings, "machine": machine(), "revision": revision(), "results": run(args)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["results"]["added"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
