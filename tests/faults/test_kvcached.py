"""Fault: a real kvcached daemon (``python -m kvcached.main``) killed with SIGKILL under steady load, then
restarted on the same data directory (issue 24, part 4: "nothing lost in kvcached after kill -9").

**The contract tested** (kvcached/README.md, "Durability"): a ``Put`` is acknowledged once the block is in
the fastest tier that fits it, RAM; RAM is written down only by demotion (a RAM eviction is written to the
SSD tier, RocksDB with its WAL, before the put that evicted it returns). So after ``kill -9`` a restarted
daemon serves every acknowledged block except those held only in RAM at the kill, at most
``ram_bytes / block size`` of them, and never a torn or corrupt one. Here the SSD tier is larger than
everything written, so nothing leaves it for its budget.

With ``write_through = true`` every put is also in the SSD tier before it is acknowledged, and nothing
acknowledged is lost: the first test runs both ways.

1. ``test_kill_9_under_load``: writers put new blocks and readers get acknowledged ones (each checked
   byte for byte) on the daemon's unix socket, without pause; the daemon is killed and restarted while
   they run. Asserted: nothing corrupt is ever served; no call hangs (every call is bounded by the client's
   timeout, a hang is a call still running 10 s past it); clients see errors only from the kill until the
   restarted daemon answered; every acknowledged block not lost with RAM reads back and verifies, and at
   most the RAM tier's capacity is lost; the restarted daemon counts no corrupt record.
2. ``test_peer_killed_under_fetch_load``: daemon A (RAM only, one block) serves ``Get`` s of blocks that
   only daemon B holds (on its SSD), so every call is a peer fetch over QUIC with mTLS; B is killed and
   restarted on the same data directory and QUIC port. Asserted: during the outage A answers a miss within
   its peer timeout (``quic.timeout_s`` + 1 s) plus slack, never an error, a hang or a wrong block; fetches
   succeed again once B is back.

Each test prints its record (sent / ok / failed / hung / recovery) in the fault table's shape and, with
``KVGATE_FAULT_OUT=DIR``, writes it as JSON there. ``KVGATE_FAULT_SECONDS`` (default 2) sets the seconds
of load before the kill and after the recovery (BENCHMARKS.md "Reliability" runs it longer).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from blake3 import blake3

from certs.store import LeafFiles, dev_bundle
from kvcached.errors import KvcachedError
from kvgate.dev.procs import written_by
from runtime.kvcached import KvcachedClient

BLOCK = 4096
RAM_BLOCKS = 16
CLIENT_TIMEOUT_S = 5.0
#: A call still running this long past the client's own timeout is counted hung.
HANG_SLACK_S = 10.0
QUIC_TIMEOUT_S = 1.0
SECONDS = float(os.environ.get("KVGATE_FAULT_SECONDS", "2"))


def digest(i: int) -> bytes:
    return blake3(b"fault-kvcached-d%d" % i).digest(16)


def payload(i: int) -> bytes:
    return blake3(b"fault-kvcached-v%d" % i).digest(length=BLOCK)


class Proc:
    """A daemon process, started without a ``preexec_fn`` (so Python spawns it with ``vfork``, and the
    gRPC fork handlers of this test process, busy with the load's calls, never run in a forked copy: with
    ``kvgate.dev.procs.Child``'s ``fork`` a restart under load was aborted in the child now and then).
    stdout and stderr go to ``log_path`` (appended)."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, path: Path, timeout_s: float) -> dict[str, Any]:
        """The ready file's JSON once this process wrote it (blocking; polls every 20 ms)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                data = json.loads(path.read_text())
                if written_by(data, self.pid):
                    return dict(data)
            except (OSError, ValueError):
                pass
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
            assert self.proc.poll() is None, f"exited ({self.proc.returncode}) before ready:\n{tail}"
            assert time.monotonic() < deadline, f"not ready within {timeout_s} s:\n{tail}"
            time.sleep(0.02)  # polling the ready file

    def stop(self) -> None:
        """SIGTERM by PID, SIGKILL after 10 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Daemon:
    """One kvcached process and what it needs to be started again on the same data directory."""

    name: str
    tmp: Path
    config: Path
    child: Proc
    status: dict[str, Any]

    @property
    def sock(self) -> Path:
        return self.tmp / f"{self.name}.sock"

    def kill(self) -> None:
        os.kill(self.child.pid, signal.SIGKILL)  # by PID: only the daemon this test started
        self.child.proc.wait(10)

    def restart(self) -> None:
        """Start it again on the same config (blocking: call it off the event loop)."""
        self.child, self.status = _spawn(self.name, self.tmp, self.config)

    def stop(self) -> None:
        self.child.stop()


def _spawn(name: str, tmp: Path, config: Path) -> tuple[Proc, dict[str, Any]]:
    ready = tmp / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "kvcached.main", "--config", str(config), "--ready-file", str(ready)]
    proc = Proc(argv, tmp / f"{name}.log")
    try:
        return proc, proc.wait_ready(ready, 60)
    except BaseException:
        proc.stop()
        raise


