"""DCGM: dcgm-exporter's text parsed (per-GPU sums, limits, throttling, GPU filter, garbage refused) and
read over HTTP from an endpoint that serves the exporter's format, a hung one, and garbage."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator

import pytest

from agent.power import dcgm
from agent.power.dcgm import MAX_BODY_BYTES, DcgmSource, parse_dcgm
from agent.power.errors import PowerSourceError
from agent.power.monitor import PowerMonitor
from agent.power.reading import Sample
from tests.agent.power.bmc import Exporter, exporter_server, silent_server

LABELS = (
    'device="nvidia{gpu}",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",'
    'DCGM_FI_DRIVER_VERSION="550.54.15"'
)


def exporter_text(
    watts: tuple[float, ...] = (312.5, 288.0),
    *,
    energy_mj: tuple[float, ...] | None = (9.1e9, 8.7e9),
    limits: tuple[float, ...] | None = None,
    reasons: tuple[int, ...] | None = None,
    temps: tuple[float, ...] = (61, 70),
    clocks: tuple[float, ...] = (1980, 1755),
) -> str:
    """dcgm-exporter's /metrics for len(watts) GPUs (its HELP/TYPE lines and labels, trimmed)."""

    def family(name: str, kind: str, help_: str, values: tuple[float, ...] | None) -> str:
        if values is None:
            return ""
        lines = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for gpu, value in enumerate(values):
            labels = f'gpu="{gpu}",UUID="GPU-{gpu:08d}-7c2e-4d84-a3b3-5d8f5e0c0a{gpu:02d}",'
            lines.append(f"{name}{{{labels}{LABELS.format(gpu=gpu)}}} {value}")
        return "\n".join(lines) + "\n"

    return (
        family("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", clocks)
        + family("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", temps)
        + family("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", watts)
        + family(
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
            "counter",
            "Total energy consumption since boot (in mJ).",
            energy_mj,
        )
        + family("DCGM_FI_DEV_POWER_MGMT_LIMIT", "gauge", "Power management limit (in W).", limits)
        + family(
            "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
            "gauge",
            "Current clock event reasons (bitmask).",
            None if reasons is None else tuple(float(r) for r in reasons),
        )
    )


def test_parse_sums_the_gpus() -> None:
    sample = parse_dcgm(exporter_text())
    assert sample.watts == pytest.approx(600.5)
    assert sample.energy_j == pytest.approx(17.8e6)
    assert sample.temperature_c == 70
    assert sample.sm_clock_mhz == pytest.approx((1980 + 1755) / 2)
    assert sample.limit_w is None and sample.throttled is None  # not in the exporter's default list


@pytest.mark.parametrize(
    ("reasons", "throttled"),
    [
        ((0x1, 0x0), False),  # idle, nothing
        ((0x1, 0x4), True),  # SW power cap on GPU 1
        ((0x40, 0x0), True),  # HW thermal slowdown
        ((0x10 | 0x2, 0x100), False),  # sync boost, application clocks, display clocks
    ],
)
def test_parse_throttle_reasons(reasons: tuple[int, int], throttled: bool) -> None:
    assert parse_dcgm(exporter_text(reasons=reasons)).throttled is throttled


def test_parse_limits_and_gpu_filter() -> None:
    text = exporter_text(limits=(350.0, 400.0))
    assert parse_dcgm(text).limit_w == 750.0
    only = parse_dcgm(text, frozenset({1}))
    assert (only.watts, only.limit_w, only.energy_j) == (288.0, 400.0, pytest.approx(8.7e6))
    with pytest.raises(PowerSourceError, match="for those GPUs"):
        parse_dcgm(text, frozenset({7}))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("this is { not prometheus", "not Prometheus text"),
        (
            '# TYPE DCGM_FI_DEV_GPU_TEMP gauge\nDCGM_FI_DEV_GPU_TEMP{gpu="0"} 55\n',
            "no DCGM_FI_DEV_POWER_USAGE",
        ),
        ('DCGM_FI_DEV_POWER_USAGE{gpu="0"} NaN\n', "not a plausible reading"),
        ('DCGM_FI_DEV_POWER_USAGE{gpu="0"} -12\n', "not a plausible reading"),
        ('DCGM_FI_DEV_POWER_USAGE{gpu="0"} 1e12\n', "not a plausible reading"),
        ("", "no DCGM_FI_DEV_POWER_USAGE"),
    ],
)
def test_parse_refuses_garbage(text: str, match: str) -> None:
    with pytest.raises(PowerSourceError, match=match):
        parse_dcgm(text)


