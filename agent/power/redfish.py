"""Redfish: a BMC's chassis power and temperatures, read with sushy (OpenStack's Redfish client).

Pure part (:func:`parse_chassis`): from the chassis resource and the resources it links to, in this order
of preference for each figure (``None`` where none says):

- watts: ``Sensors/<sensor>`` ``Reading`` when the node config names a power sensor (``ReadingType``
  ``Power`` or ``ReadingUnits`` ``W``); else ``EnvironmentMetrics.PowerWatts.Reading``; else the first
  ``Power.PowerControl[]`` entry with ``PowerConsumedWatts`` (the chassis total, DSP0268's Power schema,
  deprecated since 2020 in favour of PowerSubsystem and EnvironmentMetrics but what most BMCs serve);
- limit: ``EnvironmentMetrics.PowerLimitWatts.SetPoint``, else ``PowerControl[].PowerLimit.LimitInWatts``;
- energy: ``EnvironmentMetrics.EnergykWh.Reading`` x 3.6e6 (J);
- temperature: ``EnvironmentMetrics.TemperatureCelsius.Reading``, else the hottest
  ``Thermal.Temperatures[].ReadingCelsius``;
- throttled: not in these resources (``None``).

IO (:class:`RedfishSource`): sushy's ``Sushy`` root and ``Connector`` over HTTPS with TLS verification on
(a CA bundle path, or off only when the config says ``verify = false``), basic auth, a Redfish session
(``SessionService``), or a session with a fall back to basic (``auto``). sushy is synchronous: each read
runs in a worker thread, one at a time, each request bounded by the source's timeout.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.power.errors import PowerSourceError
from agent.power.reading import MAX_CELSIUS, MAX_WATTS, Sample, number, optional

JOULES_PER_KWH = 3.6e6
#: Largest plausible energy counter (kWh): 10 MW for ten years.
MAX_KWH = 1e4 * 24 * 3650.0


@dataclass(frozen=True, slots=True)
class ChassisLinks:
    """The resource paths a chassis links to (``None``: not offered)."""

    power: str | None = None
    thermal: str | None = None
    environment: str | None = None
    sensors: str | None = None


def _link(doc: Mapping[str, Any], key: str) -> str | None:
    value = doc.get(key)
    if isinstance(value, Mapping) and isinstance(value.get("@odata.id"), str):
        return str(value["@odata.id"])
    return None


def chassis_links(chassis: object) -> ChassisLinks:
    """The Power, Thermal, EnvironmentMetrics and Sensors links of a Chassis resource."""
    if not isinstance(chassis, Mapping):
        raise PowerSourceError("the chassis resource is not a JSON object")
    return ChassisLinks(
        power=_link(chassis, "Power"),
        thermal=_link(chassis, "Thermal"),
        environment=_link(chassis, "EnvironmentMetrics"),
        sensors=_link(chassis, "Sensors"),
    )


def _reading(doc: Mapping[str, Any], key: str, field: str) -> object:
    value = doc.get(key)
    return value.get(field) if isinstance(value, Mapping) else None


def parse_chassis(
    *,
    power: object = None,
    thermal: object = None,
    environment: object = None,
    sensor: object = None,
) -> Sample:
    """The node's sample from the resources read (module docstring); :class:`PowerSourceError` when a
    resource is not an object, a number is implausible, or nothing gives watts or a temperature."""
    docs = {"Power": power, "Thermal": thermal, "EnvironmentMetrics": environment, "Sensor": sensor}
    for name, doc in docs.items():
        if doc is not None and not isinstance(doc, Mapping):
            raise PowerSourceError(f"the {name} resource is not a JSON object")
    watts = limit = energy = temp = None
    if isinstance(sensor, Mapping):
        if sensor.get("ReadingType") not in (None, "Power") and sensor.get("ReadingUnits") != "W":
            raise PowerSourceError(
                f"sensor {sensor.get('Id')!r} reads {sensor.get('ReadingType')}, not power"
            )
        watts = optional(sensor.get("Reading"), "Sensor.Reading", MAX_WATTS)
    if isinstance(environment, Mapping):
        if watts is None:
            watts = optional(_reading(environment, "PowerWatts", "Reading"), "PowerWatts.Reading", MAX_WATTS)
        limit = optional(
            _reading(environment, "PowerLimitWatts", "SetPoint"), "PowerLimitWatts.SetPoint", MAX_WATTS
        )
        kwh = optional(_reading(environment, "EnergykWh", "Reading"), "EnergykWh.Reading", MAX_KWH)
        energy = None if kwh is None else kwh * JOULES_PER_KWH
        temp = optional(
            _reading(environment, "TemperatureCelsius", "Reading"), "TemperatureCelsius.Reading", MAX_CELSIUS
        )
    if isinstance(power, Mapping):
        controls = power.get("PowerControl")
        entries = [c for c in controls if isinstance(c, Mapping)] if isinstance(controls, list) else []
        for entry in entries:
            if watts is None and entry.get("PowerConsumedWatts") is not None:
                watts = number(entry["PowerConsumedWatts"], "PowerControl.PowerConsumedWatts", MAX_WATTS)
            if limit is None:
                limit = optional(
                    _reading(entry, "PowerLimit", "LimitInWatts"),
                    "PowerControl.PowerLimit.LimitInWatts",
                    MAX_WATTS,
                )
    if temp is None and isinstance(thermal, Mapping):
        listed = thermal.get("Temperatures")
        temps = [
            number(t["ReadingCelsius"], "Temperatures.ReadingCelsius", MAX_CELSIUS)
            for t in (listed if isinstance(listed, list) else [])
            if isinstance(t, Mapping) and t.get("ReadingCelsius") is not None
        ]
        temp = max(temps) if temps else None
    if watts is None and temp is None:
        raise PowerSourceError("the chassis offers no power or temperature reading")
    return Sample(watts=watts, limit_w=limit, energy_j=energy, temperature_c=temp)


class RedfishSource:
    """One BMC's chassis through sushy (module docstring).

    ``url``: scheme and authority of the service; ``verify``: ``True`` (system CAs), a CA bundle path, or
    ``False``; ``auth``: ``basic``, ``session`` or ``auto``; ``chassis``: its id (``None``: the first
    member of the chassis collection, by path); ``sensor``: a ``Sensors`` member id that reads the node's
    watts. The password is read from the environment variable ``password_env`` when the source connects.
    """

    kind = "redfish"

    def __init__(
        self,
        name: str,
        url: str,
        *,
        username: str,
        password_env: str,
        timeout_s: float,
        verify: bool | str = True,
        auth: str = "auto",
        chassis: str | None = None,
        sensor: str | None = None,
    ) -> None:
        self.name, self.url = name, url
        self._username, self._password_env = username, password_env
        self._timeout_s, self._verify, self._auth = timeout_s, verify, auth
        self._chassis, self._sensor = chassis, sensor
        self._conn: Any = None
        self._root: Any = None
        self._chassis_path: str | None = None
        #: A read is under way in a worker thread (sushy blocks): the next one waits for it to end.
        self._busy = False

    async def read(self) -> Sample:
        if self._busy:
            raise PowerSourceError("the previous read is still running (the BMC is slow to answer)")
        self._busy = True

        def work() -> Sample:
            try:
                return self._read_sync()
            finally:
                self._busy = False  # also when the monitor gave up waiting: the thread ends by itself

        return await asyncio.to_thread(work)

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await asyncio.to_thread(conn.close)

    # -- in the worker thread ---------------------------------------------------------------------------

    def _read_sync(self) -> Sample:
        import requests
        import sushy.exceptions

        try:
            return self._fetch()
        except sushy.exceptions.AccessError as exc:
            self._drop()
            raise PowerSourceError(f"access refused (check username and password): {_short(exc)}") from exc
        except ValueError as exc:  # a body that is not JSON (requests' JSONDecodeError is one too)
            raise PowerSourceError(f"not a Redfish JSON answer: {_short(exc)}") from exc
        except (sushy.exceptions.SushyError, requests.RequestException) as exc:
            self._drop()
            raise PowerSourceError(f"{type(exc).__name__}: {_short(exc)}") from exc

    def _fetch(self) -> Sample:
        conn = self._conn or self._connect()
        path = self._chassis_path or self._find_chassis()
        links = chassis_links(conn.get(path).json())
        docs = {}
        for key, link in (
            ("power", links.power),
            ("thermal", links.thermal),
            ("environment", links.environment),
        ):
            if link is not None:
                docs[key] = conn.get(link).json()
        sensor = None
        if self._sensor is not None:
            if links.sensors is None:
                raise PowerSourceError(f"the chassis has no Sensors collection (sensor {self._sensor!r})")
            sensor = conn.get(f"{links.sensors.rstrip('/')}/{self._sensor}").json()
        return parse_chassis(sensor=sensor, **docs)

    def _connect(self) -> Any:
        import sushy
        from sushy import auth
        from sushy.connector import Connector

        password = os.environ.get(self._password_env)
        if not password:
            raise PowerSourceError(f"the password variable {self._password_env} is not set")
        method = {"basic": auth.BasicAuth, "session": auth.SessionAuth, "auto": auth.SessionOrBasicAuth}[
            self._auth
        ]
        conn = Connector(
            self.url,
            verify=self._verify,
            default_request_timeout=self._timeout_s,
            server_side_retries=1,  # retries are the monitor's, on the source's interval
        )
        try:
            root = sushy.Sushy(self.url, auth=method(self._username, password), connector=conn)
        except BaseException:
            conn.close()
            raise
        self._conn, self._root = conn, root
        return conn

    def _find_chassis(self) -> str:
        if self._chassis is not None:
            path = f"/redfish/v1/Chassis/{self._chassis}"
        else:
            members = self._root.get_chassis_collection().members_identities
            if not members:
                raise PowerSourceError("the service lists no chassis")
            path = sorted(members)[0]  # the first by path: the same one on every connect
        self._chassis_path = path
        return path

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self._chassis_path = None
        if conn is not None:
            conn.close()


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
