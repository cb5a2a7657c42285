"""Prefix index micro-benchmark: the precise (event-fed) index, with the approximate one as the baseline.

For each fleet size (8 and 64 endpoints) a fill of ``--blocks`` (block, endpoint) pairs is generated:
chains of 32-256 random 16-byte digests (prompts of 512-4,096 tokens in 16-token blocks), 80 % held by one
endpoint and 20 % (shared prefixes) by 2-4. Measured, each figure the median over ``--repeats``:

* ``ingest``: the fill as ``Stored`` events of 16-64 digests (gpu tier), 16 events per
  :meth:`PreciseIndex.apply` call (one agent batch), into an empty index: block events (digests) per second
  and events per second, over the whole fill (dict growth included). ``ingest_confirming``: the same when
  every block was first recorded speculatively (each ``Stored`` confirms); only ``apply`` is timed.
* ``removed``: then ``Removed`` events of the same sizes, in another order, until the index is empty.
* ``match``: at the full fill, 256-digest chains: ``full`` (held whole by 2 endpoints), ``partial`` (4
  endpoints hold 150/128/64/32 leading blocks; the first also holds blocks after its hole at 150), ``miss``
  (a chain never stored). Per call p50/p99 in µs over ``--match-calls`` calls, rounds interleaved, median
  of the rounds' percentiles. The same for :class:`HybridIndex` (every endpoint precise) and for
  :class:`ApproximateIndex` filled with the same holdings by ``record`` (its partial holders stop at the
  same counts, without the blocks after the hole).
* ``record``: one 256-digest :meth:`record` (the router's commit): a chain never seen, and a chain the
  endpoint already holds (a follow-up turn).
* ``clear``: :meth:`PreciseIndex.clear_endpoint` (a ``Cleared`` event: it scans every digest) and
  :meth:`ApproximateIndex.drop_endpoint` at the full fill, ms.
* ``memory``: built in a child process, from digests created inside the window, so the digest objects the
  index keeps are counted; bytes per (block, endpoint) pair and per distinct digest, by ``tracemalloc``
  (bytes Python asked for) and by RSS growth (``/proc/self/statm``: what the OS gave, allocator overhead
  included), for both indexes.

    python -m load.bench.index --out results/index.json [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from statistics import median
from typing import Any

from contracts.digest import Digest
from contracts.events import EndpointId, IndexEvent, Removed, Stored
from extproc.index.approximate import ApproximateIndex
from extproc.index.hybrid import HybridIndex
from extproc.index.precise import PreciseIndex
from load.bench import CpuSample, machine, percentile, quietest, revision, write_json

FLEETS = (8, 64)
BLOCKS = 1_000_000
CHAIN_BLOCKS = (32, 256)
SHARED_FRACTION = 0.2
EVENT_DIGESTS = (16, 64)
BATCH_EVENTS = 16
QUERY_BLOCKS = 256
PARTIAL_LEADS = (150, 128, 64, 32)
GOAL_MATCH_US = 50.0
GOAL_EVENTS_PER_S = 1_000_000.0
GOAL_BYTES_PER_PAIR = 150.0

Holding = tuple[int, list[Digest]]
"""(endpoint number, chain of digests it holds)."""


def name(endpoint: int) -> EndpointId:
    return EndpointId(f"e{endpoint}")


def fill(rng: random.Random, n_pairs: int, n_endpoints: int) -> list[Holding]:
    """Random holdings totalling at least ``n_pairs`` (block, endpoint) pairs, in random order."""
    out: list[Holding] = []
    pairs = 0
    while pairs < n_pairs:
        chain = [Digest(rng.randbytes(16)) for _ in range(rng.randint(*CHAIN_BLOCKS))]
        if rng.random() < SHARED_FRACTION and n_endpoints > 1:
            holders = rng.sample(range(n_endpoints), rng.randint(2, min(4, n_endpoints)))
        else:
            holders = [rng.randrange(n_endpoints)]
        for endpoint in holders:
            out.append((endpoint, chain))
            pairs += len(chain)
    rng.shuffle(out)
    return out


def queries(
    rng: random.Random, n_endpoints: int
) -> tuple[dict[str, list[Digest]], list[Holding], list[Holding]]:
    """The three query chains, the holdings that make them full, partial and missed, and the tail the
    first partial holder keeps after its hole (for the precise index only: the approximate one cannot
    hold a tail without its head)."""
    chains = {
        case: [Digest(rng.randbytes(16)) for _ in range(QUERY_BLOCKS)] for case in ("full", "partial", "miss")
    }
    held: list[Holding] = [(0, chains["full"]), (1 % n_endpoints, chains["full"])]
    for i, lead in enumerate(PARTIAL_LEADS):
        held.append(((2 + i) % n_endpoints, chains["partial"][:lead]))
    tail = [(2 % n_endpoints, chains["partial"][PARTIAL_LEADS[0] + 1 :])]
    return chains, held, tail


Change = Stored | Removed


def events(holdings: Sequence[Holding], rng: random.Random, kind: type[Change]) -> list[Change]:
    """The holdings as events of 16-64 digests each."""
    out: list[Change] = []
    for endpoint, chain in holdings:
        start = 0
        while start < len(chain):
            end = min(len(chain), start + rng.randint(*EVENT_DIGESTS))
            out.append(kind(name(endpoint), list(chain[start:end])))
            start = end
    return out


def batches(items: Sequence[Change]) -> list[Sequence[Change]]:
    return [items[i : i + BATCH_EVENTS] for i in range(0, len(items), BATCH_EVENTS)]


def _timed_apply(index: PreciseIndex, groups: Sequence[Sequence[IndexEvent]]) -> float:
    """Seconds spent in ``apply`` over all ``groups``."""
    gc.collect()
    spent = 0
    for group in groups:
        started = time.perf_counter_ns()
        index.apply(group, 0.0)
        spent += time.perf_counter_ns() - started
    return spent / 1e9


def run_ingest(holdings: Sequence[Holding], repeats: int, seed: int) -> dict[str, Any]:
    """Ingest, ingest confirming speculative entries, and removal rates (median of ``repeats``)."""
    rng = random.Random(seed)
    stored = batches(events(holdings, rng, Stored))
    removed = events(holdings, rng, Removed)
    rng.shuffle(removed)
    removed_groups = batches(removed)
    n_digests = sum(len(e.digests) for g in stored for e in g)
    n_events = sum(len(g) for g in stored)
    n_removed = sum(len(e.digests) for e in removed)
    rates: dict[str, list[float]] = {"ingest": [], "ingest_confirming": [], "removed": []}
    for _ in range(repeats):
        index = PreciseIndex()
        rates["ingest"].append(_timed_apply(index, stored))
        rates["removed"].append(_timed_apply(index, removed_groups))
        assert len(index) == 0, "every stored block was removed"
        index = PreciseIndex()
        for endpoint, chain in holdings:
            index.record(name(endpoint), chain, 0.0)
        rates["ingest_confirming"].append(_timed_apply(index, stored))
        del index
    out: dict[str, Any] = {}
    for key, seconds in rates.items():
        digests = n_removed if key == "removed" else n_digests
        out[key] = {
            "block_events_per_s": round(digests / median(seconds)),
            "events_per_s": round((len(removed) if key == "removed" else n_events) / median(seconds)),
            "seconds": [round(s, 3) for s in seconds],
        }
    out["digests"], out["events"] = n_digests, n_events
    return out


def _match_rounds(
    indexes: dict[str, Callable[[Sequence[Digest], float], dict[EndpointId, int]]],
    chains: dict[str, list[Digest]],
    calls: int,
    rounds: int,
) -> dict[str, Any]:
    """p50/p99 µs per (index, case): per round ``calls`` calls, rounds interleaved, median of rounds."""
    per: dict[tuple[str, str], list[tuple[float, float]]] = {}
    expected: dict[str, dict[str, int]] = {}
    for _ in range(rounds):
        for label, match in indexes.items():
            for case, chain in chains.items():
                samples = []
                for _ in range(calls):
                    started = time.perf_counter_ns()
                    result = match(chain, 0.0)
                    samples.append((time.perf_counter_ns() - started) / 1e3)
                expected.setdefault(f"{label}/{case}", {str(k): v for k, v in sorted(result.items())})
                samples.sort()
                per.setdefault((label, case), []).append((percentile(samples, 50), percentile(samples, 99)))
    out: dict[str, Any] = {}
    for (label, case), figures in per.items():
        out.setdefault(label, {})[case] = {
            "p50": round(median(f[0] for f in figures), 1),
            "p99": round(median(f[1] for f in figures), 1),
            "result": expected[f"{label}/{case}"],
        }
    return out


def _record_us(
    index: PreciseIndex | ApproximateIndex, chains: Sequence[list[Digest]], holder: EndpointId
) -> float:
    samples = []
    for chain in chains:
        started = time.perf_counter_ns()
        index.record(holder, chain, 1.0)
        samples.append((time.perf_counter_ns() - started) / 1e3)
    return round(median(samples), 1)


def run_lookups(holdings: Sequence[Holding], n_endpoints: int, args: argparse.Namespace) -> dict[str, Any]:
    """Match, record and clear figures at the full fill, precise and approximate side by side."""
    rng = random.Random(args.seed + 1)
    chains, query_holdings, tail = queries(rng, n_endpoints)
    everything = [*holdings, *query_holdings]
    precise = PreciseIndex()
    for group in batches(events([*everything, *tail], rng, Stored)):
        precise.apply(group, 0.0)
    pairs = sum(len(c) for _, c in everything)
    approximate = ApproximateIndex(capacity_blocks_per_endpoint=2 * pairs // n_endpoints + QUERY_BLOCKS)
    for endpoint, chain in everything:
        approximate.record(name(endpoint), chain, 0.0)
    hybrid = HybridIndex(precise, ApproximateIndex())
    for endpoint in range(n_endpoints):
        hybrid.set_precise(name(endpoint), True)
    distinct = len(precise)
    # The router's digests are other objects than the index's keys (decoded from events): no identity hit.
    copies = {case: [Digest(bytes(bytearray(d))) for d in chain] for case, chain in chains.items()}
    gc.collect()
    match = _match_rounds(
        {"precise": precise.match, "hybrid": hybrid.match, "approximate": approximate.match},
        copies,
        args.match_calls,
        args.repeats,
    )
    fresh = [[Digest(rng.randbytes(16)) for _ in range(QUERY_BLOCKS)] for _ in range(args.record_calls)]
    held = [chains["full"]] * args.record_calls
    record = {
        "precise": {"new": _record_us(precise, fresh, name(0)), "held": _record_us(precise, held, name(0))},
        "approximate": {
            "new": _record_us(approximate, fresh, name(1 % n_endpoints)),
            "held": _record_us(approximate, held, name(1 % n_endpoints)),
        },
    }
    clear: dict[str, list[float]] = {"precise_clear_endpoint": [], "approximate_drop_endpoint": []}
    for i in range(min(args.repeats, n_endpoints)):
        victim = name(n_endpoints - 1 - i)
        for label, op in (
            ("precise_clear_endpoint", precise.clear_endpoint),
            ("approximate_drop_endpoint", approximate.drop_endpoint),
        ):
            started = time.perf_counter_ns()
            op(victim)
            clear[label].append((time.perf_counter_ns() - started) / 1e6)
    return {
        "pairs": pairs,
        "distinct_digests": distinct,
        "match_us": match,
        "record_us": record,
        "clear_ms": {label: round(median(ms), 2) for label, ms in clear.items()},
    }


def run_cell(n_endpoints: int, args: argparse.Namespace) -> dict[str, Any]:
    holdings = fill(random.Random(args.seed), args.blocks, n_endpoints)
    cpu = CpuSample.take()
    cell: dict[str, Any] = {"endpoints": n_endpoints}
    cell.update(run_ingest(holdings, args.repeats, args.seed))
    cell.update(run_lookups(holdings, n_endpoints, args))
    cell["other_cpu_cores"] = cpu.other_cores(CpuSample.take())
    return cell


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_for_memory(
    kind: str, n_pairs: int, n_endpoints: int, seed: int
) -> tuple[PreciseIndex | ApproximateIndex, dict[str, int]]:
    """One index built from digests created here (so that the ones it keeps are counted), and its size."""
    rng = random.Random(seed)
    index: PreciseIndex | ApproximateIndex
    if kind == "precise":
        index = PreciseIndex()
    else:
        index = ApproximateIndex(capacity_blocks_per_endpoint=2 * n_pairs // n_endpoints + QUERY_BLOCKS)
    pairs = 0
    while pairs < n_pairs:  # in slices, so that few transient events are alive at once
        holdings = fill(rng, min(50_000, n_pairs - pairs), n_endpoints)
        if isinstance(index, PreciseIndex):
            for group in batches(events(holdings, rng, Stored)):
                index.apply(group, 0.0)
        else:
            for endpoint, chain in holdings:
                index.record(name(endpoint), chain, 0.0)
        pairs += sum(len(c) for _, c in holdings)
        del holdings
    gc.collect()
    return index, {"pairs": pairs, "distinct_digests": len(index)}


def memory_child(kind: str, n_pairs: int, n_endpoints: int, seed: int) -> dict[str, Any]:
    """RSS growth of one build, then (same process, tracemalloc does not care about reuse) a traced one."""
    gc.collect()
    before = _rss_bytes()
    index, sizes = build_for_memory(kind, n_pairs, n_endpoints, seed)
    rss = _rss_bytes() - before
    del index
    gc.collect()
    tracemalloc.start()
    index, _sizes = build_for_memory(kind, n_pairs, n_endpoints, seed)
    assert len(index) == sizes["distinct_digests"], "the same build"
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {**sizes, "tracemalloc_bytes": traced, "rss_bytes": rss}


def run_memory(kind: str, n_pairs: int, n_endpoints: int, seed: int) -> dict[str, Any]:
    argv = [sys.executable, "-m", "load.bench.index", "--memory-child", kind, "--blocks", str(n_pairs)]
    argv += ["--endpoints", str(n_endpoints), "--seed", str(seed)]
    done = subprocess.run(
        argv, capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2]
    )
    figures: dict[str, Any] = json.loads(done.stdout)
    for key in ("tracemalloc", "rss"):
        figures[f"{key}_per_pair"] = round(figures[f"{key}_bytes"] / figures["pairs"], 1)
        figures[f"{key}_per_digest"] = round(figures[f"{key}_bytes"] / figures["distinct_digests"], 1)
    return figures


def _goals(cells: Sequence[dict[str, Any]], memory: dict[str, Any]) -> dict[str, Any]:
    """The task's goals, judged on the largest fleet (the worst case of each figure)."""
    worst_match = max(
        c["match_us"]["precise"][case]["p50"] for c in cells for case in ("full", "partial", "miss")
    )
    slowest = min(c["ingest"]["block_events_per_s"] for c in cells)
    per_pair = max(m["precise"]["tracemalloc_per_pair"] for m in memory.values())
    per_pair_rss = max(m["precise"]["rss_per_pair"] for m in memory.values())
    return {
        "match_256_p50_us": {"value": worst_match, "goal": GOAL_MATCH_US, "met": worst_match < GOAL_MATCH_US},
        "ingest_block_events_per_s": {
            "value": slowest,
            "goal": GOAL_EVENTS_PER_S,
            "met": slowest >= GOAL_EVENTS_PER_S,
        },
        "bytes_per_block_endpoint_tracemalloc": {
            "value": per_pair,
            "goal": GOAL_BYTES_PER_PAIR,
            "met": per_pair < GOAL_BYTES_PER_PAIR,
        },
        "bytes_per_block_endpoint_rss": {
            "value": per_pair_rss,
            "goal": GOAL_BYTES_PER_PAIR,
            "met": per_pair_rss < GOAL_BYTES_PER_PAIR,
        },
    }


