"""The node config's ``[[power]]`` tables: frozen dataclasses parsed at the edge, unknown keys are errors.

One table per source; every key but ``kind`` has a default where one makes sense::

    [[power]]
    kind = "nvml"                     # this node's GPUs through NVML (nvidia-ml-py)
    interval_s = 1.0                  # seconds between reads (every kind)
    timeout_s = 2.0                   # one read's bound (every kind; below interval_s is not required)

    [[power]]
    kind = "dcgm"                     # a dcgm-exporter's /metrics
    url = "http://127.0.0.1:9400/metrics"
    gpus = [0, 1]                     # optional: only these GPUs (the exporter's "gpu" label)

    [[power]]
    kind = "redfish"                  # the node's BMC, read with sushy
    name = "bmc"                      # optional: the source's name in metrics (default: the kind)
    url = "https://10.0.0.2"          # the service's scheme and authority (/redfish/v1 is implied)
    chassis = "1U"                    # optional: default the first member of /redfish/v1/Chassis
    username = "kvgate"
    password_env = "BMC_PASSWORD"     # the environment variable that holds the password
    auth = "auto"                     # basic | session | auto (a session, else basic)
    ca_file = "/etc/kvgate/bmc-ca.pem"   # optional: verify the BMC against this CA bundle
    verify = true                     # false turns TLS verification off (never the default)
    sensor = "PowerSupplyPower"       # optional: Chassis/<id>/Sensors/<sensor> gives the watts

    [[power]]
    kind = "ipmi"                     # an SDR power sensor over IPMI-over-LAN, read with ipmitool
    host = "10.0.0.3"
    port = 623
    username = "kvgate"
    password_env = "IPMI_PASSWORD"    # handed to ipmitool in its environment (-E), never on argv
    sensor = "Node Power"             # the SDR record's id string (a sensor in Watts)
    interface = "lanplus"             # lanplus (IPMI 2.0, RMCP+) | lan (IPMI 1.5)
    cipher_suite = 3                  # lanplus only (3: HMAC-SHA1, HMAC-SHA1-96, AES-CBC-128)
    privilege = "user"                # user | operator | admin
    temperature_sensor = "Inlet Temp" # optional: an SDR sensor in degrees C read in the same call
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from contracts.config import REQUIRED, Section, choice
from contracts.errors import ConfigError

KINDS = ("nvml", "dcgm", "redfish", "ipmi")
REDFISH_AUTH = ("basic", "session", "auto")
IPMI_INTERFACES = ("lanplus", "lan")
IPMI_PRIVILEGES = ("user", "operator", "admin")
_NAME = re.compile(r"[A-Za-z0-9._-]+")
_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class Common:
    """What every source has: its name (metrics, status), read interval and one read's bound (s)."""

    name: str
    interval_s: float = 1.0
    timeout_s: float = 2.0


@dataclass(frozen=True, slots=True)
class NvmlConfig:
    common: Common
    kind: str = "nvml"


@dataclass(frozen=True, slots=True)
class DcgmConfig:
    """``url``: the exporter's metrics URL; ``gpus``: the GPU indices read (``None``: all)."""

    common: Common
    url: str
    gpus: frozenset[int] | None = None
    kind: str = "dcgm"


@dataclass(frozen=True, slots=True)
class RedfishConfig:
    """A BMC's Redfish service (module docstring). ``verify``: ``True``, ``False`` or a CA bundle path."""

    common: Common
    url: str
    username: str
    password_env: str
    chassis: str | None = None
    auth: str = "auto"
    verify: bool | str = True
    sensor: str | None = None
    kind: str = "redfish"


@dataclass(frozen=True, slots=True)
class IpmiConfig:
    """A BMC's IPMI-over-LAN interface and the SDR sensor that reads the node's power (docstring)."""

    common: Common
    host: str
    username: str
    password_env: str
    sensor: str
    port: int = 623
    interface: str = "lanplus"
    cipher_suite: int = 3
    privilege: str = "user"
    temperature_sensor: str | None = None
    kind: str = "ipmi"


PowerConfig = NvmlConfig | DcgmConfig | RedfishConfig | IpmiConfig


