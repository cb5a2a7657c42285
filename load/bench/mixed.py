"""Mixed long/short: short-request latency through the gateway, alone and beside long first turns.

One run starts the stack users get (:class:`kvgate.dev.up.Stack`: simulated replicas, the ext_proc, Envoy)
with the simulator's step time scaled to 0, so engines answer at once and what is left is the gateway's
own time. Rounds alternate two conditions (their order rotated each round):

* ``alone``: short chats (:func:`load.bench.overhead.request_body`, ``max_tokens: 1``) in a closed loop at
  ``--short-concurrency`` from overhead's load client, in its own process;
* ``with_long``: the same short load while a second client process sends long first turns in a closed loop
  at ``--long-concurrency``: each a conversation never seen before (every message unique text, from
  :class:`load.bench.decision.ChatFactory`) of about ``--long-tokens`` prompt tokens once rendered with the
  served model's chat template (SmolLM2's), ``max_tokens: 1``. The long client first sends until one long
  request has completed, then the short client runs; when it is done the long client is told to stop.

The model's context (gateway and replicas) is raised to :data:`LONG_CONTEXT` tokens so that long prompts
are routed (tokenized, matched, proxied) rather than refused for length. Around each round the CPU time
of the ext_proc, Envoy and the replicas is read (``/proc/PID/stat``). Both clients are bounded in
requests and time and send to 127.0.0.1 only.

Results: per round and per condition (``aggregate``: the median over rounds of each percentile) the short
requests' p50/p90/p99 and count, the long requests' p50 and count, the ext_proc's CPU per request (and,
estimated, per long request: ``long_extproc_cpu_ms_est``), and the with_long / alone ratios of the short
p50 and p99. A with_long round whose long client ran out of requests before the short client was done is
not ``long_covered`` (counted in ``long_uncovered_rounds``, flagged on stderr): part of it ran without long
requests, so raise ``--long-requests`` (here a ~4k-token long request completes in ~20 ms, a ~16k one in
~150 ms: at 4k, 400 do not cover a round, 1,200 do). The replicas tokenize the long prompts too (their
CPU is under ``cpu_s.sim``): on a machine with few cores that competes with the gateway for CPU, apart
from any stall of the ext_proc's event loop.

    python -m load.bench.mixed --out results/mixed.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import resource
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from tokenizers import Tokenizer

from engines.gguf import ensure_model_dir, smollm2_gguf_path
from extproc.models.template import ChatTemplate
from kvgate.dev.up import DEFAULT_MODEL, Stack, StackOptions
from load.bench import (
    CpuSample,
    add_quiet_arguments,
    cpu_seconds,
    machine,
    quietest,
    ratio,
    revision,
    summary,
    write_json,
)
from load.bench.decision import ChatFactory
from load.bench.overhead import CLIENT_TIMEOUT_S, PATH, request_body, run_client

LONG_CONTEXT = 32768
"""Context length (tokens) given to the gateway's model and to the replicas: room for the long prompts."""
SIM_ARGS = ("--time-scale", "0", "--max-model-len", str(LONG_CONTEXT))
CONDITIONS = ("alone", "with_long")
READY_TIMEOUT_S = 120.0
"""Longest wait for the long client to build its requests and complete its first one."""


# --- the long-request client (its own process) -------------------------------------------------------


def long_bodies(count: int, words: int, seed: int) -> list[bytes]:
    """``count`` first-turn chat requests of about ``words`` words each, every message unique text."""
    factory = ChatFactory(seed)
    return [
        orjson.dumps(
            {
                "model": DEFAULT_MODEL,
                "messages": factory.conversation(words),
                "max_tokens": 1,
                "stream": False,
            }
        )
        for _ in range(count)
    ]