def _print_cell(cell: dict[str, Any], memory: dict[str, Any]) -> None:
    out = sys.stderr
    n = cell["endpoints"]
    print(
        f"--- {n} endpoints, {cell['pairs']:,} (block, endpoint) pairs, "
        f"{cell['distinct_digests']:,} digests (other tenants {cell['other_cpu_cores']:.2f} cores)",
        file=out,
    )
    for key in ("ingest", "ingest_confirming", "removed"):
        rate = cell[key]
        print(
            f"{key:<18} {rate['block_events_per_s']:>12,} blocks/s {rate['events_per_s']:>10,} events/s",
            file=out,
        )
    print(f"{'match p50/p99 us':<18} {'full':>15} {'partial':>15} {'miss':>15}", file=out)
    for label, cases in cell["match_us"].items():
        row = " ".join(
            f"{cases[c]['p50']:>7.1f}/{cases[c]['p99']:<7.1f}" for c in ("full", "partial", "miss")
        )
        print(f"{label:<18} {row}", file=out)
    for label, rec in cell["record_us"].items():
        print(f"record {label:<11} new {rec['new']:>8.1f} us  held {rec['held']:>8.1f} us", file=out)
    for label, ms in cell["clear_ms"].items():
        print(f"{label:<26} {ms:>8.2f} ms", file=out)
    for label, mem in memory.items():
        print(
            f"memory {label:<11} {mem['tracemalloc_per_pair']:>6.1f} B/pair traced, "
            f"{mem['rss_per_pair']:>6.1f} B/pair RSS ({mem['tracemalloc_per_digest']:.1f} / "
            f"{mem['rss_per_digest']:.1f} B per digest)",
            file=out,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load.bench.index", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="JSON results file (required unless --memory-child)")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny smoke run (seconds, figures meaningless)"
    )
    parser.add_argument("--blocks", type=int, default=BLOCKS, help="(block, endpoint) pairs in the fill")
    parser.add_argument(
        "--endpoints", default=",".join(map(str, FLEETS)), help="fleet sizes, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=3, help="repeats (ingest, clear) and match rounds")
    parser.add_argument("--match-calls", type=int, default=1000, help="timed match calls per case per round")
    parser.add_argument("--record-calls", type=int, default=200, help="timed record calls per case")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quiet-threshold", type=float, default=0.25, help="re-run a cell noisier than this")
    parser.add_argument(
        "--max-attempts", type=int, default=3, help="runs of a noisy cell; the quietest is kept"
    )
    parser.add_argument("--quiet-wait-s", type=float, default=20.0, help="longest wait for a quiet machine")
    parser.add_argument("--memory-child", choices=("precise", "approximate"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    fleets = [int(x) for x in args.endpoints.split(",")]
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.blocks, fleets[0], args.seed)))
        return 0
    if args.out is None:
        parser.error("--out is required")
    if args.quick:
        fleets, args.blocks, args.repeats, args.match_calls, args.record_calls = [8], 20_000, 1, 50, 10
        args.max_attempts, args.quiet_wait_s = 1, 0.0
    info = machine()
    started = time.monotonic()
    cells: list[dict[str, Any]] = []
    memory: dict[str, Any] = {}
    for n_endpoints in fleets:
        cell = quietest(
            partial(run_cell, n_endpoints, args), args.quiet_threshold, args.max_attempts, args.quiet_wait_s
        )
        memory[str(n_endpoints)] = {
            kind: run_memory(kind, args.blocks, n_endpoints, args.seed) for kind in ("precise", "approximate")
        }
        cell["memory"] = memory[str(n_endpoints)]
        cells.append(cell)
        _print_cell(cell, memory[str(n_endpoints)])
    result: dict[str, Any] = {
        "benchmark": "index",
        "command": " ".join(["python -m load.bench.index", *(argv if argv is not None else sys.argv[1:])]),
        "machine": info,
        "revision": revision(),
        "parameters": {
            "quick": args.quick,
            "blocks": args.blocks,
            "endpoints": fleets,
            "repeats": args.repeats,
            "match_calls": args.match_calls,
            "record_calls": args.record_calls,
            "chain_blocks": list(CHAIN_BLOCKS),
            "shared_fraction": SHARED_FRACTION,
            "event_digests": list(EVENT_DIGESTS),
            "batch_events": BATCH_EVENTS,
            "query_blocks": QUERY_BLOCKS,
            "partial_leads": list(PARTIAL_LEADS),
            "seed": args.seed,
        },
        "cells": cells,
        "goals": _goals(cells, memory),
        "wall_s": round(time.monotonic() - started, 1),
    }
    write_json(args.out, result)
    for goal, figure in result["goals"].items():
        print(
            f"goal {goal}: {figure['value']} (goal {figure['goal']}): {'met' if figure['met'] else 'MISSED'}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