def parse_power(tables: list[object]) -> tuple[PowerConfig, ...]:
    """The ``[[power]]`` tables, checked (:class:`~contracts.errors.ConfigError` naming the key)."""
    sources = tuple(_source(t, i) for i, t in enumerate(tables))
    seen: set[str] = set()
    for s in sources:
        if s.common.name in seen:
            raise ConfigError(f"power: two sources named {s.common.name!r} (set name on one)")
        seen.add(s.common.name)
    return sources


def _source(raw: object, index: int) -> PowerConfig:
    where = f"power[{index}]"
    s = Section(raw, where)
    kind = choice(s.string("kind", REQUIRED), KINDS, f"{where}.kind")
    name = s.string("name", kind)
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{where}.name: expected letters, digits, '.', '_' or '-', got {name!r}")
    common = Common(
        name=name,
        interval_s=s.number("interval_s", 1.0, minimum=0.01),
        timeout_s=s.number("timeout_s", 2.0, minimum=0.01),
    )
    source: PowerConfig
    if kind == "nvml":
        source = NvmlConfig(common)
    elif kind == "dcgm":
        gpus = s.array("gpus")
        if gpus is not None and not all(
            isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus
        ):
            raise ConfigError(f"{where}.gpus: expected a list of GPU indices (whole numbers >= 0)")
        source = DcgmConfig(common, _url(s.string("url", REQUIRED), f"{where}.url"), _gpus(gpus))
    elif kind == "redfish":
        ca_file = s.string("ca_file")
        verify = s.flag("verify", True)
        if ca_file is not None and not verify:
            raise ConfigError(f"{where}.ca_file: verify = false turns verification off; drop one of them")
        source = RedfishConfig(
            common,
            url=_url(s.string("url", REQUIRED), f"{where}.url", path=False),
            username=_nonempty(s.string("username", REQUIRED), f"{where}.username"),
            password_env=_env(s.string("password_env", REQUIRED), f"{where}.password_env"),
            chassis=s.string("chassis"),
            auth=choice(s.string("auth", "auto"), REDFISH_AUTH, f"{where}.auth"),
            verify=ca_file if ca_file else bool(verify),
            sensor=s.string("sensor"),
        )
    else:
        interface = choice(s.string("interface", "lanplus"), IPMI_INTERFACES, f"{where}.interface")
        if "cipher_suite" in s.names() and interface != "lanplus":
            raise ConfigError(f'{where}.cipher_suite: only with interface = "lanplus"')
        port = s.integer("port", 623, minimum=1)
        if port > 65535:
            raise ConfigError(f"{where}.port: must be <= 65535, got {port}")
        source = IpmiConfig(
            common,
            host=_nonempty(s.string("host", REQUIRED), f"{where}.host"),
            username=_nonempty(s.string("username", REQUIRED), f"{where}.username"),
            password_env=_env(s.string("password_env", REQUIRED), f"{where}.password_env"),
            sensor=_nonempty(s.string("sensor", REQUIRED), f"{where}.sensor"),
            port=port,
            interface=interface,
            cipher_suite=s.integer("cipher_suite", 3, minimum=0),
            privilege=choice(s.string("privilege", "user"), IPMI_PRIVILEGES, f"{where}.privilege"),
            temperature_sensor=s.string("temperature_sensor"),
        )
    s.done()
    return source


def _url(value: str, where: str, *, path: bool = True) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{where}: expected an http:// or https:// URL, got {value!r}")
    if not path and parts.path not in ("", "/"):
        raise ConfigError(f"{where}: give only scheme and host (/redfish/v1 is implied), got {value!r}")
    if parts.username or parts.password:
        raise ConfigError(f"{where}: no credentials in the URL (use username and password_env)")
    return value.rstrip("/") if not path else value


def _gpus(values: list[int] | None) -> frozenset[int] | None:
    return None if values is None else frozenset(values)


def _nonempty(value: str, where: str) -> str:
    if not value:
        raise ConfigError(f"{where}: must not be empty")
    return value


def _env(value: str, where: str) -> str:
    if not _ENV.fullmatch(value):
        raise ConfigError(f"{where}: expected an environment variable name, got {value!r}")
    return value
