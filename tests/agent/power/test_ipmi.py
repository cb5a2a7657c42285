"""IPMI through ipmitool against OpenIPMI's ipmi_sim (a BMC speaking IPMI 2.0 RMCP+ on UDP): an SDR power
sensor whose reading the test changes, wrong credentials, an unknown sensor, a BMC that never answers and
one that answers garbage; and ipmitool's CSV parsed (in memory)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from agent.power.errors import PowerSourceError
from agent.power.ipmi import IpmiSource, parse_sdr
from agent.power.monitor import PowerMonitor
from contracts.events import Power
from tests.agent.power.servers import ipmi_sim, tool

PASSWORD_ENV = "KVGATE_TEST_IPMI_PASSWORD"
LINE = "Node Power,250,Watts,ok,10.1,Power Supply,Other,,,,,,,,,,0.000,2550.000"


@pytest.mark.parametrize(
    ("text", "watts"),
    [(LINE, 250.0), ("Other,1,Watts,ok\n" + LINE + "\n", 250.0), (LINE.replace(",250,", ",312.5,"), 312.5)],
)
def test_parse_sdr(text: str, watts: float) -> None:
    assert parse_sdr(text, "Node Power").watts == watts


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "no sensor 'Node Power'"),
        ("Node Power,na,Watts,ns,10.1", "no reading"),
        ("Node Power,41,degrees C,ok,10.1", "not Watts"),
        ("Node Power,lots,Watts,ok,10.1", "not a number"),
        ("Node Power,-5,Watts,ok,10.1", "not a plausible reading"),
        ("Node Power,nan,Watts,ok", "not a plausible reading"),
        ("Node Power,250", "short line"),
        ("\x00\x01\x02garbage", "no sensor"),
        (LINE + "\nInlet Temp,na,degrees C,ns", "'Inlet Temp' has no reading"),
        (LINE, "no sensor 'Inlet Temp'"),
    ],
)
def test_parse_refuses_garbage(text: str, match: str) -> None:
    temperature = "Inlet Temp" if "Inlet" in match else None
    with pytest.raises(PowerSourceError, match=match):
        parse_sdr(text, "Node Power", temperature)


def test_parse_a_temperature_line() -> None:
    text = LINE + "\nInlet Temp,33,degrees C,ok,7.1,System Board,Temperature,,,,,,,,,,0.000,255.000\n"
    sample = parse_sdr(text, "Node Power", "Inlet Temp")
    assert (sample.watts, sample.temperature_c) == (250.0, 33.0)


def source(port: int, sensor: str = "Node Power", **kwargs: Any) -> IpmiSource:
    return IpmiSource(
        "ipmi",
        "127.0.0.1",
        port=port,
        username="kvgate",
        password_env=PASSWORD_ENV,
        sensor=sensor,
        program=tool("ipmitool"),
        **kwargs,
    )


@pytest.fixture(autouse=True)
def password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, "s3cret-pw")


@pytest.fixture
def value_file(tmp_path: Path) -> Path:
    path = tmp_path / "node-power.raw"
    path.write_text("25\n")
    return path


@pytest.fixture
def bmc(tmp_path: Path, value_file: Path) -> Iterator[int]:
    with ipmi_sim(tmp_path, value_file) as port:
        yield port


async def read_until(monitor: PowerMonitor, wanted: float, timeout_s: float = 15.0) -> Power:
    """Read until the source gives ``wanted`` watts (ipmi_sim starting; its sensor polls its file)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reading = await monitor.read_once("ipmi")
        if reading.watts == wanted:
            return reading
        if time.monotonic() > deadline:
            raise AssertionError(f"never read {wanted} W; last: {reading}")
        await asyncio.sleep(0.05)


async def test_reads_the_power_sensor_as_it_changes(bmc: int, value_file: Path) -> None:
    monitor = PowerMonitor([(source(bmc), 1.0, 5.0)], wall=lambda: 3.0)
    first = await read_until(monitor, 250.0)
    assert (first.kind, first.error, first.at, first.limit_w) == ("ipmi", "", 3.0, None)
    await asyncio.to_thread(value_file.write_text, "37\n")
    await read_until(monitor, 370.0)


async def test_reads_a_temperature_sensor_in_the_same_call(bmc: int, value_file: Path) -> None:
    monitor = PowerMonitor([(source(bmc, temperature_sensor="Inlet Temp"), 1.0, 5.0)])
    first = await read_until(monitor, 250.0)
    assert first.temperature_c == 31.0
    await asyncio.to_thread(Path(str(value_file) + ".temp").write_text, "44\n")
    deadline = time.monotonic() + 15.0
    while (await monitor.read_once("ipmi")).temperature_c != 44.0:
        assert time.monotonic() < deadline, "the new temperature never showed"
        await asyncio.sleep(0.05)
    wrong = PowerMonitor([(source(bmc, temperature_sensor="Node Power"), 1.0, 5.0)])
    assert "reads 'Watts', not degrees C" in (await wrong.read_once("ipmi")).error


@pytest.mark.parametrize("interface", ["lanplus", "lan"])
async def test_wrong_credentials_are_a_reported_error(
    bmc: int, interface: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = PowerMonitor([(source(bmc, interface=interface), 1.0, 5.0)])
    await read_until(good, 250.0)
    monkeypatch.setenv(PASSWORD_ENV, "wrong-pw")
    bad = PowerMonitor([(source(bmc, interface=interface), 1.0, 5.0)])
    reading = await bad.read_once("ipmi")
    assert reading.watts is None and reading.error.startswith("ipmitool:") and "wrong-pw" not in reading.error
    monkeypatch.delenv(PASSWORD_ENV)
    assert f"{PASSWORD_ENV} is not set" in (await bad.read_once("ipmi")).error


async def test_an_unknown_sensor_is_a_reported_error(bmc: int) -> None:
    monitor = PowerMonitor([(source(bmc), 1.0, 5.0)])
    await read_until(monitor, 250.0)
    other = PowerMonitor([(source(bmc, sensor="PSU2 Power"), 1.0, 5.0)])
    assert "no sensor 'PSU2 Power'" in (await other.read_once("ipmi")).error


@asynccontextmanager
async def udp_bmc(answer: bytes | None) -> AsyncIterator[int]:
    """A UDP endpoint on 127.0.0.1 that never answers (``None``) or answers every datagram with
    ``answer``; yields its port."""

    class Protocol(asyncio.DatagramProtocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            if answer is not None:
                assert isinstance(self.transport, asyncio.DatagramTransport)
                self.transport.sendto(answer, addr)

    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(Protocol, local_addr=("127.0.0.1", 0))
    try:
        yield int(transport.get_extra_info("sockname")[1])
    finally:
        transport.close()


async def test_a_bmc_that_never_answers_is_cut_off() -> None:
    async with udp_bmc(None) as port:
        monitor = PowerMonitor([(source(port), 1.0, 0.5)])
        started = time.monotonic()
        reading = await monitor.read_once("ipmi")
        assert reading.watts is None and reading.error == "no answer within 0.5 s"
        assert time.monotonic() - started < 2.0  # ipmitool killed at the bound, not left to its retries


async def test_a_bmc_that_answers_garbage_is_a_reported_error() -> None:
    async with udp_bmc(b"\x06\x00\xff\x07garbage, not RMCP" * 4) as port:
        monitor = PowerMonitor([(source(port), 1.0, 10.0)])
        reading = await monitor.read_once("ipmi")
        assert reading.watts is None and reading.error.startswith("ipmitool:")
