"""IPMI: one SDR power sensor of the node's BMC over IPMI-over-LAN, read with ``ipmitool``.

Why a sensor and not DCMI's Get Power Reading: not every BMC implements DCMI (OpenIPMI's ``ipmi_sim``,
the BMC the tests run, does not), while a threshold sensor in Watts is in the SDR of every server that
reports power at all; the node config names it (``sensor``, its SDR id string, ``ipmitool sdr list``).

The command (the password travels in ipmitool's environment, ``IPMI_PASSWORD`` with ``-E``, never on
its command line, which other users of the host can read)::

    ipmitool -I lanplus -C 3 -H HOST -p PORT -U USER -E -L USER -N 1 -R 1 -c sdr get SENSOR

``-c`` prints one CSV line per sensor: id string, reading, unit, status, then entity and thresholds;
:func:`parse_sdr` takes the line of the named sensor, whose unit must be ``Watts`` and whose status is
not ``ns`` (no reading); with ``temperature_sensor`` (an SDR sensor in degrees C, e.g. the inlet) its
name follows the power sensor's on the command line and its reading is the sample's temperature.
``-N 1 -R 1``: one second per try, one retry; the monitor's ``timeout_s`` bounds the whole run, after
which the process is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import os
import shutil

from agent.power.errors import PowerSourceError
from agent.power.reading import MAX_CELSIUS, MAX_WATTS, Sample, number

#: ``ipmitool -L`` names of the privilege levels.
PRIVILEGES = {"user": "USER", "operator": "OPERATOR", "admin": "ADMINISTRATOR"}


def _row(text: str, sensor: str) -> list[str] | None:
    for row in csv.reader(text.splitlines()):
        if row and row[0].strip() == sensor:
            return row
    return None


def _reading(row: list[str], sensor: str, units: tuple[str, ...], maximum: float) -> float:
    if len(row) < 4:
        raise PowerSourceError(f"sensor {sensor!r}: a short line from ipmitool: {','.join(row)[:200]!r}")
    value, unit, status = row[1].strip(), row[2].strip(), row[3].strip()
    if status == "ns" or value.lower() in ("", "na", "disabled"):
        raise PowerSourceError(f"sensor {sensor!r} has no reading (status {status!r})")
    if unit.lower() not in (u.lower() for u in units):
        raise PowerSourceError(f"sensor {sensor!r} reads {unit!r}, not {units[0]}")
    try:
        reading = float(value)
    except ValueError as exc:
        raise PowerSourceError(f"sensor {sensor!r}: {value[:50]!r} is not a number") from exc
    return number(reading, f"sensor {sensor!r}", maximum)


def parse_sdr(text: str, sensor: str, temperature_sensor: str | None = None) -> Sample:
    """The watts of ``sensor`` (and the degrees C of ``temperature_sensor``) from ``ipmitool -c sdr get``
    output (module docstring); :class:`PowerSourceError` when a line is missing, not in the right unit,
    without a reading or not a number."""
    row = _row(text, sensor)
    if row is None:
        raise PowerSourceError(f"the BMC has no sensor {sensor!r} in its SDR")
    watts = _reading(row, sensor, ("Watts", "W"), MAX_WATTS)
    temperature = None
    if temperature_sensor is not None:
        temp_row = _row(text, temperature_sensor)
        if temp_row is None:
            raise PowerSourceError(f"the BMC has no sensor {temperature_sensor!r} in its SDR")
        temperature = _reading(temp_row, temperature_sensor, ("degrees C",), MAX_CELSIUS)
    return Sample(watts=watts, temperature_c=temperature)


class IpmiSource:
    """Reads one SDR power sensor with ``ipmitool`` (module docstring). ``program``: the ipmitool to run
    (default: the one on ``PATH``)."""

    kind = "ipmi"

    def __init__(
        self,
        name: str,
        host: str,
        *,
        username: str,
        password_env: str,
        sensor: str,
        port: int = 623,
        interface: str = "lanplus",
        cipher_suite: int = 3,
        privilege: str = "user",
        temperature_sensor: str | None = None,
        program: str | None = None,
    ) -> None:
        self.name, self.sensor, self._password_env = name, sensor, password_env
        self.temperature_sensor = temperature_sensor
        self._program = program
        argv = ["-I", interface]
        if interface == "lanplus":
            argv += ["-C", str(cipher_suite)]
        argv += ["-H", host, "-p", str(port), "-U", username, "-E", "-L", PRIVILEGES[privilege]]
        sensors = [sensor] if temperature_sensor is None else [sensor, temperature_sensor]
        self.argv = [*argv, "-N", "1", "-R", "1", "-c", "sdr", "get", *sensors]

    async def read(self) -> Sample:
        password = os.environ.get(self._password_env)
        if not password:
            raise PowerSourceError(f"the password variable {self._password_env} is not set")
        program = self._program or shutil.which("ipmitool")
        if program is None:
            raise PowerSourceError("ipmitool is not installed (Debian package ipmitool)")
        env = {k: v for k, v in os.environ.items() if k != self._password_env} | {"IPMI_PASSWORD": password}
        proc = await asyncio.create_subprocess_exec(
            program,
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            out, err = await proc.communicate()
        finally:
            if proc.returncode is None:  # cancelled (the monitor's timeout): end the process we started
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        text = out.decode(errors="replace")
        if proc.returncode != 0:
            detail = " ".join(_last_lines(err.decode(errors="replace")).split()) or f"exit {proc.returncode}"
            raise PowerSourceError(f"ipmitool: {detail[:300]}")
        return parse_sdr(text, self.sensor, self.temperature_sensor)

    async def aclose(self) -> None:
        return None


def _last_lines(text: str, count: int = 2) -> str:
    """The last lines of ipmitool's stderr that are not its harmless HPM capability probe."""
    lines = [line for line in text.splitlines() if line.strip() and "HPM.x Capabilities" not in line]
    return " ".join(lines[-count:])
