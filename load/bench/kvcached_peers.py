"""kvcached peer fetch over QUIC, with a plain TCP transfer of the same bytes as the baseline.

A child process (``--serve``) holds the blocks (a RAM-only :class:`~kvcached.tiers.TieredStore`, random
payloads from ``--seed``) and serves them twice: over QUIC (:class:`~kvcached.peers.PeerServer`, mTLS with
dev certificates minted for the run) and over plain TCP (asyncio streams, no TLS) with the same request
and frame format (:mod:`kvcached.wire`; a zero-length frame ends a TCP response). The parent fetches with
:class:`~kvcached.peers.PeerClient` and with a TCP client that verifies every record the same way
(:func:`~kvcached.block.decode_record`), both over one kept connection on loopback. Measured:

QUIC runs three times (``[quic] max_datagram_size``): ``quic`` with QUIC's minimum 1,200-byte datagrams (the
daemon's default, safe on any path), ``quic_9000`` with 9,000-byte ones (about what 9,000-byte jumbo frames
allow) and ``quic_64k`` with 65,000-byte ones (loopback's MTU is 65,536: the most a same-host transfer can
use; several STREAM frames per packet, :mod:`kvcached.datagrams`). Both processes run uvloop, as the daemon
does.

* ``single_1mib``: one 1 MiB block per fetch, ``--calls`` fetches per transport, rounds interleaved;
  latency p50/p99 in ms (request sent to verified payload in hand).
* ``bulk``: ``--bulk-blocks`` blocks of 1 MiB in one fetch, ``--repeats`` times; GB/s of payload
  (10^9 bytes/s), the median repeat.

The TCP baseline does no encryption; QUIC encrypts every packet (AES-GCM) and runs its congestion control
and loss recovery in Python (aioquic), so the gap is the cost of aioquic and TLS. Both processes tune glibc
malloc as the daemon does (:func:`kvcached.memory.tune_malloc`); ``--default-malloc`` leaves it alone, to
show what that setting is worth.

    python -m load.bench.kvcached_peers --out results/kvcached_peers.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from statistics import median
from typing import Any

import uvloop

from certs.store import dev_bundle
from kvcached.block import decode_record, encode_record
from kvcached.memory import tune_malloc
from kvcached.peers import DATAGRAM_BYTES_DEFAULT, DATAGRAM_BYTES_MAX, PeerClient, PeerServer
from kvcached.tiers import TieredStore
from kvcached.wire import FRAME_HEADER_BYTES, decode_request, encode_request, frame_header
from load.bench import machine, revision, summary, write_json

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
GOAL_QUIC_1MIB_P99_MS = 6.0
DATAGRAMS = {"quic": DATAGRAM_BYTES_DEFAULT, "quic_9000": 9000, "quic_64k": DATAGRAM_BYTES_MAX}
"""QUIC variants measured: name -> datagram payload bytes."""
_U32 = struct.Struct(">I")


def digest(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payloads(seed: int, count: int) -> dict[bytes, bytes]:
    """``count`` deterministic 1 MiB payloads: digest(i) -> bytes."""
    rng = random.Random(seed)
    return {digest(i): rng.randbytes(MIB) for i in range(count)}


# -- the serving child ---------------------------------------------------------------------------------


async def _serve_tcp(store: TieredStore, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readexactly(8)
            (count,) = _U32.unpack_from(head, 4)
            raw = head + await reader.readexactly(count * 16)
            for d in decode_request(raw):
                data = store.get(d)
                if data is not None:
                    record = encode_record(d, data)
                    writer.write(frame_header(d, len(record)))
                    writer.write(record)
                    await writer.drain()
            writer.write(_U32.pack(0))
            await writer.drain()
    except asyncio.IncompleteReadError:
        pass
    finally:
        writer.close()


async def serve(certs: Path, seed: int, count: int) -> None:
    """Child: serve ``count`` blocks over QUIC and TCP, print the ports as JSON, run until stdin closes."""
    store = TieredStore(ram_bytes=(count + 1) * MIB, ssd_path=None, ssd_bytes=0)
    for d, data in payloads(seed, count).items():
        store.put(d, data)
    leaf = certs / "kvcached-server.pem"
    quics = {
        name: PeerServer(
            store,
            host="127.0.0.1",
            port=0,
            cert=leaf,
            key=leaf.with_suffix(".key"),
            ca=certs / "ca.pem",
            max_datagram_size=size,
        )
        for name, size in DATAGRAMS.items()
    }
    ports = {name: await server.start() for name, server in quics.items()}
    tcp = await asyncio.start_server(lambda r, w: _serve_tcp(store, r, w), "127.0.0.1", 0)
    ports["tcp"] = tcp.sockets[0].getsockname()[1]
    print(json.dumps(ports), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    tcp.close()
    for server in quics.values():
        await server.aclose()
    store.close()


# -- the measuring parent ------------------------------------------------------------------------------


class TcpClient:
    """The baseline: same request and frames over one plain TCP connection, every record verified."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def fetch(self, digests: list[bytes]) -> dict[bytes, bytes]:
        if self._conn is None:
            self._conn = await asyncio.open_connection("127.0.0.1", self._port)
        reader, writer = self._conn
        writer.write(encode_request(digests))
        await writer.drain()
        out: dict[bytes, bytes] = {}
        while True:
            (length,) = _U32.unpack(await reader.readexactly(4))
            if length == 0:
                return out
            frame = await reader.readexactly(length)
            d = frame[: FRAME_HEADER_BYTES - 4]
            out[d] = decode_record(d, memoryview(frame)[FRAME_HEADER_BYTES - 4 :])

    async def aclose(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            await self._conn[1].wait_closed()


async def measure(args: argparse.Namespace, certs: Path, ports: dict[str, int]) -> dict[str, Any]:
    leaf = certs / "kvcached-client.pem"
    quics = {
        name: PeerClient(
            cert=leaf,
            key=leaf.with_suffix(".key"),
            ca=certs / "ca.pem",
            timeout_s=30.0,
            max_datagram_size=size,
        )
        for name, size in DATAGRAMS.items()
    }
    tcp = TcpClient(ports["tcp"])
    fetchers: dict[str, Callable[[list[bytes]], Awaitable[dict[bytes, bytes]]]] = {
        name: partial(client.fetch, f"127.0.0.1:{ports[name]}") for name, client in quics.items()
    }
    fetchers["tcp"] = tcp.fetch
    try:
        for fetch in fetchers.values():  # connect and warm up
            assert len(await fetch([digest(0)])) == 1
        single: dict[str, list[float]] = {name: [] for name in fetchers}
        for i in range(args.calls):
            for name, fetch in fetchers.items():
                d = [digest(i % args.bulk_blocks)]
                started = time.perf_counter()
                got = await fetch(d)
                single[name].append((time.perf_counter() - started) * 1e3)
                assert len(got) == 1
        bulk: dict[str, list[float]] = {name: [] for name in fetchers}
        wanted = [digest(i) for i in range(args.bulk_blocks)]
        for _ in range(args.repeats):
            for name, fetch in fetchers.items():
                started = time.perf_counter()
                got = await fetch(wanted)
                elapsed = time.perf_counter() - started
                assert len(got) == args.bulk_blocks
                bulk[name].append(args.bulk_blocks * MIB / elapsed / 1e9)
    finally:
        for client in quics.values():
            await client.aclose()
        await tcp.aclose()
    return {
        "single_1mib_ms": {name: summary(v, 3) for name, v in single.items()},
        "bulk_gb_per_s": {
            name: {"median": round(median(v), 3), "all": [round(x, 3) for x in v]} for name, v in bulk.items()
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvcached-peers-bench-") as tmp:
        certs = Path(tmp)
        dev_bundle(certs, ["kvcached-server", "kvcached-client"], dt.datetime.now(dt.UTC))
        serve_argv = ["--serve", str(certs), "--seed", str(args.seed), "--bulk-blocks", str(args.bulk_blocks)]
        if args.default_malloc:
            serve_argv.append("--default-malloc")
        with subprocess.Popen(
            [sys.executable, "-m", "load.bench.kvcached_peers", *serve_argv],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as child:
            return _drive(args, certs, child)


def _drive(args: argparse.Namespace, certs: Path, child: subprocess.Popen[str]) -> dict[str, Any]:
    """Read the child's ports, measure, then stop the child (stdin closed; killed by PID if it lingers)."""
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # blocks until the child is ready (or has died: empty line)
        if not line:
            raise RuntimeError(f"serving child exited with {child.wait()}")
        return uvloop.run(measure(args, certs, json.loads(line)))
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m load.bench.kvcached_peers", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--out", type=Path, help="JSON results file")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny smoke run (seconds, figures meaningless)"
    )
    parser.add_argument("--calls", type=int, default=300, help="1 MiB fetches per transport")
    parser.add_argument("--bulk-blocks", type=int, default=128, help="1 MiB blocks per bulk fetch")
    parser.add_argument("--repeats", type=int, default=5, help="bulk fetches per transport")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc malloc at its defaults in both processes (the daemon tunes it: kvcached/memory.py)",
    )
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.default_malloc:
        pass
    elif not tune_malloc():  # both processes, as the daemon does (kvcached/memory.py)
        print("note: malloc could not be tuned (not glibc)", file=sys.stderr)
    if args.serve is not None:
        uvloop.run(serve(args.serve, args.seed, args.bulk_blocks))
        return 0
    if args.out is None:
        parser.error("--out is required")
    if args.quick:
        args.calls, args.bulk_blocks, args.repeats = 10, 8, 1
    info = machine()
    started = time.monotonic()
    figures = run(args)
    result: dict[str, Any] = {
        "benchmark": "kvcached_peers",
        "command": " ".join(
            ["python -m load.bench.kvcached_peers", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": info,
        "revision": revision(),
        "parameters": {
            "quick": args.quick,
            "calls": args.calls,
            "bulk_blocks": args.bulk_blocks,
            "block_bytes": MIB,
            "repeats": args.repeats,
            "seed": args.seed,
            "malloc": "glibc defaults" if args.default_malloc else "tuned (kvcached.memory.tune_malloc)",
        },
        **figures,
        "goals": {
            f"{name}_1mib_p99_ms": {
                "value": figures["single_1mib_ms"][name]["p99"],
                "goal": GOAL_QUIC_1MIB_P99_MS,
                "met": figures["single_1mib_ms"][name]["p99"] < GOAL_QUIC_1MIB_P99_MS,
            }
            for name in DATAGRAMS
        },
        "wall_s": round(time.monotonic() - started, 1),
    }
    write_json(args.out, result)
    print(table(result))
    return 0


def table(result: dict[str, Any]) -> str:
    """The figures as a Markdown table, QUIC beside the TCP baseline."""
    single, bulk = result["single_1mib_ms"], result["bulk_gb_per_s"]
    rows = ["| transport | 1 MiB p50 ms | 1 MiB p99 ms | bulk GB/s |", "|---|---|---|---|"]
    for name in single:
        rows.append(f"| {name} | {single[name]['p50']} | {single[name]['p99']} | {bulk[name]['median']} |")
    for name, goal in result["goals"].items():
        rows.append(f"goal {name} < {goal['goal']} ms: {'met' if goal['met'] else 'MISSED'}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