async def _send_long(
    url: str, bodies: Sequence[bytes], concurrency: int, max_s: float, out: IO[str]
) -> dict[str, Any]:
    """Closed loop over ``bodies`` (each sent once) until told to stop on stdin, out of bodies, or
    ``max_s`` seconds; writes ``ready`` to ``out`` once the first request has completed."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def watch_stdin() -> None:  # any line, or EOF (the parent gone), stops the client
        sys.stdin.readline()
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=watch_stdin, daemon=True).start()
    deadline = time.monotonic() + max_s
    pending = iter(bodies)
    latencies: list[float] = []
    prompt_tokens: list[float] = []
    statuses: dict[str, int] = {}
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    headers = {"content-type": "application/json"}
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:

        async def one(body: bytes) -> None:
            started = time.perf_counter_ns()
            try:
                async with session.post(url, data=body) as resp:
                    raw = await resp.read()
                    status = str(resp.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                status, raw = type(exc).__name__, b""
            latencies.append((time.perf_counter_ns() - started) / 1e3)
            statuses[status] = statuses.get(status, 0) + 1
            if status == "200":
                prompt_tokens.append(orjson.loads(raw)["usage"]["prompt_tokens"])
            if len(latencies) == 1:
                out.write("ready\n")
                out.flush()

        async def worker() -> None:
            for body in pending:
                if stop.is_set() or time.monotonic() > deadline:
                    return
                await one(body)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    if not latencies:  # nothing sent: the parent still waits for a ready line
        out.write("ready\n")
    return {
        "latencies_us": [round(x, 1) for x in latencies],
        "prompt_tokens": prompt_tokens,
        "statuses": statuses,
        "exhausted": len(latencies) == len(bodies),
        "stopped": stop.is_set(),
        "client_cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
    }


def long_client_main(argv: Sequence[str]) -> int:
    """``python -m load.bench.mixed long-client --url URL ...``: ``ready`` on stdout once under way, then
    (after a line on stdin, EOF, the bodies spent or ``--max-s``) one JSON line of results."""
    p = argparse.ArgumentParser(prog="python -m load.bench.mixed long-client")
    p.add_argument("--url", required=True)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, required=True, help="most requests sent (all built upfront)")
    p.add_argument("--words", type=int, required=True, help="words per conversation")
    p.add_argument("--seed", type=int, required=True, help="distinct per run: conversations never repeat")
    p.add_argument("--max-s", type=float, default=60.0, help="stop sending after this many seconds")
    args = p.parse_args(argv)
    if urlsplit(args.url).hostname != "127.0.0.1":
        p.error("the load client only targets 127.0.0.1")
    bodies = long_bodies(args.requests, args.words, args.seed)
    result = asyncio.run(_send_long(args.url, bodies, args.concurrency, args.max_s, sys.stdout))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0


class LongLoad:
    """The long client as a child process: started and awaited until its first request completed
    (:meth:`start`), then stopped and its results read (:meth:`stop`)."""

    def __init__(self, argv: list[str]) -> None:
        self._argv = argv
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the client; return once it wrote ``ready``. Raises RuntimeError if it did not in time."""
        # Unbuffered: reading the ready line must not take the results line into a buffer that
        # communicate() does not see.
        proc = subprocess.Popen(
            self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0
        )
        self._proc = proc
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
        line = proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            proc.kill()  # our own child, by its handle
            _, err = proc.communicate()
            raise RuntimeError(f"long client not ready ({proc.returncode}): {err[-2000:]!r}")

    def stop(self) -> dict[str, Any]:
        """Tell the client to stop, wait for it, return its results."""
        proc = self._proc
        if proc is None:
            raise RuntimeError("the long client was not started")
        out, err = proc.communicate(b"stop\n", timeout=CLIENT_TIMEOUT_S + 30)
        if proc.returncode != 0:
            raise RuntimeError(f"long client failed ({proc.returncode}): {err[-2000:]!r}")
        result: dict[str, Any] = orjson.loads(out)
        return result


# --- the benchmark ------------------------------------------------------------------------------------


