"""Burst endpoints declared in etcd (``burst/<name>``), and the credentials they may name.

An etcd record never carries a key, nor a path: it names a **credential** the gateway host declares in its
own config (``[burst_credentials.<name>]``: the key file, the DNS names the key may be sent to, the CA
bundle). So a writer of etcd can point overflow at a hosted endpoint, but cannot make Envoy read another
file of the gateway host, nor send a declared key to a host its declaration does not list. Pure: parsing
and the table in force (``README.md``, "Burst endpoints from etcd").
"""

from __future__ import annotations

import json
import logging
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from contracts.config import REQUIRED, Section
from contracts.errors import ConfigError
from extproc.burst.core import BurstEndpoint, parse_endpoint_fields, valid_host, valid_name

log = logging.getLogger(__name__)

#: Static Envoy secret of a declared credential (its key file, read by Envoy at start).
SECRET_PREFIX = "kvgate_burst_credential_"


@dataclass(frozen=True, slots=True)
class BurstCredential:
    """A key the gateway host holds for hosted endpoints: ``api_key_file`` (the key alone, read by Envoy
    only), ``hosts`` (the DNS names it may be sent to; an etcd record naming another host is refused) and
    ``ca_file`` (the PEM bundle those hosts' certificates must chain to; ``None``: the system bundle)."""

    name: str
    api_key_file: str
    hosts: frozenset[str]
    ca_file: str | None = None

    @property
    def secret(self) -> str:
        return SECRET_PREFIX + self.name


def parse_credentials(raw: object, where: str = "burst_credentials") -> tuple[BurstCredential, ...]:
    """A gateway config's ``[burst_credentials.<name>]`` tables (``api_key_file`` and a non-empty ``hosts``
    array required, ``ca_file`` optional); :class:`ConfigError` names the first bad field."""
    if raw is None:
        return ()
    top = Section(raw, where)
    out = []
    for name in sorted(top.names()):
        at = f"{where}.{name}"
        if not valid_name(name):
            raise ConfigError(f"{at}: lowercase letters, digits, '-' and '_' (at most 63), got {name!r}")
        s = top.table(name)
        key_file = s.string("api_key_file", REQUIRED)
        ca_file = s.string("ca_file")
        hosts = s.array("hosts", REQUIRED)
        s.done()
        if not key_file or ca_file == "":
            raise ConfigError(f"{at}: api_key_file (and ca_file when set) must be paths")
        if not hosts or not all(isinstance(h, str) and valid_host(h) for h in hosts):
            raise ConfigError(f"{at}.hosts: a non-empty array of DNS names the key may be sent to")
        out.append(BurstCredential(name, key_file, frozenset(hosts), ca_file))
    top.done()
    return tuple(out)


def parse_record(
    raw: object, name: str, credentials: Mapping[str, BurstCredential], where: str | None = None
) -> BurstEndpoint:
    """etcd ``burst/<name>`` = ``{"host", "port"?, "models", "credential", "engine"?: "openai_compat",
    "name"?: <name>}``. The credential must be one the gateway host declares (``credentials``) and list
    ``host``; its key file and CA bundle become the endpoint's. An ``api_key``, ``api_key_file`` or
    ``ca_file`` in the record is an unknown field, refused like any other."""
    where = where or f"burst/{name}"
    if not valid_name(name):
        raise ConfigError(f"{where}: lowercase letters, digits, '-' and '_' (at most 63), got {name!r}")
    s = Section(raw, where)
    given = s.string("name", name)
    if given != name:
        raise ConfigError(f"{where}.name: must be {name!r} (the key's), got {given!r}")
    cred_name = s.string("credential", REQUIRED)
    host, port, models = parse_endpoint_fields(s, where)
    s.done()
    credential = credentials.get(cred_name)
    if credential is None:
        raise ConfigError(f"{where}.credential: {cred_name!r} is not declared on this gateway host")
    if host not in credential.hosts:
        raise ConfigError(f"{where}.host: credential {cred_name!r} may not be sent to {host!r}")
    return BurstEndpoint(
        name, host, types.MappingProxyType(dict(models)), credential.api_key_file, port, credential.ca_file,
        credential=credential.name,
    )  # fmt: skip


