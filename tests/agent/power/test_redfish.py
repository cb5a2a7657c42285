"""Redfish through sushy against real Redfish servers: readings from ``sushy-static`` serving the mockup
in tests/data/redfish (the tests change its readings), credentials against ``sushy-emulator``'s basic
auth, TLS verification against a certificate of the dev CA, a BMC that hangs, and garbage answers."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.power.errors import PowerSourceError
from agent.power.monitor import PowerMonitor
from agent.power.redfish import JOULES_PER_KWH, RedfishSource, chassis_links, parse_chassis
from certs.store import dev_bundle
from tests.agent.power.bmc import silent_server
from tests.agent.power.servers import sushy_emulator, sushy_static

MOCKUP = Path(__file__).parents[2] / "data" / "redfish" / "mockup"
PASSWORD_ENV = "KVGATE_TEST_BMC_PASSWORD"


@pytest.fixture
def mockup(tmp_path: Path) -> Path:
    copy = tmp_path / "mockup"
    shutil.copytree(MOCKUP, copy)
    return copy


def edit(mockup: Path, resource: str, change: dict[str, Any] | None = None, drop: str | None = None) -> None:
    """Change one resource of the served mockup (sushy-static reads the file on every request)."""
    path = mockup / resource / "index.json"
    doc = json.loads(path.read_text())
    doc.update(change or {})
    if drop is not None:
        del doc[drop]
    path.write_text(json.dumps(doc))


def source(url: str, timeout_s: float = 5.0, **kwargs: Any) -> RedfishSource:
    return RedfishSource(
        "bmc", url, username="kvgate", password_env=PASSWORD_ENV, timeout_s=timeout_s, **kwargs
    )


@pytest.fixture(autouse=True)
def password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, "s3cret-pw")


def test_parse_prefers_sensor_then_environment_then_power_control() -> None:
    power = {"PowerControl": [{"PowerConsumedWatts": 344, "PowerLimit": {"LimitInWatts": 500}}]}
    thermal = {"Temperatures": [{"ReadingCelsius": 41}, {"ReadingCelsius": 67}, {"Name": "absent"}]}
    env = {
        "PowerWatts": {"Reading": 352.5},
        "EnergykWh": {"Reading": 2.0},
        "PowerLimitWatts": {"SetPoint": 450},
    }
    sensor = {"Id": "NodePower", "ReadingType": "Power", "Reading": 360.0, "ReadingUnits": "W"}
    assert parse_chassis(power=power, thermal=thermal).watts == 344
    only_power = parse_chassis(power=power, thermal=thermal)
    assert (only_power.limit_w, only_power.temperature_c, only_power.energy_j) == (500, 67, None)
    both = parse_chassis(power=power, thermal=thermal, environment=env)
    assert (both.watts, both.limit_w, both.energy_j, both.temperature_c) == (
        352.5,
        450,
        2 * JOULES_PER_KWH,
        67,
    )
    assert parse_chassis(power=power, environment=env, sensor=sensor).watts == 360.0


@pytest.mark.parametrize(
    ("docs", "match"),
    [
        ({"power": {"PowerControl": [{"PowerConsumedWatts": "lots"}]}}, "expected a number"),
        ({"power": {"PowerControl": [{"PowerConsumedWatts": -3}]}}, "not a plausible reading"),
        ({"power": {"PowerControl": [{"PowerConsumedWatts": True}]}}, "expected a number"),
        ({"power": {"PowerControl": []}}, "no power or temperature"),
        ({"power": ["not", "an", "object"]}, "not a JSON object"),
        ({"environment": {"PowerWatts": {"Reading": float("nan")}}}, "not a plausible reading"),
        (
            {"sensor": {"Id": "Fan1", "ReadingType": "Rotational", "Reading": 9000, "ReadingUnits": "RPM"}},
            "not power",
        ),
        ({}, "no power or temperature"),
    ],
)
def test_parse_refuses_garbage(docs: dict[str, Any], match: str) -> None:
    with pytest.raises(PowerSourceError, match=match):
        parse_chassis(**docs)


def test_chassis_links() -> None:
    doc = json.loads((MOCKUP / "Chassis" / "1U" / "index.json").read_text())
    links = chassis_links(doc)
    assert links.power == "/redfish/v1/Chassis/1U/Power"
    assert links.environment == "/redfish/v1/Chassis/1U/EnvironmentMetrics"
    assert links.sensors == "/redfish/v1/Chassis/1U/Sensors"


async def test_readings_follow_the_mockup(mockup: Path, tmp_path: Path) -> None:
    with sushy_static(mockup, tmp_path) as port:
        monitor = PowerMonitor([(source(f"http://127.0.0.1:{port}"), 1.0, 5.0)], wall=lambda: 7.0)
        try:
            first = await monitor.read_once("bmc")
            assert first.error == "" and (first.kind, first.at) == ("redfish", 7.0)
            assert (first.watts, first.limit_w, first.temperature_c) == (352.5, 500, 39)
            assert first.energy_j == pytest.approx(1234.5 * JOULES_PER_KWH)
            edit(mockup, "Chassis/1U/EnvironmentMetrics", {"PowerWatts": {"Reading": 611.0}})
            assert (await monitor.read_once("bmc")).watts == 611.0
            # A BMC without EnvironmentMetrics: PowerControl and Thermal
            edit(mockup, "Chassis/1U", drop="EnvironmentMetrics")
            older = await monitor.read_once("bmc")
            assert (older.watts, older.limit_w, older.temperature_c, older.energy_j) == (344, 500, 67, None)
            # garbage where a reading should be: a reported error, then back
            (mockup / "Chassis/1U/Power/index.json").write_text("<html>502 Bad Gateway</html>")
            bad = await monitor.read_once("bmc")
            assert bad.watts is None and "not a Redfish JSON answer" in bad.error
            edit(mockup, "Chassis/1U/Thermal", {"Temperatures": [{"ReadingCelsius": 1e9}]})
            shutil.copy(MOCKUP / "Chassis/1U/Power/index.json", mockup / "Chassis/1U/Power/index.json")
            assert "not a plausible reading" in (await monitor.read_once("bmc")).error
            shutil.copy(MOCKUP / "Chassis/1U/Thermal/index.json", mockup / "Chassis/1U/Thermal/index.json")
            assert (await monitor.read_once("bmc")).watts == 344
        finally:
            await monitor.aclose()


async def test_a_named_power_sensor_and_chassis(mockup: Path, tmp_path: Path) -> None:
    with sushy_static(mockup, tmp_path) as port:
        bmc = source(f"http://127.0.0.1:{port}", chassis="1U", sensor="NodePower", auth="basic")
        try:
            assert (await bmc.read()).watts == 360.0
            edit(mockup, "Chassis/1U/Sensors/NodePower", {"Reading": 402.0})
            assert (await bmc.read()).watts == 402.0
        finally:
            await bmc.aclose()
        missing = source(f"http://127.0.0.1:{port}", chassis="2U")
        try:
            with pytest.raises(PowerSourceError, match="ResourceNotFoundError"):
                await missing.read()
        finally:
            await missing.aclose()


@pytest.fixture(scope="module")
def bmc_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    files = dev_bundle(tmp_path_factory.mktemp("pki"), ["engine-bmc"], dt.datetime.now(dt.UTC))["engine-bmc"]
    return files.cert, files.key, files.ca


async def test_tls_is_verified_by_default(
    mockup: Path, tmp_path: Path, bmc_cert: tuple[Path, Path, Path]
) -> None:
    cert, key, ca = bmc_cert
    with sushy_static(mockup, tmp_path, cert=cert, key=key) as port:
        strict = source(f"https://127.0.0.1:{port}")
        try:
            with pytest.raises(
                PowerSourceError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"
            ):
                await strict.read()
        finally:
            await strict.aclose()
        trusting = source(f"https://127.0.0.1:{port}", verify=str(ca))
        try:
            assert (await trusting.read()).watts == 352.5
        finally:
            await trusting.aclose()


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    with sushy_emulator(tmp_path_factory.mktemp("emulator"), {"kvgate": "s3cret-pw"}) as port:
        yield port


@pytest.mark.parametrize("auth", ["basic", "auto"])
async def test_credentials_against_the_emulator(
    emulator: int, auth: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sushy-emulator serves Chassis and Thermal (no Power resource) behind basic auth: the right
    password reads its temperature, a wrong one is a reported error that never shows the password."""
    good = source(f"http://127.0.0.1:{emulator}", auth=auth)
    try:
        sample = await good.read()
        assert sample.watts is None and sample.temperature_c is not None
    finally:
        await good.aclose()
    monkeypatch.setenv(PASSWORD_ENV, "wrong-pw")
    bad = source(f"http://127.0.0.1:{emulator}", auth=auth)
    monitor = PowerMonitor([(bad, 1.0, 5.0)])
    try:
        reading = await monitor.read_once("bmc")
        assert reading.watts is None and "access refused" in reading.error and "401" in reading.error
        assert "wrong-pw" not in reading.error
    finally:
        await monitor.aclose()
    monkeypatch.delenv(PASSWORD_ENV)
    unset = source(f"http://127.0.0.1:{emulator}", auth=auth)
    with pytest.raises(PowerSourceError, match=f"{PASSWORD_ENV} is not set"):
        await unset.read()


async def test_a_bmc_that_hangs_is_reported_and_not_read_twice() -> None:
    async with silent_server() as port:
        bmc = source(f"http://127.0.0.1:{port}", timeout_s=1.0)
        monitor = PowerMonitor([(bmc, 1.0, 0.3)])
        try:
            hung = await monitor.read_once("bmc")
            assert hung.watts is None and hung.error == "no answer within 0.3 s"
            again = await monitor.read_once("bmc")  # the worker thread still waits (sushy's own 1 s bound)
            assert "still running" in again.error
        finally:
            await monitor.aclose()
