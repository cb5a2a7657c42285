"""A host's workers' status pages combined (extproc/status/peers.py): two real status servers on 127.0.0.1
sharing a siblings directory announce themselves there; each one's /status page shows both views and
the combined fleet, its /status.json stays its own; a gone worker's announcement is skipped, a silent
one is shown as unreachable, and closing withdraws the announcement."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from extproc.control.policy import PolicyStore
from extproc.fleet import Fleet
from extproc.flow.control import FlowControl
from extproc.index.hybrid import HybridIndex
from extproc.status.http import StatusServer
from extproc.status.peers import SUFFIX, StatusPeers, announced_url
from extproc.status.snapshot import Status, decode, snapshot
from tests.extproc.status.test_http import get
from tests.extproc.status.test_snapshot import A, B


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("0.0.0.0:9090", "http://127.0.0.1:5"),
        (":9090", "http://127.0.0.1:5"),
        ("[::]:9090", "http://[::1]:5"),
        ("127.0.0.2:0", "http://127.0.0.2:5"),
        ("[::1]:0", "http://[::1]:5"),
    ],
)
def test_announced_url(listen: str, expected: str) -> None:
    assert announced_url(listen, 5) == expected


def make(fleet: Fleet, peers: StatusPeers) -> StatusServer:
    def take() -> Status:
        return snapshot(fleet, HybridIndex(), FlowControl[str](), PolicyStore(), [], 5.0, 1_700_000_000.0)

    return StatusServer(CollectorRegistry(), take, asyncio.get_running_loop(), peers=peers)


@pytest.fixture
async def two(tmp_path: Path) -> AsyncIterator[tuple[Path, list[str]]]:
    """Workers w0 (fleet A, B; one stream open at A) and w1 (fleet A, B; B drained) sharing ``siblings``."""
    directory = tmp_path / "siblings"
    directory.mkdir(mode=0o700)
    fleets = [Fleet([A, B]), Fleet([A, B])]
    state = fleets[0].get(A.id)
    assert state is not None
    state.in_flight = 1
    fleets[1].set_state(B.id, draining=True)
    servers = [make(fleet, StatusPeers(directory, f"w{i}")) for i, fleet in enumerate(fleets)]
    bases = [f"http://127.0.0.1:{s.start('127.0.0.1:0')}" for s in servers]
    yield directory, bases
    for server in servers:
        await asyncio.to_thread(server.close)
    assert not list(directory.glob(f"*{SUFFIX}"))  # withdrawn


async def test_each_page_combines_the_hosts_workers(two: tuple[Path, list[str]]) -> None:
    directory, bases = two
    assert sorted(p.name for p in directory.glob(f"*{SUFFIX}")) == ["w0.status", "w1.status"]
    assert oct((directory / "w0.status").stat().st_mode & 0o777) == "0o600"
    code, _, body = await asyncio.to_thread(get, bases[0] + "/status")
    page = body.decode()
    assert code == 200 and "2/2 ext_procs combined" in page
    assert "w0 (this page)" in page and "<td>w1</td>" in page
    assert "disagree: endpoint sim-1: ready at w0 (this page), draining at w1" in page
    assert 'class="draining" id="endpoint-sim-1"' in page  # the worst state, in the combined fleet
    code, _, body = await asyncio.to_thread(get, bases[1] + "/status")
    assert code == 200 and "w1 (this page)" in body.decode()
    # the JSON stays each worker's own view
    _, _, raw = await asyncio.to_thread(get, bases[0] + "/status.json")
    own = {e.id: e for e in decode(raw).endpoints}
    assert own["sim-1"].state == "ready" and own["sim-0"].in_flight == 1


async def test_a_gone_worker_is_skipped_and_a_silent_one_shown(two: tuple[Path, list[str]]) -> None:
    directory, bases = two
    argv = [sys.executable, "-c", "import os; print(os.getpid())"]
    done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, timeout=60)
    gone = int(done.stdout)  # a process that has exited
    (directory / f"w9{SUFFIX}").write_text(json.dumps({"url": "http://127.0.0.1:1", "pid": gone}))
    with socket.socket() as sock:  # bound, not listening: refused
        sock.bind(("127.0.0.1", 0))
        silent = f"http://127.0.0.1:{sock.getsockname()[1]}"
        (directory / f"w8{SUFFIX}").write_text(json.dumps({"url": silent, "pid": os.getpid()}))
        (directory / f"junk{SUFFIX}").write_text("not json")
        peers = StatusPeers(directory, "w0")
        assert [name for name, _ in peers.siblings()] == ["w1", "w8"]
        code, _, body = await asyncio.to_thread(get, bases[0] + "/status")
    page = body.decode()
    assert code == 200 and "2/3 ext_procs combined" in page
    assert "w8" in page and "unreachable" in page and "w9" not in page
    for name in ("w8", "w9", "junk"):
        (directory / f"{name}{SUFFIX}").unlink()