def words_per_token(model_dir: Path, seed: int) -> float:
    """Words of :class:`ChatFactory` text per prompt token, the chat rendered with the model's template
    and tokenized with its tokenizer (as the gateway and the engine do)."""
    template = ChatTemplate.from_model_dir(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    sample = ChatFactory(seed).conversation(4000)
    text = template.render(sample, add_generation_prompt=True)
    n_words = sum(m["content"].count(" ") + 1 for m in sample)
    return n_words / len(tokenizer.encode(text, add_special_tokens=False).ids)


@dataclass(frozen=True, slots=True)
class ShortLoad:
    """One round's short requests: ``warmup`` untimed then ``requests`` timed, from ``concurrency``
    closed-loop workers, the client stopping after ``max_s`` seconds."""

    concurrency: int
    requests: int
    warmup: int
    max_s: float


def measure_round(
    url: str,
    pids: Mapping[str, int | Sequence[int]],
    condition: str,
    short: ShortLoad,
    long_argv: Callable[[], list[str]] | None,
) -> dict[str, Any]:
    """One round of ``condition``: the short client, beside the long client (argv from ``long_argv``,
    new conversations each call) for ``with_long``; the CPU of each process in ``pids`` from the first
    client's start to the last one's end. ``extproc_cpu_ms_per_req``: the ext_proc's CPU over that window
    (idle work such as metric scrapes included) per request sent, short and long together."""
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    machine0 = CpuSample.take()
    started = time.monotonic()
    load = LongLoad(long_argv()) if long_argv is not None else None
    long_got = None
    if load is not None:
        load.start()
    try:
        got = run_client(url, short.concurrency, short.requests, short.warmup, False, short.max_s)
    finally:
        if load is not None:  # also when the short client failed: the long one is not left running
            long_got = load.stop()
    span = time.monotonic() - started
    delta = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
    other = machine0.other_cores(CpuSample.take(), sum(delta.values()))
    n = len(got["latencies_us"])
    sent = n + sum(got["warmup_statuses"].values())
    out: dict[str, Any] = {
        "condition": condition,
        "short_latencies_us": got["latencies_us"],
        "short_us": summary(got["latencies_us"]),
        "short_rps": round(n / got["wall_s"], 1) if got["wall_s"] > 0 else 0.0,
        "short_errors": n - got["statuses"].get("200", 0),
        "short_truncated": got["truncated"],
        "span_s": round(span, 3),
        "cpu_s": {name: round(v, 3) for name, v in delta.items()},
        "other_cpu_cores": other,
    }
    if long_got is not None:
        long_n = len(long_got["latencies_us"])
        sent += long_n
        out["long_us"] = summary(long_got["latencies_us"])
        out["long_errors"] = long_n - long_got["statuses"].get("200", 0)
        out["long_statuses"] = long_got["statuses"]
        out["long_exhausted"] = long_got["exhausted"]
        # False: the long client ran out of requests or time before the short client was done.
        out["long_covered"] = long_got["stopped"]
        out["long_prompt_tokens"] = summary(long_got["prompt_tokens"], 0)
    out["requests_sent"] = sent
    out["extproc_cpu_ms_per_req"] = round(delta["extproc"] / sent * 1e3, 3) if sent else float("nan")
    return out


def _median(values: Sequence[float]) -> float:
    return round(statistics.median(values), 1) if values else float("nan")


def _long_cpu_ms(with_long: Mapping[str, Any], rounds: Sequence[Mapping[str, Any]]) -> float | None:
    """The ext_proc's CPU per long request of a with_long round, estimated: its ext_proc CPU less its
    short requests' at the same round's ``alone`` CPU per request, over its long requests (``None``:
    no alone round or no long request). It takes in whatever CPU contention adds to the short requests."""
    n_long = with_long["long_us"]["n"]
    alone = [r for r in rounds if r["round"] == with_long["round"] and r["condition"] == "alone"]
    if not n_long or not alone or not alone[0]["requests_sent"]:
        return None
    per_short = alone[0]["cpu_s"]["extproc"] / alone[0]["requests_sent"]
    shorts = with_long["requests_sent"] - n_long
    return float((with_long["cpu_s"]["extproc"] - per_short * shorts) / n_long * 1e3)


def aggregate(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per condition the median over rounds of each short-request percentile (and the long requests'
    p50), the counts summed; then the with_long / alone ratios of those medians' p50 and p99, and of the
    p99 round by round (``p99_rounds``)."""
    out: dict[str, Any] = {}
    for condition in CONDITIONS:
        mine = [r for r in rounds if r["condition"] == condition]
        if not mine:
            continue
        cell: dict[str, Any] = {
            "short_us": {p: _median([r["short_us"][p] for r in mine]) for p in ("p50", "p90", "p99")},
            "short_count": sum(r["short_us"]["n"] for r in mine),
            "short_errors": sum(r["short_errors"] for r in mine),
            "short_rps": _median([r["short_rps"] for r in mine]),
            "extproc_cpu_ms_per_req": round(statistics.median(r["extproc_cpu_ms_per_req"] for r in mine), 3),
            "short_pooled_us": summary([x for r in mine for x in r["short_latencies_us"]]),
        }
        if condition == "with_long":
            cell["long_p50_us"] = _median([r["long_us"]["p50"] for r in mine if r["long_us"]["n"]])
            estimates = [e for r in mine if (e := _long_cpu_ms(r, rounds)) is not None]
            cell["long_extproc_cpu_ms_est"] = round(statistics.median(estimates), 2) if estimates else None
            cell["long_count"] = sum(r["long_us"]["n"] for r in mine)
            cell["long_errors"] = sum(r["long_errors"] for r in mine)
            cell["long_uncovered_rounds"] = sum(not r["long_covered"] for r in mine)
            cell["long_prompt_tokens_p50"] = _median(
                [r["long_prompt_tokens"]["p50"] for r in mine if r["long_prompt_tokens"]["n"]]
            )
        out[condition] = cell
    if len(out) == len(CONDITIONS):
        a, b = out["alone"]["short_us"], out["with_long"]["short_us"]
        ratios: dict[str, Any] = {p: ratio(b[p], a[p]) for p in ("p50", "p99")}
        by_round = {(r["round"], r["condition"]): r["short_us"]["p99"] for r in rounds}
        ratios["p99_rounds"] = [
            ratio(by_round[(i, "with_long")], by_round[(i, "alone")])
            for i in sorted({r["round"] for r in rounds})
            if (i, "alone") in by_round and (i, "with_long") in by_round
        ]
        out["ratio_with_long_over_alone"] = ratios
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["long-client"]:
        return long_client_main(argv[1:])
    doc = (__doc__ or "").split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m load.bench.mixed", description=doc)
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (seconds, figures meaningless)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each condition, interleaved")
    p.add_argument("--short-concurrency", type=int, default=4, help="short requests' closed-loop workers")
    p.add_argument("--short-requests", type=int, default=2000, help="timed short requests per round")
    p.add_argument("--short-warmup", type=int, default=50, help="untimed short requests before each round")
    p.add_argument("--long-concurrency", type=int, default=1, help="long requests' closed-loop workers")
    p.add_argument("--long-tokens", type=int, default=16384, help="prompt tokens of a long request, about")
    p.add_argument(
        "--long-requests", type=int, default=400, help="long requests built per round (the most sent)"
    )
    p.add_argument("--replicas", type=int, default=4, help="simulated replicas")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-round-s", type=float, default=60.0, help="a round's clients stop after this")
    add_quiet_arguments(p, "round")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.short_requests, args.short_warmup = 1, 100, 5
        args.long_tokens, args.long_requests, args.replicas = 4096, 100, 2
        args.max_round_s, args.max_attempts, args.quiet_wait_s = 10.0, 1, 0.0
    info, measured = machine(), revision()  # the tree the stack starts from, before it may change
    started = time.monotonic()
    model_dir = ensure_model_dir(smollm2_gguf_path())
    long_words = max(10, round(args.long_tokens * words_per_token(model_dir, args.seed)))
    short = ShortLoad(args.short_concurrency, args.short_requests, args.short_warmup, args.max_round_s)
    overlay = {
        "models": [{"name": DEFAULT_MODEL, "model_dir": str(model_dir), "max_model_len": LONG_CONTEXT}]
    }
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        options = StackOptions(
            replicas=args.replicas, port=0, sim_args=SIM_ARGS, workdir=Path(tmp), overlay=overlay
        )
        stack = Stack(options)
        try:
            stack.start()
            if stack.extproc is None or stack.envoy is None:
                raise RuntimeError("the stack has no ext_proc or no Envoy")
            url = stack.url + PATH
            pids: dict[str, int | Sequence[int]] = {
                "extproc": stack.extproc.pid,
                "envoy": stack.envoy.pid,
                "sim": [s.pid for s in stack.sims],
            }

            seeds: Iterator[int] = itertools.count(args.seed * 1_000_003)

            def long_argv() -> list[str]:
                """The long client, with a seed never used before in this run (a repeated round too)."""
                return [
                    sys.executable,
                    "-m",
                    "load.bench.mixed",
                    "long-client",
                    f"--url={url}",
                    f"--concurrency={args.long_concurrency}",
                    f"--requests={args.long_requests}",
                    f"--words={long_words}",
                    f"--seed={next(seeds)}",
                    f"--max-s={args.max_round_s + CLIENT_TIMEOUT_S}",
                ]

            def unreaped() -> float:
                return sum(cpu_seconds(pid) for pid in pids.values())

            for r in range(args.rounds):
                for condition in CONDITIONS[r % 2 :] + CONDITIONS[: r % 2]:
                    longs = long_argv if condition == "with_long" else None
                    best = quietest(
                        partial(measure_round, url, pids, condition, short, longs),
                        args.quiet_threshold,
                        args.max_attempts,
                        args.quiet_wait_s,
                        unreaped,
                    )
                    rounds.append({"round": r, **best})
                    lat = best["short_us"]
                    extra = f" long p50 {best['long_us']['p50']:>9.1f} us" if "long_us" in best else ""
                    if "long_covered" in best and not best["long_covered"]:
                        extra += " UNCOVERED (the long client ran out first: raise --long-requests)"
                    print(
                        f"r{r} {condition:<9} short p50 {lat['p50']:>8.1f} p99 {lat['p99']:>8.1f} us "
                        f"errors {best['short_errors']}{extra} "
                        f"(other tenants {best['other_cpu_cores']:.2f} cores)",
                        file=sys.stderr,
                    )
        finally:
            stack.stop()
    result = {
        "benchmark": "mixed",
        "command": " ".join(["python -m load.bench.mixed", *argv]),
        "machine": info,
        "revision": measured,
        "parameters": {
            "quick": args.quick,
            "rounds": args.rounds,
            "short_concurrency": args.short_concurrency,
            "short_requests": args.short_requests,
            "short_warmup": args.short_warmup,
            "short_request": orjson.loads(request_body(False)),
            "long_concurrency": args.long_concurrency,
            "long_tokens": args.long_tokens,
            "long_words": long_words,
            "long_requests_built": args.long_requests,
            "replicas": args.replicas,
            "sim_args": list(SIM_ARGS),
            "max_model_len": LONG_CONTEXT,
            "client": "aiohttp, keep-alive, closed loop, one process per client",
            "quiet_threshold_cores": args.quiet_threshold,
            "max_attempts": args.max_attempts,
        },
        "unit": "microseconds",
        "aggregate": aggregate(rounds),
        "other_cpu_cores_rounds": summary([r["other_cpu_cores"] for r in rounds], 3),
        "rounds": [{k: v for k, v in r.items() if k != "short_latencies_us"} for r in rounds],
        "wall_s": round(time.monotonic() - started, 1),
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
