"""kvcached tier micro-benchmark: :meth:`TieredStore.get` latency for RAM and SSD hits, with a plain
rocksdict get of the same bytes as the baseline, in the same run.

For each block size (16 KiB, 64 KiB, 256 KiB, 1 MiB) ``--blocks`` random blocks are stored, then
``--gets`` gets of random held digests are timed one by one (``perf_counter_ns``), in ``--rounds``
interleaved rounds; each figure is the median over rounds of that round's percentile, in µs. A cell run
while other tenants used more than ``--quiet-threshold`` cores is re-run (the quietest run is kept):

* ``ram_hit``: a store with only a RAM tier large enough for every block (an ``OrderedDict`` lookup).
* ``ssd_hit``: a store with a zero RAM budget, reopened after the writes (so values are read from blob
  files, not the memtable): RocksDB get + record decode + BLAKE3 verification; no promotion (nothing fits
  in RAM). The files were just written, so reads are served from the OS page cache: a cold read adds
  the device's latency.
* ``rocksdict_get`` (baseline): a plain ``Rdict`` (default options, raw mode) holding the same bytes under
  the same 16-byte keys, reopened the same way; a bare ``get``, nothing verified.
* ``dict_get`` (floor): a Python ``dict`` lookup of the same bytes.

QUIC peer figures: :data:`PEER_BENCH` is the hook where the peer-fetch benchmark plugs in (see there).

    python -m load.bench.kvcached --out results/kvcached.json [--quick]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from statistics import median
from typing import Any

from rocksdict import Options, Rdict

from kvcached.tiers import TieredStore
from load.bench import CpuSample, machine, percentile, quietest, revision, write_json

SIZES = (16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024)
MODES = ("ram_hit", "ssd_hit", "rocksdict_get", "dict_get")
GOAL_RAM_P99_US = 100.0
GOAL_SSD_P99_US = 2500.0

# --- QUIC peer figures: filled by the peer benchmark (K2) -----------------------------------------------
PEER_BENCH: Callable[[argparse.Namespace], dict[str, Any]] | None = None
"""The peer-fetch benchmark, or ``None``. Called once with the parsed arguments (``args.quick``,
``args.seed``, ``args.out`` ...) after the tier cells; what it returns is stored under ``"peer"`` in the
results (e.g. 1 MiB block over QUIC on loopback p50/p99, bulk fetch GB/s, and a plain TCP transfer of the
same bytes as its baseline). Set it here, or from the peer benchmark module before calling :func:`main`."""
# ---------------------------------------------------------------------------------------------------------


Getter = Callable[[bytes], bytes | None]


def time_gets(get: Getter, digests: list[bytes], rng: random.Random, calls: int) -> list[float]:
    """Latency in µs of ``calls`` gets of random digests from ``digests`` (each must hit)."""
    order = [rng.choice(digests) for _ in range(calls)]
    out: list[float] = []
    clock = time.perf_counter_ns
    for digest in order:
        t0 = clock()
        data = get(digest)
        out.append((clock() - t0) / 1000)
        if data is None:
            raise RuntimeError("a timed get missed")
    return out


def run_size(size: int, args: argparse.Namespace, parent: Path) -> dict[str, Any]:
    """One block size: every mode, ``args.rounds`` interleaved rounds (in a fresh directory)."""
    workdir = Path(tempfile.mkdtemp(dir=parent))
    rng = random.Random(args.seed + size)
    blocks = {rng.randbytes(16): rng.randbytes(size) for _ in range(args.blocks)}
    digests = list(blocks)
    ram = TieredStore(size * (args.blocks + 1), None, 0, max_block_bytes=size)
    ssd_path, plain_path = workdir / f"ssd-{size}", workdir / f"plain-{size}"
    ssd_budget = (size + 1024) * (args.blocks + 1)
    writer = TieredStore(0, ssd_path, ssd_budget, max_block_bytes=size)
    plain = Rdict(str(plain_path), Options(raw_mode=True))
    for digest, data in blocks.items():
        ram.put(digest, data)
        writer.put(digest, data)
        plain[digest] = data
    writer.close()
    plain.close()
    ssd = TieredStore(0, ssd_path, ssd_budget, max_block_bytes=size)
    plain = Rdict(str(plain_path), Options(raw_mode=True))

    def plain_get(digest: bytes) -> bytes | None:
        value = plain.get(digest)
        return value if isinstance(value, bytes) else None

    getters: dict[str, Getter] = {
        "ram_hit": ram.get,
        "ssd_hit": ssd.get,
        "rocksdict_get": plain_get,
        "dict_get": blocks.get,
    }
    samples: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    before = CpuSample.take()
    try:
        for get in getters.values():  # warm-up
            time_gets(get, digests, rng, min(args.gets, 50))
        for _ in range(args.rounds):
            for mode, get in getters.items():
                samples[mode].append(sorted(time_gets(get, digests, rng, args.gets)))
    finally:
        other = before.other_cores(CpuSample.take())
        ssd.close()
        ram.close()
        plain.close()
    cell: dict[str, Any] = {"block_bytes": size, "other_cpu_cores": other}
    for mode in MODES:
        cell[mode] = {
            f"p{pct}": round(median(percentile(r, pct) for r in samples[mode]), 1) for pct in (50, 90, 99)
        }
    stats = ssd.stats()
    cell["ssd_hits"], cell["ssd_corrupt"] = stats["ssd_hits"], stats["ssd_corrupt"]
    return cell


def _goals(cells: list[dict[str, Any]]) -> dict[str, Any]:
    largest = max(cells, key=lambda c: int(c["block_bytes"]))
    ram = max(float(c["ram_hit"]["p99"]) for c in cells)
    ssd = float(largest["ssd_hit"]["p99"])
    return {
        "ram_hit_p99_us": {"goal": f"< {GOAL_RAM_P99_US}", "worst_size": ram, "met": ram < GOAL_RAM_P99_US},
        "ssd_hit_p99_us": {
            "goal": f"< {GOAL_SSD_P99_US}",
            "block_bytes": largest["block_bytes"],
            "measured": ssd,
            "met": ssd < GOAL_SSD_P99_US,
        },
    }


def _print(cells: list[dict[str, Any]]) -> None:
    out = sys.stderr
    print(f"{'block':>8} " + " ".join(f"{m + ' p50/p99 us':>26}" for m in MODES), file=out)
    for cell in cells:
        row = " ".join(f"{cell[m]['p50']:>12.1f} / {cell[m]['p99']:>11.1f}" for m in MODES)
        print(f"{cell['block_bytes'] // 1024:>5} KiB {row}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load.bench.kvcached", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (figures meaningless)")
    parser.add_argument("--blocks", type=int, default=256, help="blocks stored per size")
    parser.add_argument("--gets", type=int, default=2000, help="timed gets per mode per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="block sizes in bytes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quiet-threshold", type=float, default=0.3, help="re-run a cell noisier than this")
    parser.add_argument("--max-attempts", type=int, default=3, help="runs of a noisy cell (quietest kept)")
    parser.add_argument("--quiet-wait-s", type=float, default=10.0, help="longest wait for a quiet machine")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.quick:
        args.blocks, args.gets, args.rounds, args.max_attempts, args.quiet_wait_s = 8, 50, 1, 1, 0.0
        sizes = [16 * 1024, 256 * 1024]
    started = time.monotonic()
    info = machine()
    with tempfile.TemporaryDirectory(prefix="kvcached-bench-") as tmp:
        cells = [
            quietest(
                partial(run_size, size, args, Path(tmp)),
                args.quiet_threshold,
                args.max_attempts,
                args.quiet_wait_s,
            )
            for size in sizes
        ]
    _print(cells)
    result: dict[str, Any] = {
        "benchmark": "kvcached",
        "command": " ".join(["python -m load.bench.kvcached", *(argv if argv is not None else sys.argv[1:])]),
        "machine": info,
        "revision": revision(),
        "parameters": {
            "quick": args.quick,
            "blocks": args.blocks,
            "gets": args.gets,
            "rounds": args.rounds,
            "sizes": sizes,
            "seed": args.seed,
            "quiet_threshold": args.quiet_threshold,
        },
        "cells": cells,
        "goals": _goals(cells),
    }
    if PEER_BENCH is not None:
        result["peer"] = PEER_BENCH(args)
    result["wall_s"] = round(time.monotonic() - started, 1)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
