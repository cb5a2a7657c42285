"""End to end: ``kvgate status`` over two real ext_procs (``kvgate up --extprocs 2``: real Envoy balancing
its ext_proc streams over both workers, 2 simulated replicas). Each worker serves its own view; the
command reads both (found in the published ``stack.json``, or named with ``--url`` twice), shows each
one's summary and the combined tables, and its JSON's combined routing adds up both workers'."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.status.snapshot import decode
from kvgate.dev.up import Stack, StackOptions
from kvgate.status_cli import main as status_main
from tests.e2e.test_status import kvgate_status, publish

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a careful assistant for the kvgate workers' status test. " * 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        replicas=2,
        extprocs=2,
        port=0,
        sim_args=("--time-scale", "0.05"),
        workdir=tmp_path_factory.mktemp("status-workers"),
    )
    with Stack(options) as running:
        yield running


def urls(stack: Stack) -> list[str]:
    return [f"http://127.0.0.1:{ports['metrics']}" for ports in stack.extproc_listeners]


def routed_by(client: httpx.Client, url: str) -> float:
    """Requests the ext_proc at ``url`` routed lately, read through ``client`` (one for every read: a new
    client costs ~19 ms of CPU, its SSL context)."""
    status = decode(client.get(url + "/status.json").content)
    return sum(e.routed_recent for e in status.endpoints)


@pytest.fixture(scope="module")
def routed(stack: Stack) -> None:
    """Requests through Envoy until both workers have routed some (Envoy balances streams over them)."""
    assert len(stack.extproc_listeners) == 2
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        for sent in range(60):  # round robin: a few suffice; bounded, no sleeping
            resp = client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "max_tokens": 4,
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"q{sent}"},
                    ],
                },
            )
            assert resp.status_code == 200, resp.text
            if sent >= 3 and all(routed_by(client, url) > 0 for url in urls(stack)):
                return
    raise AssertionError("60 requests through Envoy, and one ext_proc routed none")


async def test_the_combined_json_adds_up_both_workers(
    stack: Stack, routed: None, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = urls(stack)
    argv = ["--url", a, "--url", b + "/status", "--json"]
    assert await asyncio.to_thread(status_main, argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(doc["gateways"]) == sorted([a, b]) and doc["failed"] == {}
    combined = {e["id"]: e for e in doc["combined"]["endpoints"]}
    assert sorted(combined) == sorted(e["id"] for e in stack.engines)
    for endpoint_id, endpoint in combined.items():
        each = [
            next(e for e in view["endpoints"] if e["id"] == endpoint_id) for view in doc["gateways"].values()
        ]
        assert endpoint["routed_recent"] == pytest.approx(sum(e["routed_recent"] for e in each))
        assert endpoint["in_flight"] == sum(e["in_flight"] for e in each)
    assert all(sum(e["routed_recent"] for e in view["endpoints"]) > 0 for view in doc["gateways"].values())
    assert sum(e["routed_share"] for e in combined.values()) == pytest.approx(1.0)


async def test_kvgate_status_combines_the_local_stacks_workers(
    stack: Stack, routed: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``--url``: every ext_proc the running ``kvgate up`` published; the command as users run it."""
    publish(stack, tmp_path, monkeypatch)
    lines = (await kvgate_status()).splitlines()
    assert lines[0] == "2/2 ext_procs combined"
    for url in urls(stack):
        row = next(line for line in lines if line.startswith(url + " "))
        assert row.split()[2] == "2/2"  # ready endpoints of known, as that worker sees them
    assert any(line.startswith("gateway 2/2 ext_procs combined at ") for line in lines)
    for engine in stack.engines:
        cells = next(line for line in lines if line.startswith(engine["id"] + " ")).split()
        assert cells[1:5] == [engine["address"], MODEL, "both", "ready"]
    each = await kvgate_status("--each")
    assert [line.split()[1] for line in each.splitlines() if line.startswith("gateway ")] == urls(stack)


async def test_an_unreachable_worker_is_shown_and_exits_1(
    stack: Stack, routed: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    assert await asyncio.to_thread(status_main, ["--url", urls(stack)[0], "--url", closed]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith("1/2 ext_procs combined\n") and "FLEET" in captured.out
    assert f"kvgate status: {closed}/status.json: unreachable" in captured.err


async def test_each_workers_page_shows_the_host_combined(stack: Stack, routed: None) -> None:
    """The workers share ``kvgate up``'s siblings directory, so each one's /status page reads the other's
    view and shows both and the combined fleet (extproc/status/peers.py); its JSON stays its own."""
    for i, url in enumerate(urls(stack)):
        async with httpx.AsyncClient(timeout=30) as client:
            page = (await client.get(url + "/status")).text
        assert "2/2 ext_procs combined" in page, page[:2000]
        assert f"extproc-{i} (this page)" in page and f"<td>extproc-{1 - i}</td>" in page
        for engine in stack.engines:
            assert f'id="endpoint-{engine["id"]}"' in page