def start(tmp: Path, name: str, body: str) -> Daemon:
    config = tmp / f"{name}.toml"
    config.write_text(f'[kvcached]\nnode = "{name}"\nlisten_unix = "{tmp / f"{name}.sock"}"\n{body}')
    child, status = _spawn(name, tmp, config)
    return Daemon(name, tmp, config, child, status)


def tls(leaf: LeafFiles) -> str:
    return f'[kvcached.tls]\ncert = "{leaf.cert}"\nkey = "{leaf.key}"\nca = "{leaf.ca}"\n'


@dataclass
class Record:
    """What the load saw: every call with its start and end (monotonic seconds) and outcome."""

    calls: list[tuple[str, float, float, str]] = field(default_factory=list)
    killed_at: float = 0.0
    restarted_at: float = 0.0  # the restarted daemon wrote its ready file (seen by the test)

    def note(self, kind: str, started: float, outcome: str) -> None:
        self.calls.append((kind, started, time.monotonic(), outcome))

    def count(self, outcome: str) -> int:
        return sum(1 for c in self.calls if c[3] == outcome)

    def recovered_at(self) -> float:
        """The end of the first call that started after the kill and succeeded."""
        return min(
            end for _, start, end, outcome in self.calls if start >= self.killed_at and outcome == "ok"
        )

    def row(self, fault: str, **extra: Any) -> dict[str, Any]:
        failed: dict[str, int] = {}
        for _, _, _, outcome in self.calls:
            if outcome not in ("ok", "miss", "hung"):
                failed[outcome] = failed.get(outcome, 0) + 1
        return {
            "fault": fault,
            "sent": len(self.calls),
            "ok": self.count("ok"),
            "miss": self.count("miss"),
            "failed": failed,
            "hung": self.count("hung"),
            "recovery_s": round(self.recovered_at() - self.killed_at, 3),
            "restart_s": round(self.restarted_at - self.killed_at, 3),
            "load_s_each_side": SECONDS,
            **extra,
        }


