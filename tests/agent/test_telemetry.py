"""Agent telemetry: engine load read from a real simulator replica's /metrics and from llama.cpp-shaped
/metrics + /slots, NVML through a fake ``pynvml`` module (two GPUs; absent; failing), and the loop that
turns them into Load events only when they change (plus heartbeats)."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.telemetry import EngineScraper, EngineStatus, GpuTelemetry, LoadChanges, TelemetryLoop, TokenRate
from contracts.events import Gpu, Load
from load.sim.engine import EngineConfig
from load.sim.server import SimConfig, SimFleet
from tests.load.test_sim_server import model_dir as model_dir  # the tiny tokenizer fixture
from tests.polling import until

MODEL = "tiny-chat"


async def eventually(cond: Callable[[], Any], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


@pytest.fixture
async def sim(model_dir: Path) -> AsyncIterator[SimFleet]:
    config = SimConfig(MODEL, model_dir, engine=EngineConfig(max_model_len=1024, num_blocks=256))
    fleet = SimFleet(config, 1)
    await fleet.start()
    yield fleet
    await fleet.aclose(drain_s=0)


async def test_scrape_a_real_simulator(sim: SimFleet) -> None:
    scraper = EngineScraper("sim", f"http://{sim.addresses[0]}/metrics")
    try:
        idle = await scraper.scrape()
        assert idle is not None and (idle.waiting, idle.running, idle.kv_usage) == (0, 0, 0)
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": "the quick brown fox " * 20, "max_tokens": 500}
            request = asyncio.create_task(http.post(f"http://{sim.addresses[0]}/v1/completions", json=body))
            try:

                async def busy() -> bool:
                    s = await scraper.scrape()
                    return s is not None and s.running == 1 and (s.kv_usage or 0) > 0

                await eventually(busy)
            finally:
                request.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await request
    finally:
        await scraper.aclose()


#: An idle simulator's prefix-cache counters, as its loads carry them.
IDLE = {"prefix_hits": 0.0, "prefix_queries": 0.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_unreachable_engine_reads_as_none() -> None:
    scraper = EngineScraper("vllm", f"http://127.0.0.1:{free_port()}/metrics", timeout_s=1.0)
    try:
        assert await scraper.scrape() is None
        assert "ClientConnectorError" in scraper.last_error
    finally:
        await scraper.aclose()


# What llama-server (build 11434, --metrics, -np 4) answers, trimmed: no KV-use gauge, slots with
# is_processing.
LLAMA_METRICS = """# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 3
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
llamacpp:n_busy_slots_per_decode 3
"""


def llama_slots(busy: int, total: int) -> list[dict[str, Any]]:
    return [{"id": i, "n_ctx": 512, "speculative": False, "is_processing": i < busy} for i in range(total)]


@pytest.fixture
async def llama() -> AsyncIterator[dict[str, Any]]:
    """A stand-in llama-server serving /metrics and /slots with the shapes above (mutable)."""
    state: dict[str, Any] = {"metrics": LLAMA_METRICS, "slots": llama_slots(3, 4), "slot_hits": 0}

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=state["metrics"])

    async def slots(request: web.Request) -> web.Response:
        state["slot_hits"] += 1
        if state["slots"] is None:
            return web.Response(status=501, text='{"error": "This server does not support slots"}')
        return web.json_response(state["slots"])

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/slots", slots)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    state["url"] = f"http://127.0.0.1:{port}/metrics"
    yield state
    await runner.cleanup()


async def test_llama_cpp_uses_slots_as_kv_usage(llama: dict[str, Any]) -> None:
    scraper = EngineScraper("llama_cpp", llama["url"])
    try:
        assert scraper.slots_url == llama["url"].replace("/metrics", "/slots")
        sample = await scraper.scrape()
        assert sample is not None and (sample.waiting, sample.running, sample.kv_usage) == (2, 3, 0.75)
        llama["slots"] = [{"id": 0, "state": 1}, {"id": 1, "state": 0}]  # older builds
        sample = await scraper.scrape()
        assert sample is not None and sample.kv_usage == 0.5
        llama["slots"] = None  # --no-slots
        sample = await scraper.scrape()
        assert sample is not None and sample.running == 3 and sample.kv_usage is None
        hits = llama["slot_hits"]
        llama["metrics"] = LLAMA_METRICS + "llamacpp:kv_cache_usage_ratio 0.25\n"  # older builds' gauge
        sample = await scraper.scrape()
        assert sample is not None and sample.kv_usage == 0.25 and llama["slot_hits"] == hits
    finally:
        await scraper.aclose()


async def test_an_engines_redirect_is_not_followed(llama: dict[str, Any]) -> None:
    """A (remote) engine answering 307 towards another server's metrics or slots does not get them read as
    its own: a redirected ``/metrics`` is a failed scrape; a redirected ``/slots``, no KV reading."""

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(llama["url"].replace("/metrics", request.path))

    app = web.Application()
    app.add_routes([web.get("/metrics", moved), web.get("/slots", moved)])
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    redirected = EngineScraper("vllm", f"http://127.0.0.1:{port}/metrics")
    slots_moved = EngineScraper("llama_cpp", llama["url"], slots_url=f"http://127.0.0.1:{port}/slots")
    try:
        assert await redirected.scrape() is None and "307" in redirected.last_error
        sample = await slots_moved.scrape()
        assert sample is not None and sample.kv_usage is None and llama["slot_hits"] == 0
    finally:
        await redirected.aclose()
        await slots_moved.aclose()
        await runner.cleanup()


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("path", ["/metrics", "/slots"])
async def test_an_answer_over_the_bound_is_a_failed_reading_not_read_whole(path: str, chunked: bool) -> None:
    """An engine (or whatever listens on its port) answering ``/metrics`` or llama.cpp's ``/slots`` with
    more than :data:`engines.metrics.MAX_METRICS_BYTES` (announced, or streamed without a length): a failed
    scrape, or no KV reading from ``/slots``; the agent never holds the endless answer in memory (the
    gateway's scrapes have the same bound)."""
    from engines.metrics import MAX_METRICS_BYTES

    if path == "/metrics":  # comments after the real metrics
        head, line, tail = LLAMA_METRICS.encode(), b"# " + b"x" * 1022 + b"\n", b""
    else:  # valid JSON: every slot busy, so a reading read whole would say 1.0
        head, line, tail = b"[", b'{"id": 0, "is_processing": true}, ' * 30, b'{"id": 0}]'
    n = MAX_METRICS_BYTES // len(line) + 2

    async def endless(request: web.Request) -> web.StreamResponse:
        if not chunked:
            return web.Response(body=head + line * n + tail, content_type="text/plain")
        response = web.StreamResponse(headers={"content-type": "text/plain"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(head)
        for _ in range(n):
            await response.write(line)
        await response.write(tail)
        await response.write_eof()
        return response

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=LLAMA_METRICS)

    app = web.Application()
    app.add_routes([web.get(path, endless)])
    if path == "/slots":  # the metrics themselves are fine
        app.add_routes([web.get("/metrics", metrics)])
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    scraper = EngineScraper("llama_cpp", f"http://127.0.0.1:{port}/metrics", timeout_s=10.0)
    try:
        sample = await scraper.scrape()
        if path == "/metrics":
            assert sample is None and "ClientPayloadError" in scraper.last_error
        else:
            assert sample is not None and sample.running == 3 and sample.kv_usage is None
    finally:
        await scraper.aclose()
        await runner.cleanup()


# --- NVML -------------------------------------------------------------------------------------------


class FakeNVMLError(Exception):
    pass


def fake_pynvml(gpus: list[dict[str, Any]], *, init_error: str | None = None) -> types.ModuleType:
    """A stand-in for nvidia-ml-py's ``pynvml`` with the functions GpuTelemetry calls. Each GPU is a dict
    of raw NVML answers (mW, MHz, C, bytes, percent); a missing key raises NVMLError (not supported)."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
    nv.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]
    nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM = 1, 2  # type: ignore[attr-defined]
    calls = {"init": 0, "shutdown": 0}
    nv.calls = calls  # type: ignore[attr-defined]

    def get(handle: int, key: str) -> Any:
        if key not in gpus[handle]:
            raise FakeNVMLError("Not Supported")
        return gpus[handle][key]

    def init() -> None:
        calls["init"] += 1
        if init_error is not None:
            raise FakeNVMLError(init_error)

    def shutdown() -> None:
        calls["shutdown"] += 1

    def memory_info(handle: int) -> Any:
        return types.SimpleNamespace(used=get(handle, "used"), total=get(handle, "total"))

    functions: dict[str, Callable[..., Any]] = {
        "nvmlInit": init,
        "nvmlShutdown": shutdown,
        "nvmlDeviceGetCount": lambda: len(gpus),
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: get(h, "name"),
        "nvmlDeviceGetPowerUsage": lambda h: get(h, "power_mw"),
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: get(h, "limit_mw"),
        "nvmlDeviceGetTemperatureV": lambda h, sensor: get(h, "temp_c"),
        "nvmlDeviceGetTemperature": lambda h, sensor: get(h, "temp_c"),
        "nvmlDeviceGetMemoryInfo": memory_info,
        "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=get(h, "util_pct"), memory=0),
        "nvmlDeviceGetClockInfo": lambda h, clock: get(h, "sm_mhz" if clock == 1 else "mem_mhz"),
        "nvmlDeviceGetCurrentClocksEventReasons": lambda h: get(h, "reasons"),
        "nvmlDeviceGetTotalEnergyConsumption": lambda h: get(h, "energy_mj"),
    }
    for name, fn in functions.items():
        setattr(nv, name, fn)
    return nv


H100 = {
    "name": "NVIDIA H100 80GB HBM3",
    "power_mw": 312_500,
    "limit_mw": 700_000,
    "temp_c": 54,
    "used": 60 * 2**30,
    "total": 80 * 2**30,
    "util_pct": 87,
    "sm_mhz": 1980,
    "mem_mhz": 2619,
    "reasons": 0x4,  # SW power cap
    "energy_mj": 7_200_000_123,  # two hours at 1 kW since the driver loaded
}


def test_nvml_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    second = {k: v for k, v in H100.items() if k not in ("power_mw", "limit_mw", "reasons", "energy_mj")} | {
        "name": b"Tesla T4"
    }
    nv = fake_pynvml([H100, second])
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    gpus = GpuTelemetry()
    first = gpus.read()
    assert first == [
        Gpu(
            index=0,
            name="NVIDIA H100 80GB HBM3",
            power_w=312.5,
            power_limit_w=700.0,
            sm_clock_mhz=1980.0,
            mem_clock_mhz=2619.0,
            temperature_c=54.0,
            memory_used_bytes=60 * 2**30,
            memory_total_bytes=80 * 2**30,
            utilization=0.87,
            throttle_reasons=0x4,
            energy_mj=7_200_000_123,
        ),
        Gpu(
            index=1,
            name="Tesla T4",  # bytes from old bindings are decoded
            power_w=None,  # not supported by this board: None, not an error
            power_limit_w=None,
            sm_clock_mhz=1980.0,
            mem_clock_mhz=2619.0,
            temperature_c=54.0,
            memory_used_bytes=60 * 2**30,
            memory_total_bytes=80 * 2**30,
            utilization=0.87,
        ),
    ]
    H100_hot = dict(H100, temp_c=80)
    nv.nvmlDeviceGetTemperatureV = lambda h, sensor: H100_hot["temp_c"]  # type: ignore[attr-defined]
    assert [g.temperature_c for g in gpus.read()] == [80.0, 80.0]
    assert nv.calls["init"] == 1  # type: ignore[attr-defined]  # nvmlInit once
    gpus.close()
    assert nv.calls["shutdown"] == 1 and gpus.read() == []  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (None, "nvidia-ml-py is not importable"),  # the package is missing
        (fake_pynvml([], init_error="Driver Not Loaded"), "Driver Not Loaded"),
        (fake_pynvml([]), "no GPU found"),
    ],
)
def test_nvml_unavailable_is_logged_once_and_reads_empty(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, module: Any, reason: str
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", module)
    gpus = GpuTelemetry()
    with caplog.at_level(logging.INFO, logger="agent.telemetry"):
        assert gpus.read() == [] and gpus.read() == [] and gpus.disabled
    lines = [r.getMessage() for r in caplog.records if "GPU telemetry" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("no GPU telemetry: ") and reason in lines[0]
    if module is not None:
        assert module.calls["init"] == 1


# --- change detection and the loop --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("second", "at", "sent"),
    [
        (Load("e1", 1, 2, 0.5), 0.5, False),  # same, heartbeat not due
        (Load("e1", 1, 2, 0.5), 1.0, True),  # heartbeat due
        (Load("e1", 1, 3, 0.5), 0.1, True),  # running changed
        (Load("e1", 1, 2, 0.6), 0.1, True),
        (Load("e1", 1, 2, 0.5, healthy=False), 0.1, True),
        (Load("e1", 1, 2, 0.5, draining=True), 0.1, True),
        (Load("e1", 1, 2, 0.5, gpus=[Gpu(0, "x", power_w=300.0)]), 0.1, False),  # telemetry rides along
        (Load("e2", 1, 2, 0.5), 0.1, True),  # another endpoint
    ],
)
def test_load_changes(second: Load, at: float, sent: bool) -> None:
    changes = LoadChanges(heartbeat_s=1.0)
    assert changes.offer(Load("e1", 1, 2, 0.5), 0.0)
    assert changes.offer(second, at) is sent


async def test_loop_emits_changes_heartbeats_and_unhealthy(
    llama: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([H100, H100]))
    now = [0.0]
    emitted: list[list[Load]] = []
    status = EngineStatus(healthy=True)
    loop = TelemetryLoop(
        0.1, emitted.append, heartbeat_s=5.0, gpus=GpuTelemetry(), unhealthy_after=3, clock=lambda: now[0]
    )
    loop.watch("llama-0", EngineScraper("llama_cpp", llama["url"]), status=lambda: status, gpus=[1])
    dead = EngineScraper("vllm", f"http://127.0.0.1:{free_port()}/metrics")
    loop.watch("vllm-0", dead)
    try:
        first = await loop.tick()
        assert [(ld.endpoint, ld.waiting, ld.running, ld.kv_usage) for ld in first] == [
            ("llama-0", 2, 3, 0.75)
        ]
        assert [g.index for g in first[0].gpus] == [1] and emitted == [first]
        assert await loop.tick() == []  # nothing changed; vllm-0 failed twice (< unhealthy_after)
        now[0] = 1.0
        second = await loop.tick()  # vllm-0 failed three times: reported unhealthy
        assert [(ld.endpoint, ld.waiting, ld.running, ld.kv_usage, ld.healthy) for ld in second] == [
            ("vllm-0", 0, 0, None, False)
        ]
        assert [g.index for g in second[0].gpus] == [0, 1]  # no gpus= given: all of the node's
        llama["slots"] = llama_slots(1, 4)
        status = EngineStatus(healthy=True, draining=True)
        third = await loop.tick()
        assert [(ld.endpoint, ld.kv_usage, ld.draining) for ld in third] == [("llama-0", 0.25, True)]
        now[0] = 6.5
        assert {ld.endpoint for ld in await loop.tick()} == {"llama-0", "vllm-0"}  # heartbeats
    finally:
        await loop.aclose()


async def test_loop_runs_until_closed(sim: SimFleet) -> None:
    emitted: list[list[Load]] = []
    loop = TelemetryLoop(0.02, emitted.append, heartbeat_s=0.05)
    loop.watch("sim-0", EngineScraper("sim", f"http://{sim.addresses[0]}/metrics"))
    loop.start()
    try:

        async def heartbeats() -> bool:
            return len(emitted) >= 2

        await eventually(heartbeats)
        # output_tps: 0.0 once a 1 s window has passed (an idle engine), None before
        assert all(
            batch in ([Load("sim-0", 0, 0, 0.0, **IDLE)], [Load("sim-0", 0, 0, 0.0, output_tps=0.0, **IDLE)])
            for batch in emitted
        )
    finally:
        await loop.aclose()


async def test_a_hung_engine_does_not_hold_back_the_other_engines_loads(sim: SimFleet) -> None:
    """An engine that accepts and never answers (a stopped process; its reading times out after 2 s)
    beside a live one: the live one's loads still go out every round (heartbeat 0.05 s), and the hung
    one is reported unhealthy once its readings time out. (One wait for every reading stretched each
    round to 2 s: one load of the live engine per 2 s.)"""
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    hung = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = int(hung.sockets[0].getsockname()[1])
    emitted: list[list[Load]] = []
    loop = TelemetryLoop(0.02, emitted.append, heartbeat_s=0.05, unhealthy_after=1)
    loop.watch("sim-0", EngineScraper("sim", f"http://{sim.addresses[0]}/metrics"))
    loop.watch("hung-0", EngineScraper("vllm", f"http://127.0.0.1:{port}/metrics", timeout_s=2.0))
    loop.start()
    try:
        await until(lambda: sum(ld.endpoint == "sim-0" for b in emitted for ld in b) >= 10, 1.5)
        assert all(ld.endpoint == "sim-0" for b in emitted for ld in b)  # hung-0: still being read
        await until(lambda: any(ld.endpoint == "hung-0" and not ld.healthy for b in emitted for ld in b), 3)
    finally:
        await loop.aclose()
        for writer in held:
            writer.close()
        hung.close()
        await hung.wait_closed()


async def test_power_rides_along_and_a_hung_source_never_delays_loads(sim: SimFleet) -> None:
    """Every Load carries the node's power readings (a DCGM exporter here); a power source that hangs
    (a socket that never answers) holds back neither the loads nor the other source."""
    from agent.power.dcgm import DcgmSource
    from agent.power.monitor import PowerMonitor
    from tests.agent.power.bmc import exporter_server, silent_server
    from tests.agent.power.test_dcgm import exporter_text

    async with exporter_server(exporter_text()) as exporter, silent_server() as hung_port:
        monitor = PowerMonitor(
            [
                (DcgmSource("dcgm", f"http://127.0.0.1:{exporter.port}/metrics"), 0.05, 1.0),
                (DcgmSource("stuck", f"http://127.0.0.1:{hung_port}/metrics"), 0.05, 5.0),
            ]
        )
        emitted: list[list[Load]] = []
        loop = TelemetryLoop(0.02, emitted.append, heartbeat_s=0.05, power=monitor.readings)
        loop.watch("sim-0", EngineScraper("sim", f"http://{sim.addresses[0]}/metrics"))
        monitor.start()
        loop.start()
        try:
            await until(lambda: any(p.watts == 600.5 for b in emitted for ld in b for p in ld.power), 3.0)
            exporter.body = exporter_text(watts=(10.0, 20.0))
            await until(lambda: [p.watts for p in emitted[-1][0].power if p.source == "dcgm"] == [30.0], 3.0)
            loads = sum(len(b) for b in emitted)
            await until(lambda: sum(len(b) for b in emitted) >= loads + 5, 1.0)  # the stuck source waits
            assert all(p.source == "dcgm" for b in emitted for ld in b for p in ld.power)  # not read yet
        finally:
            await loop.aclose()
            await monitor.aclose()


def test_token_rate_over_windows() -> None:
    rate = TokenRate(window_s=1.0)
    assert rate.observe(100.0, 0.0) is None  # the window starts
    assert rate.observe(150.0, 0.5) is None  # too short to say
    assert rate.observe(400.0, 1.25) == 240.0  # 300 tokens in 1.25 s
    assert rate.observe(10.0, 2.0) == 240.0  # the counter went down: a restart, the old rate stays
    assert rate.observe(60.0, 3.0) == 50.0
    assert rate.observe(None, 4.0) is None  # no counter any more


async def test_output_tokens_per_second_from_a_real_simulator(sim: SimFleet) -> None:
    """The simulator's vllm:generation_tokens_total, read by the loop, becomes the load's output_tps."""
    now = [0.0]
    emitted: list[list[Load]] = []
    loop = TelemetryLoop(0.1, emitted.append, heartbeat_s=0.01, clock=lambda: now[0])
    loop.watch("sim-0", EngineScraper("sim", f"http://{sim.addresses[0]}/metrics"))
    try:
        assert (await loop.tick())[0].output_tps is None
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 7}
            async with http.post(f"http://{sim.addresses[0]}/v1/completions", json=body) as resp:
                assert resp.status == 200
        now[0] = 2.0
        assert (await loop.tick())[0].output_tps == 3.5  # 7 tokens over 2 s of the loop's clock
    finally:
        await loop.aclose()


async def test_prefix_cache_counters_ride_along_from_a_real_simulator(sim: SimFleet) -> None:
    """The simulator's vllm:prefix_cache_hits_total / _queries_total reach the load (for the gateway's drift
    alarm), and a second request with the same prompt counts hits; the counters alone trigger no send."""
    now = [0.0]
    emitted: list[list[Load]] = []
    loop = TelemetryLoop(0.1, emitted.append, heartbeat_s=10.0, clock=lambda: now[0])
    loop.watch("sim-0", EngineScraper("sim", f"http://{sim.addresses[0]}/metrics"))
    try:
        (first,) = await loop.tick()
        assert (first.prefix_hits, first.prefix_queries) == (0.0, 0.0)
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": "the quick brown fox jumps " * 12, "max_tokens": 1}
            for _ in range(2):
                async with http.post(f"http://{sim.addresses[0]}/v1/completions", json=body) as resp:
                    assert resp.status == 200
        assert await loop.tick() == []  # waiting and running unchanged: nothing to send before the heartbeat
        now[0] = 10.0
        (load,) = await loop.tick()
    finally:
        await loop.aclose()
    assert load.prefix_queries is not None and load.prefix_hits is not None
    assert load.prefix_queries > 0 and 0 < load.prefix_hits < load.prefix_queries


def test_nvml_without_the_energy_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A binding without ``nvmlDeviceGetTotalEnergyConsumption`` (or a GPU before Volta: Not Supported)
    reads everything else, with no energy."""
    nv = fake_pynvml([H100, {k: v for k, v in H100.items() if k != "energy_mj"}])
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    gpus = GpuTelemetry()
    assert [g.energy_mj for g in gpus.read()] == [H100["energy_mj"], None]
    del nv.nvmlDeviceGetTotalEnergyConsumption  # type: ignore[attr-defined]
    assert [(g.power_w, g.energy_mj) for g in gpus.read()] == [(312.5, None), (312.5, None)]
    gpus.close()


async def test_a_hung_nvml_does_not_stop_the_feed(sim: SimFleet, caplog: pytest.LogCaptureFixture) -> None:
    """NVML that never answers: each round waits for it at most ``gpu_timeout_s`` and sends the loads
    without GPU readings (the round used to wait for NVML for ever: no load went out); the read is not
    started again while it hangs (one thread, not one per round), and its readings ride along again once
    it answers."""
    release = threading.Event()
    calls: list[int] = []

    class HungGpus(GpuTelemetry):
        def read(self) -> list[Gpu]:
            calls.append(1)
            release.wait()
            return [Gpu(0, "x", power_w=300.0)]

    now = [0.0]
    loop = TelemetryLoop(
        0.1, lambda _: None, heartbeat_s=0.01, gpus=HungGpus(), gpu_timeout_s=0.2, clock=lambda: now[0]
    )
    loop.watch("sim-0", EngineScraper("sim", f"http://{sim.addresses[0]}/metrics"))
    try:
        for _ in range(3):
            now[0] += 1.0
            (load,) = await loop.tick(5.0)
            assert load.gpus == []
        assert len(calls) == 1 and loop.gpu_late == 3
        assert sum("NVML did not answer" in r.message for r in caplog.records) == 1  # once per run
        release.set()
        loop.gpu_timeout_s = 5.0  # the answer is on its way: no race with the bound
        now[0] += 1.0
        (load,) = await loop.tick(5.0)
        assert [g.power_w for g in load.gpus] == [300.0] and loop.gpu_late == 0
    finally:
        release.set()
        await loop.aclose()


async def test_one_engines_bad_metrics_do_not_stop_the_others_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Metrics that are not UTF-8 are read with the bad bytes replaced; a reading that fails in any other
    way is that engine's failed scrape: the node's other engines are reported every round."""

    async def bad(request: web.Request) -> web.Response:
        body = b"vllm:num_requests_running 1\n\xff\xfe\xfa\n"
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def good(request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 2\nvllm:num_requests_waiting 0\n")

    app = web.Application()
    app.router.add_get("/bad", bad)
    app.router.add_get("/good", good)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    ticks = iter(range(100))  # one clock read per round, a second apart: every load is due again
    loop = TelemetryLoop(
        0.1, lambda loads: None, heartbeat_s=0.5, unhealthy_after=2, clock=lambda: next(ticks)
    )
    broken = EngineScraper("vllm", f"{base}/good")

    async def fails() -> None:
        raise RuntimeError("a scraper bug")

    monkeypatch.setattr(broken, "scrape", fails)
    loop.watch("good", EngineScraper("vllm", f"{base}/good"))
    loop.watch("bad-bytes", EngineScraper("vllm", f"{base}/bad"))
    loop.watch("broken", broken)
    try:
        rounds = [{ld.endpoint: (ld.running, ld.healthy) for ld in await loop.tick(5.0)} for _ in range(2)]
        assert rounds[0] == {"good": (2, True), "bad-bytes": (1, True)}
        assert rounds[1] == {"good": (2, True), "bad-bytes": (1, True), "broken": (0, False)}
        assert broken.last_error == "RuntimeError"
    finally:
        await loop.aclose()
        await runner.cleanup()
