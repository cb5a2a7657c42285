"""End to end: the gateway's status (real Envoy, the ext_proc, 2 simulated replicas) as JSON, as
``kvgate status`` prints it, and as the HTML page, rendered by a real headless Chromium (Debian's
``chromium``, which ``./dev`` installs) whose screenshot must show the fleet's rows."""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
import subprocess
import sys
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.status.snapshot import Status, decode
from kvgate.dev.stackfile import STATE_DIR_ENV
from kvgate.dev.up import Stack, StackOptions
from kvgate.status_cli import main as status_main
from tests.polling import until

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
FAST_SIM = ("--time-scale", "0.05")
SYSTEM = "You are a careful assistant for the kvgate status test. " * 12  # several KV blocks
#: The page's background of a ready endpoint's row (extproc/status/render.py ``.ready``).
READY_RGB = (0xD9, 0xF2, 0xD9)
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        replicas=2, port=0, sim_args=FAST_SIM, workdir=tmp_path_factory.mktemp("status-stack")
    )
    with Stack(options) as running:
        yield running


def base(stack: Stack) -> str:
    return f"http://127.0.0.1:{stack.extproc_ports['metrics']}"


def fetch(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers["Content-Type"], response.read()


@pytest.fixture(scope="module")
def routed(stack: Stack) -> Status:
    """The stack after a few requests with a shared prefix went through Envoy: both endpoints ready,
    something routed and recorded in the index."""
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        for i in range(6):
            resp = client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "max_tokens": 4,
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"q{i}"}],
                },
            )
            assert resp.status_code == 200, resp.text
    seen: list[Status] = []

    def settled() -> bool:
        seen.append(decode(fetch(base(stack) + "/status.json")[2]))
        return seen[-1].index.blocks > 0 and all(e.state == "ready" for e in seen[-1].endpoints)

    asyncio.run(until(settled, 30))
    return seen[-1]


async def test_the_json_status_has_the_fleet_index_policy_and_queues(stack: Stack, routed: Status) -> None:
    status = routed
    assert {e.id: e.address for e in status.endpoints} == {e["id"]: e["address"] for e in stack.engines}
    assert status.models == (MODEL,)
    for e in status.endpoints:
        assert e.models == (MODEL,) and e.role == "both" and e.engine == "sim"
        assert e.state == "ready" and e.healthy and not e.draining and e.ejected_for_s == 0
        assert e.running is not None and e.waiting is not None  # scraped from the simulator
    assert sum(e.routed_share for e in status.endpoints) == pytest.approx(1.0)
    assert status.index.mode == "precise" and status.index.blocks == sum(
        e.index_blocks for e in status.endpoints
    )
    assert status.index.feeds == ()  # static endpoints: no agent feeds
    assert status.policy.values["weights/prefix"] == 3.0 and status.policy.overridden == ()
    assert status.queues == () and status.queued == 0


async def test_the_page_names_every_endpoint(stack: Stack, routed: Status) -> None:
    code, kind, body = await asyncio.to_thread(fetch, base(stack) + "/status")
    assert code == 200 and kind == "text/html; charset=utf-8"
    page = body.decode()
    for engine in stack.engines:
        assert f'id="endpoint-{engine["id"]}"' in page and engine["address"] in page
    assert "2/2 endpoints ready" in page


async def test_kvgate_status_prints_the_tables(
    stack: Stack, routed: Status, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await asyncio.to_thread(status_main, ["--url", base(stack)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"gateway {base(stack)} at ")
    for engine in stack.engines:
        row = next(line for line in out.splitlines() if line.startswith(engine["id"] + " ")).split()
        assert row[1:5] == [engine["address"], MODEL, "both", "ready"]
    assert "POLICY" in out and "QUEUES  0 held" in out
    assert await asyncio.to_thread(status_main, ["--url", base(stack) + "/metrics", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(e["id"] for e in doc["endpoints"]) == sorted(e["id"] for e in stack.engines)


def publish(stack: Stack, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``stack`` publishes its ``stack.json`` in ``state_dir``, where ``kvgate`` commands look
    (``KVGATE_STATE_DIR``)."""
    monkeypatch.setenv(STATE_DIR_ENV, str(state_dir))
    assert stack.publish() == state_dir / "stack.json"


async def kvgate_status(*args: str) -> str:
    """What ``kvgate status ARGS`` prints, run as users run it; it must exit 0."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "kvgate.cli", "status", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_kvgate_status_finds_the_local_stack(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``--url``: the running ``kvgate up``'s published ``stack.json``; the command as users run it."""
    publish(stack, tmp_path, monkeypatch)
    out = await kvgate_status()
    assert out.startswith(f"gateway {base(stack)} at ")
    assert all(engine["id"] in out for engine in stack.engines)


async def test_kvgate_status_refuses_what_is_not_a_status(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    """An address that answers something else (here: Envoy's listener) is an unusable gateway: exit 1."""
    assert await asyncio.to_thread(status_main, ["--url", stack.url]) == 1
    assert "kvgate status: " in capsys.readouterr().err


# -- the page in a real browser ---------------------------------------------------------------------------


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB(A) rows of an 8-bit, non-interlaced PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, chunk = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = chunk
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
    bpp = 3 if color == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    rows: list[bytes] = []
    prior = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prior[i], prior[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        prior = line
    return width, height, [bytes(r[i] for i in range(len(r)) if i % bpp < 3) for r in rows]


async def test_chromium_renders_the_fleet(stack: Stack, routed: Status, tmp_path: Path) -> None:
    chromium = shutil.which("chromium")
    assert chromium is not None, "Debian's chromium is needed (./dev setup installs it)"
    shot = tmp_path / "status.png"
    argv = [
        chromium,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}",
        "--window-size=1280,900",
        base(stack) + "/status",
    ]
    done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    await until(shot.exists, 5)
    data = shot.read_bytes()
    assert len(data) > 5_000  # a page with text and tables, not a blank image
    width, height, rows = png_pixels(data)
    assert (width, height) == (1280, 900)
    colours = {row[i : i + 3] for row in rows[::4] for i in range(0, len(row), 12)}
    assert len(colours) > 20, "a near-uniform screenshot"
    ready = bytes(READY_RGB)
    # each ready endpoint's row is a band of the ready colour: 2 bands, each a few pixel rows high
    banded = [y for y, row in enumerate(rows) if _share(row, ready) > 0.3]
    bands = sum(1 for i, y in enumerate(banded) if i == 0 or y != banded[i - 1] + 1)
    assert bands >= len(stack.engines), f"{bands} ready rows drawn, expected {len(stack.engines)}"


def _share(row: bytes, rgb: bytes) -> float:
    """The fraction of the pixels of ``row`` (RGB triples) in the colour ``rgb``."""
    pixels = len(row) // 3
    return sum(1 for i in range(0, len(row), 3) if row[i : i + 3] == rgb) / pixels