@pytest.fixture
async def exporter() -> AsyncIterator[Exporter]:
    async with exporter_server(exporter_text()) as exp:
        yield exp


async def test_read_over_http_follows_the_exporter(exporter: Exporter) -> None:
    source = DcgmSource("dcgm", f"http://127.0.0.1:{exporter.port}/metrics")
    monitor = PowerMonitor([(source, 1.0, 2.0)], wall=lambda: 1000.0)
    try:
        first = await monitor.read_once("dcgm")
        assert (first.source, first.kind, first.watts, first.error, first.at) == (
            "dcgm",
            "dcgm",
            600.5,
            "",
            1000.0,
        )
        exporter.body = exporter_text(watts=(100.0, 50.0), reasons=(0x4, 0))
        second = await monitor.read_once("dcgm")
        assert (second.watts, second.throttled) == (150.0, True)
    finally:
        await monitor.aclose()


async def test_garbage_and_http_errors_are_reported_not_raised(exporter: Exporter) -> None:
    source = DcgmSource("dcgm", f"http://127.0.0.1:{exporter.port}/metrics")
    monitor = PowerMonitor([(source, 1.0, 2.0)])
    try:
        exporter.body = "\x00\x01 garbage {{{"
        bad = await monitor.read_once("dcgm")
        assert bad.watts is None and "not Prometheus text" in bad.error
        exporter.status = 503
        down = await monitor.read_once("dcgm")
        assert down.watts is None and "HTTP 503" in down.error
        exporter.status, exporter.body = 200, exporter_text()
        assert (await monitor.read_once("dcgm")).watts == 600.5
        state = monitor.states[0]
        assert (state.reads, state.failures, state.streak) == (3, 2, 0)
    finally:
        await monitor.aclose()


async def test_an_exporter_that_hangs_times_out() -> None:
    async with silent_server() as port:
        source = DcgmSource("dcgm", f"http://127.0.0.1:{port}/metrics")
        monitor = PowerMonitor([(source, 1.0, 0.3)])
        try:
            reading = await monitor.read_once("dcgm")
            assert reading.watts is None and reading.error == "no answer within 0.3 s"
            assert monitor.delay("dcgm") == 1.0
            await monitor.read_once("dcgm")
            assert monitor.delay("dcgm") == 2.0  # backing off while it fails
        finally:
            await monitor.aclose()


async def test_an_answer_over_the_bound_is_an_error_not_parsed(exporter: Exporter) -> None:
    """An exporter (or something else at its URL) answering more than MAX_BODY_BYTES: a reported error,
    the body neither read to its end nor parsed (a whole answer used to be read and parsed, however
    large); an answer under the bound still reads."""
    padding = "# " + "x" * 1000 + "\n"
    exporter.body = exporter_text() + padding * (MAX_BODY_BYTES // len(padding) + 1)
    source = DcgmSource("dcgm", f"http://127.0.0.1:{exporter.port}/metrics")
    monitor = PowerMonitor([(source, 1.0, 30.0)])
    try:
        big = await monitor.read_once("dcgm")
        assert big.watts is None and f"over {MAX_BODY_BYTES} bytes" in big.error
        exporter.body = exporter_text()
        assert (await monitor.read_once("dcgm")).watts == 600.5
    finally:
        await monitor.aclose()


async def test_the_answer_is_parsed_off_the_event_loop(
    exporter: Exporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parse (pure Python, ~0.25 ms a line on this machine) runs in a worker thread, not on the agent's
    event loop, so a large (bounded) answer does not stall the feed (it used to run on the loop)."""
    threads: list[threading.Thread] = []

    def parse(text: str, gpus: frozenset[int] | None = None) -> Sample:
        threads.append(threading.current_thread())
        return parse_dcgm(text, gpus)

    monkeypatch.setattr(dcgm, "parse_dcgm", parse)
    source = DcgmSource("dcgm", f"http://127.0.0.1:{exporter.port}/metrics")
    try:
        assert (await source.read()).watts == 600.5
    finally:
        await source.aclose()
    assert threads and threads[0] is not threading.main_thread()