def check_record(raw: bytes, name: str, credentials: Mapping[str, BurstCredential] | None) -> BurstEndpoint:
    """``kvgate policy set burst/<name>``'s check: the record's shape, and, when the gateway host's
    credentials are known (``--gateway-config``), that its credential is declared for its host."""
    where = f"burst/{name}"
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{where}: not JSON") from exc
    if credentials is None:  # the shape only: the credential it names stands in, declared for its host
        credentials = {}
        if (
            isinstance(doc, dict)
            and isinstance(doc.get("credential"), str)
            and isinstance(doc.get("host"), str)
        ):
            cred: str = doc["credential"]
            credentials[cred] = BurstCredential(cred, "-", frozenset({doc["host"]}))
    return parse_record(doc, name, credentials)


class BurstTable:
    """The burst endpoints in force: the gateway config's (``[[burst]]``, fixed) and etcd's records.

    :meth:`put` validates one record; a bad one is refused (its reason returned, to be logged) and the
    record in force stays. A record may not take a static endpoint's name nor a local model another
    endpoint already bursts (the one in force keeps it). ``version`` counts changes of the etcd part.
    """

    def __init__(self, static: tuple[BurstEndpoint, ...], credentials: tuple[BurstCredential, ...]) -> None:
        self.static = static
        self.credentials = {c.name: c for c in credentials}
        self._etcd: dict[str, BurstEndpoint] = {}
        self.version = 0
        self.refused = 0
        self.endpoints: tuple[BurstEndpoint, ...] = static

    def put(self, name: str, value: bytes) -> str | None:
        """Apply etcd ``burst/<name>`` = ``value`` (JSON); the refusal's reason, or ``None``."""
        where = f"burst/{name}"
        try:
            endpoint = parse_record(json.loads(value), name, self.credentials)
        except ValueError:
            return self._refuse(f"{where}: not JSON")
        except ConfigError as exc:
            return self._refuse(str(exc))
        if any(e.name == name for e in self.static):
            return self._refuse(f"{where}: the gateway config's [[burst]] {name!r} cannot be replaced")
        for other in (*self.static, *(e for n, e in self._etcd.items() if n != name)):
            clash = set(other.models) & set(endpoint.models)
            if clash:
                model = sorted(clash)[0]
                return self._refuse(f"{where}: model {model!r} already bursts to {other.name!r}")
        if self._etcd.get(name) != endpoint:
            self._etcd[name] = endpoint
            self._changed()
        return None

    def delete(self, name: str) -> bool:
        if self._etcd.pop(name, None) is None:
            return False
        self._changed()
        return True

    def dynamic(self) -> tuple[BurstEndpoint, ...]:
        """etcd's endpoints, by name (Envoy gets their clusters over CDS)."""
        return tuple(self._etcd[n] for n in sorted(self._etcd))

    def _changed(self) -> None:
        self.version += 1
        self.endpoints = (*self.static, *self.dynamic())

    def _refuse(self, reason: str) -> str:
        self.refused += 1
        return reason


class BurstSink:
    """etcd ``burst/<name>`` into the table (a :class:`~extproc.control.plane.FamilySink`): a refused
    record is logged (its reason names the field, never a key) and the one in force stays; a change calls
    ``changed`` (the burster's endpoints and Envoy's CDS follow)."""

    def __init__(self, table: BurstTable, changed: Callable[[], None]) -> None:
        self._table = table
        self._changed = changed

    def put(self, name: str, value: bytes, *, backlog: bool) -> bool:
        before = self._table.version
        error = self._table.put(name, value)
        if error is not None:
            log.warning("burst endpoint refused, the last good one stays: %s", error)
            return False
        if self._table.version == before:
            return False
        log.info("burst endpoint %s from etcd in force", name)
        self._changed()
        return True

    def delete(self, name: str) -> bool:
        if not self._table.delete(name):
            return False
        log.info("burst endpoint %s removed (etcd)", name)
        self._changed()
        return True
