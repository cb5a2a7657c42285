"""Crash safety: a writer killed with SIGKILL at a random point leaves a store that, reopened, serves
only whole blocks that match what was written (never a torn or stale one)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from blake3 import blake3

from kvcached.tier import TIER_SSD
from kvcached.tiers import TieredStore

ROOT = Path(__file__).resolve().parents[2]
RAM_BYTES = 300 * 1024
SSD_BYTES = 6 * 1024 * 1024
ROUNDS = 3

WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from blake3 import blake3
    from kvcached.tiers import TieredStore

    def size(i): return 1024 * (1 + (i * 37) % 256)
    store = TieredStore(int(sys.argv[2]), Path(sys.argv[1]), int(sys.argv[3]))
    i = int(sys.argv[4])
    while True:
        store.put(blake3(b"d%d" % i).digest(16), blake3(b"v%d" % i).digest(length=size(i)))
        print(i, flush=True)
        i += 1
    """
)


def digest_of(i: int) -> bytes:
    return blake3(b"d%d" % i).digest(16)


def payload_of(i: int) -> bytes:
    return blake3(b"v%d" % i).digest(length=1024 * (1 + (i * 37) % 256))


def run_and_kill(path: Path, start: int, kill_after: int) -> int:
    """Start the writer, SIGKILL it (by PID) once it acknowledged ``kill_after`` puts; the last i it
    acknowledged before dying (it runs ahead of our reads, so lines still in the pipe count too)."""
    args = [sys.executable, "-c", WRITER, str(path), str(RAM_BYTES), str(SSD_BYTES), str(start)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, cwd=ROOT, env=env, text=True)
    last = start - 1
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        while last < start + kill_after - 1:
            line = proc.stdout.readline()
            assert line, f"writer exited early with {proc.poll()}"
            last = int(line)
            assert time.monotonic() < deadline, "writer too slow"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        if proc.stdout is not None:
            # the writer may have acknowledged more puts before the signal landed: they are in the pipe
            for line in proc.stdout.read().split():
                last = max(last, int(line))
            proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    return last


def test_kill_9_during_writes_then_restart_serves_only_verified_blocks(tmp_path: Path) -> None:
    seed = os.getpid()  # a different kill point each run; the seed is in every failure message
    rng = random.Random(seed)
    path = tmp_path / "ssd"
    start = 0
    for _ in range(ROUNDS):
        last = run_and_kill(path, start, rng.randint(20, 80))
        store = TieredStore(RAM_BYTES, path, SSD_BYTES)
        try:
            held = store.held()[TIER_SSD]
            assert held, f"nothing reached the SSD tier (seed {seed})"
            assert store.stats()["ssd_bytes"] <= SSD_BYTES
            known = {digest_of(i): i for i in range(last + 2)}  # the put in flight may have landed
            for digest in held:
                assert digest in known, f"a block nobody wrote (seed {seed})"
                assert store.get(digest) == payload_of(known[digest]), f"block {known[digest]} (seed {seed})"
            assert store.stats()["ssd_corrupt"] == 0, f"seed {seed}"
        finally:
            store.close()
        start = last + 2
