"""The generic config reader every process parses its files with: strict typed sections, nothing raw.

:class:`Section` gives typed access to one table of a decoded TOML/JSON document and reports keys
nobody asked for (:meth:`Section.done`): a typo is an error, never a silent default. The small checks
(``host:port``, a choice among names, TLS files set together) and :func:`read_tree` (a ``.toml`` or
``.json`` file, decoded) are here so that the gateway, the agent, kvcached and the CLIs word their
errors the same way. Every failure is a :class:`~contracts.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import ipaddress
import json
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from contracts.errors import ConfigError

REQUIRED = object()
"""The ``default`` of a key that must be present."""
#: The largest integer a config key takes: TOML's (a signed 64-bit integer); JSON's has no bound.
MAX_INTEGER = 2**63 - 1
#: The longest duration a key rendered into an Envoy config may hold (s): protobuf's ``Duration`` range.
MAX_DURATION_S = 315_576_000_000.0


class Section:
    """Typed, strict access to one mapping of a config document; reports unknown keys."""

    def __init__(self, raw: object, where: str) -> None:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a table, got {type(raw).__name__}")
        self._raw: Mapping[str, Any] = raw
        self._where = where
        self._seen: set[str] = set()

    def _get(self, key: str, kinds: tuple[type, ...], default: object) -> Any:
        self._seen.add(key)
        if key not in self._raw:
            if default is REQUIRED:
                raise ConfigError(f"{self._where}.{key}: required")
            return default
        value = self._raw[key]
        if isinstance(value, bool) and bool not in kinds:
            raise ConfigError(f"{self._where}.{key}: expected {_names(kinds)}, got bool")
        if not isinstance(value, kinds):
            raise ConfigError(f"{self._where}.{key}: expected {_names(kinds)}, got {type(value).__name__}")
        return value

    def string(self, key: str, default: object = None) -> Any:
        return self._get(key, (str,), default)

    def integer(self, key: str, default: object = None, *, minimum: int | None = None) -> Any:
        value = self._get(key, (int,), default)
        if value is not None and minimum is not None and value < minimum:
            raise ConfigError(f"{self._where}.{key}: must be >= {minimum}, got {value}")
        if value is not None and value > MAX_INTEGER:  # JSON (and tomllib) read any size; TOML's are 64-bit
            raise ConfigError(f"{self._where}.{key}: must be <= {MAX_INTEGER}, got a larger integer")
        return value

    def number(self, key: str, default: object = None, *, minimum: float = 0.0) -> Any:
        value = self._get(key, (int, float), default)
        if value is None:
            return None
        try:
            value = float(value)
        except OverflowError:  # an integer past any float (JSON reads one of any size)
            raise ConfigError(
                f"{self._where}.{key}: must be a finite number >= {minimum}, got a number too large"
            ) from None
        if not math.isfinite(value) or value < minimum:
            raise ConfigError(f"{self._where}.{key}: must be a finite number >= {minimum}, got {value}")
        return value

    def flag(self, key: str, default: object = None) -> Any:
        return self._get(key, (bool,), default)

    def array(self, key: str, default: object = None) -> Any:
        return self._get(key, (list,), default)

    def names(self) -> list[str]:
        return list(self._raw)

    def table(self, key: str) -> Section:
        return Section(self._get(key, (dict,), {}), f"{self._where}.{key}")

    def raw(self, key: str) -> Any:
        self._seen.add(key)
        return self._raw.get(key)

    def done(self) -> None:
        unknown = sorted(set(self._raw) - self._seen)
        if unknown:
            raise ConfigError(f"{self._where}: unknown key(s) {', '.join(unknown)}")


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def hostport(value: str, where: str) -> str:
    """``value`` if it is ``host:port`` with a port 0-65535."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{where}: expected host:port, got {value!r}")
    return value


IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def ip_port(address: str) -> tuple[IP, str] | None:
    """The IP literal and the port text of ``ip:port`` or ``[ip]:port``; ``None`` when the host is no IP
    literal (a name). The one parser of an endpoint's address: :func:`canonical_address`, EDS's socket
    (``extproc/xds/eds.py``) and the pool's socket key (``extproc/inferencepool/merge.py``) read it."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return ipaddress.ip_address(host), port
    except ValueError:
        return None


def canonical_address(address: str) -> str:
    """``host:port`` with a bracketed IP literal as Envoy reports a host: IPv6 compressed and lower-case
    (``[FD00:0::1]:8000`` -> ``[fd00::1]:8000``; IPv4-mapped as ``[::ffff:10.0.0.2]:80``), IPv4 without
    brackets (``[10.0.0.2]:80`` -> ``10.0.0.2:80``); any other address as it is."""
    parsed = ip_port(address) if address.startswith("[") else None
    if parsed is None:
        return address
    ip, port = parsed
    if ip.version == 4:
        return f"{ip}:{port}"
    mapped = ip.ipv4_mapped  # inet_ntop's (Envoy's) form, not Python's before 3.13 (::ffff:a00:2)
    return f"[::ffff:{mapped}]:{port}" if mapped is not None else f"[{ip.compressed}]:{port}"


def choice(value: str, allowed: tuple[str, ...], where: str) -> str:
    """``value`` if it is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{where}: expected one of {', '.join(allowed)}, got {value!r}")
    return value


def all_or_none(where: str, **paths: str | None) -> None:
    """TLS file settings that only work together: all set (non-empty) or all absent."""
    given = [k for k, v in paths.items() if v]
    if given and len(given) != len(paths):
        raise ConfigError(f"{where}: set all of {', '.join(paths)} or none (got only {', '.join(given)})")
    if any(v == "" for v in paths.values()):
        raise ConfigError(f"{where}: TLS file paths must not be empty")


def state_options(s: Section, where: str, interval_s: float) -> tuple[str | None, float]:
    """A daemon's kept state (``runtime/statefile.py``): the section's ``state_dir`` (``None`` when absent
    or ``""``: not kept, which overrides ``kvgate up``'s) and ``snapshot_interval_s`` (default
    ``interval_s``, > 0)."""
    state_dir = s.string("state_dir", None) or None
    interval = float(s.number("snapshot_interval_s", interval_s))
    if interval <= 0:
        raise ConfigError(f"{where}.snapshot_interval_s: must be > 0, got {interval}")
    if state_dir is not None and "\0" in state_dir:
        raise ConfigError(f"{where}.state_dir: not a path (a NUL character)")
    return state_dir, interval


def read_tree(path: Path | str, what: str) -> object:
    """The parsed contents of a ``.json`` file, or of any other as TOML; :class:`ConfigError` naming
    ``what`` (e.g. "config") if it cannot be read, and the format if it does not parse. The config and
    policy loaders of every process read their files through this."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from exc
    is_json = path.suffix == ".json"
    try:
        return json.loads(text) if is_json else tomllib.loads(text.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid {'JSON' if is_json else 'TOML'}: {exc}") from exc