def report(row: dict[str, Any], name: str) -> None:
    print(f"\nfault {name}: {json.dumps(row)}")
    out = os.environ.get("KVGATE_FAULT_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(row, indent=2) + "\n")


async def bounded(record: Record, kind: str, call: Callable[[], Awaitable[str]]) -> str:
    """Run one client call and note its outcome: the call's own, ``hung`` past the client's timeout plus
    :data:`HANG_SLACK_S`, or the error's type."""
    started = time.monotonic()
    try:
        outcome = await asyncio.wait_for(call(), CLIENT_TIMEOUT_S + HANG_SLACK_S)
    except TimeoutError:
        outcome = "hung"
    except KvcachedError as exc:
        outcome = type(exc).__name__
    record.note(kind, started, outcome)
    return outcome


async def load_around_a_kill(
    daemon: Daemon, record: Record, workers: Callable[[asyncio.Event], list[Awaitable[None]]]
) -> None:
    """Run ``workers`` for :data:`SECONDS`, kill the daemon, restart it while they keep running, and let
    them run :data:`SECONDS` past the first successful call after the kill."""
    stop = asyncio.Event()
    tasks = [asyncio.ensure_future(w) for w in workers(stop)]
    try:
        await asyncio.sleep(SECONDS)  # steady load before the fault; the load itself is the test
        record.killed_at = time.monotonic()
        daemon.kill()
        await asyncio.to_thread(daemon.restart)
        record.restarted_at = time.monotonic()
        deadline = time.monotonic() + 60
        while not any(s >= record.killed_at and o == "ok" for _, s, _, o in record.calls):
            assert time.monotonic() < deadline, "no successful call within 60 s of the restart"
            assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
            await asyncio.sleep(0.05)  # polling the record
        await asyncio.sleep(SECONDS)  # steady load after the recovery
    finally:
        stop.set()
        await asyncio.gather(*tasks)


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    """The daemons a test started, stopped (by PID) whatever happens."""
    started: list[Daemon] = []
    yield started
    for daemon in started:
        daemon.stop()


@pytest.mark.parametrize("write_through", [False, True], ids=["ram-ack", "write-through"])
async def test_kill_9_under_load(tmp_path: Path, daemons: list[Daemon], write_through: bool) -> None:
    daemon = start(
        tmp_path,
        "a",
        f'ram_bytes = {RAM_BLOCKS * BLOCK}\nssd_path = "{tmp_path / "a-ssd"}"\n'
        f"ssd_bytes = {256 * 1024 * 1024}\nwrite_through = {str(write_through).lower()}\n",
    )
    daemons.append(daemon)
    client = KvcachedClient(f"unix:{daemon.sock}", timeout_s=CLIENT_TIMEOUT_S)
    record, acked, corrupt, next_i = Record(), [], [], iter(range(10**9))
    misses: list[tuple[int, float]] = []
    rng = random.Random(os.getpid())  # the seed is in every failure message

    async def put(i: int) -> str:
        await client.put(digest(i), payload(i))
        return "ok"

    async def get(i: int) -> str:
        data = await client.get(digest(i), peers=False)
        if data is None:
            return "miss"
        if data != payload(i):
            corrupt.append(i)
            return "corrupt"
        return "ok"

    async def writer(stop: asyncio.Event) -> None:
        while not stop.is_set():
            i = next(next_i)
            if await bounded(record, "put", lambda i=i: put(i)) == "ok":
                acked.append(i)
            else:
                await asyncio.sleep(0.01)  # a down daemon refuses at once: do not spin

    async def reader(stop: asyncio.Event) -> None:
        while not stop.is_set():
            if not acked:
                await asyncio.sleep(0.01)  # nothing acknowledged yet
                continue
            i = rng.choice(acked)
            started = time.monotonic()
            outcome = await bounded(record, "get", lambda i=i: get(i))
            if outcome == "miss":
                misses.append((i, started))
            elif outcome != "ok":
                await asyncio.sleep(0.01)

    try:
        await load_around_a_kill(
            daemon, record, lambda stop: [writer(stop), writer(stop), reader(stop), reader(stop)]
        )
        # After the load: every acknowledged block reads back whole, or was held only in RAM.
        lost = []
        for i in acked:
            data = await client.get(digest(i), peers=False)
            assert data is None or data == payload(i), f"block {i} served corrupt (seed {os.getpid()})"
            if data is None:
                lost.append(i)
        stats = await client.stats()
    finally:
        await client.aclose()

    row = record.row(
        "kvcached kill -9" + (" (write_through)" if write_through else ""),
        acknowledged=len(acked),
        lost_with_ram=len(lost),
        ram_capacity_blocks=RAM_BLOCKS,
        corrupt=len(corrupt),
    )
    report(row, "kvcached-kill9" + ("-write-through" if write_through else ""))
    assert not corrupt and stats["ssd_corrupt"] == 0
    assert record.count("hung") == 0
    assert len(lost) <= (0 if write_through else RAM_BLOCKS), row  # only what RAM alone held at the kill
    assert len(acked) > 2 * RAM_BLOCKS, row  # the SSD tier was reached before the kill
    # A miss is a lost block (after the kill), never an acknowledged block the daemon still holds.
    assert all(started >= record.killed_at and i in lost for i, started in misses), (misses, lost)
    # Errors only while the daemon was down: calls that ended after the kill and began before the
    # restarted daemon first answered.
    recovered = record.recovered_at()
    for kind, started, ended, outcome in record.calls:
        if outcome not in ("ok", "miss"):
            assert ended >= record.killed_at and started <= recovered, (kind, started, ended, outcome)


async def test_peer_killed_under_fetch_load(tmp_path: Path, daemons: list[Daemon]) -> None:
    leaves = dev_bundle(tmp_path / "certs", ["kvcached-a", "kvcached-b"], dt.datetime.now(dt.UTC))
    b = start(
        tmp_path,
        "b",
        f'ram_bytes = {4 * BLOCK}\nssd_path = "{tmp_path / "b-ssd"}"\nssd_bytes = {64 * 1024 * 1024}\n'
        + tls(leaves["kvcached-b"])
        + f'[quic]\nlisten = "127.0.0.1:0"\ntimeout_s = {QUIC_TIMEOUT_S}\n',
    )
    daemons.append(b)
    quic = str(b.status["quic"])
    # Restarts keep the QUIC port A knows it by.
    b.config.write_text(b.config.read_text().replace('listen = "127.0.0.1:0"', f'listen = "{quic}"'))
    blocks = 48
    holder = KvcachedClient(f"unix:{b.sock}", timeout_s=CLIENT_TIMEOUT_S)
    try:
        for i in range(blocks + 4):  # the last 4 stay in B's RAM (lost with it): never asked for
            await holder.put(digest(i), payload(i))
        assert (await holder.stats())["ssd_blocks"] >= blocks
    finally:
        await holder.aclose()
    a = start(
        tmp_path,
        "a",
        f"ram_bytes = {BLOCK}\n"  # one block, no SSD: nearly every Get is a peer fetch
        + tls(leaves["kvcached-a"])
        + f'[quic]\nlisten = "127.0.0.1:0"\ntimeout_s = {QUIC_TIMEOUT_S}\n'
        + f'[[peers]]\nnode = "b"\naddress = "{quic}"\n',
    )
    daemons.append(a)
    client = KvcachedClient(f"unix:{a.sock}", timeout_s=CLIENT_TIMEOUT_S + 5)
    record, wrong, slow = Record(), [], []
    rng = random.Random(os.getpid())
    bound_s = QUIC_TIMEOUT_S + 1.0 + 5.0  # A's peer timeout, plus slack for a loaded machine

    async def fetch(i: int) -> str:
        started = time.monotonic()
        reply = await client.lookup(digest(i))
        if time.monotonic() - started > bound_s:
            slow.append(time.monotonic() - started)
        if reply.data is None:
            return "miss"
        if reply.data != payload(i):
            wrong.append(i)
            return "corrupt"
        return "ok"

    async def fetcher(stop: asyncio.Event) -> None:
        while not stop.is_set():
            i = rng.randrange(blocks)
            await bounded(record, "get", lambda i=i: fetch(i))

    try:
        await load_around_a_kill(b, record, lambda stop: [fetcher(stop), fetcher(stop)])
        stats = await client.stats()
    finally:
        await client.aclose()
    during = [c for c in record.calls if c[1] >= record.killed_at and c[2] <= record.recovered_at()]
    row = record.row(
        "kvcached peer killed under fetch",
        misses_during_outage=sum(1 for c in during if c[3] == "miss"),
        slowest_s=round(max(end - start for _, start, end, _ in record.calls), 3),
        peer_timeout_s=QUIC_TIMEOUT_S + 1.0,
        peer_unavailable=stats.get("peer_unavailable"),
    )
    report(row, "kvcached-peer")
    assert not wrong and record.count("hung") == 0 and not slow, row
    assert set(c[3] for c in record.calls) <= {"ok", "miss"}, row  # a dead peer is a miss, not an error
    assert record.count("ok") > 0 and row["misses_during_outage"] >= 0
