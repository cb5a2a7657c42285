"""Who changed a policy key, when (etcd revision), and going back to an earlier value.

etcd keeps every revision of a key until it is compacted, but not who wrote it. So every write the
operator's tools make (``kvgate policy set|unset|rollback``) is one transaction of two puts: the value
key and its audit record ``<prefix>audit/<family>/<name>`` = ``{"by": identity, "op": "set" | "unset" |
"rollback", "from": R}`` (:mod:`contracts.audit`; ``from``: the revision a rollback restored). Both land
at the same revision, so the audit key's revisions name who made each change of the value key. The identity is
the common name of the client certificate etcd authenticated the write with (etcd's user; without TLS:
``unauthenticated:<user>@<host>``). Records hold no values: a tenant's or a policy's content is never
copied into the audit trail, and the log line of a change (:func:`log_line`) has identity, key, operation
and revision only.

:func:`history` lists a key's revisions, newest first: those of the value key's current life (walking
back from its ``mod_revision`` by reads at ``mod_revision - 1``) and every one its audit record names
(deletions included), each with who made it where recorded. :func:`rollback` writes the value a key had at
an earlier revision (default: the value before the current one; an absent one: the key is deleted),
compare-and-swap against the current version, after the caller validated it as any write (a deletion
too).
"""

from __future__ import annotations

import getpass
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import etcd3aio
from cryptography.x509.oid import NameOID

from certs.authority import load_cert_pem
from certs.errors import CertError
from contracts.audit import Record, audit_key, decode_record, encode_record, log_line
from contracts.errors import ConfigError
from contracts.etcd import EtcdSettings
from runtime.etcd import ETCD_ERRORS

log = logging.getLogger("kvgate.audit")

__all__ = [
    "Entry",
    "Record",
    "RollbackError",
    "audit_key",
    "decode_record",
    "encode_record",
    "history",
    "log_line",
    "rollback",
    "who",
    "write",
]


@dataclass(frozen=True, slots=True)
class Entry:
    """One revision of a key: its value then (``None``: deleted) and who wrote it (``None``: not
    recorded, e.g. a write with etcdctl)."""

    revision: int
    value: bytes | None
    record: Record | None


def who(settings: EtcdSettings) -> str:
    """The identity a client writes as: its certificate's common name (etcd's user for it under
    ``--client-cert-auth``), else ``unauthenticated:<user>@<host>``."""
    if settings.tls_cert:
        try:
            cert = load_cert_pem(Path(settings.tls_cert).read_bytes(), settings.tls_cert)
        except (OSError, CertError) as exc:
            raise ConfigError(f"cannot read the client certificate {settings.tls_cert}: {exc}") from exc
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if names:
            return str(names[0].value)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"unauthenticated:{user}@{socket.gethostname()}"


def _kv(client: etcd3aio.Etcd3Client) -> etcd3aio.kv.KVService:
    assert client.kv is not None, "etcd client is not connected"
    return client.kv


async def write(
    client: etcd3aio.Etcd3Client,
    prefix: str,
    key: str,
    value: bytes | None,
    record: Record,
    *,
    expect: tuple[int, int] | None = None,
    unchanged_since: tuple[Sequence[str], int] | None = None,
    timeout_s: float = 2.0,
) -> int | None:
    """Put ``value`` at ``key`` (``None``: delete it) and its audit record, in one transaction; returns
    the revision, logged with :func:`log_line`. ``expect``: ``(create_revision, version)`` the key must
    still have (``(0, 0)``: absent); ``unchanged_since``: ``(key prefixes, revision)``, no key under any
    of them written after that revision (the values a write was checked against); else nothing is
    written and ``None`` is returned."""
    kv = _kv(client)
    ops = [kv.txn_op_put(audit_key(prefix, key), encode_record(record))]
    ops.insert(0, kv.txn_op_put(key, value) if value is not None else kv.txn_op_delete(key))
    compare = []
    if expect is not None:
        compare = [kv.txn_compare_create_revision(key, expect[0]), kv.txn_compare_version(key, expect[1])]
    if unchanged_since is not None:
        starts, revision = unchanged_since
        for start in starts:  # every key in [start, its prefix end) has mod_revision < revision + 1
            guard = kv.txn_compare_version(start, 0, range_end=etcd3aio.prefix_range_end(start))
            guard.target, guard.result = type(guard).MOD, type(guard).LESS
            guard.mod_revision = revision + 1
            compare.append(guard)
    response = await kv.txn(compare, ops, timeout=timeout_s)
    if not response.succeeded:
        return None
    revision = int(response.header.revision)
    log.info("%s", log_line(record, key, revision))
    return revision


async def _at(kv: etcd3aio.kv.KVService, key: str, revision: int, timeout_s: float) -> object | None:
    """The key's kv as of ``revision`` (0: now); ``None`` when absent, or compacted away."""
    try:
        response = await kv.get(key, revision=revision, timeout=timeout_s)
    except ETCD_ERRORS as exc:
        if _compacted(exc):
            return None
        raise
    return response.kvs[0] if response.kvs else None


def _compacted(exc: BaseException) -> bool:
    """Whether etcd refused a read because its revision is compacted away."""
    return "compacted" in str(exc) or "compacted" in getattr(exc, "details", lambda: "")()


async def _revisions(kv: etcd3aio.kv.KVService, key: str, limit: int, timeout_s: float) -> dict[int, bytes]:
    """Values of ``key`` by ``mod_revision``, newest first, back to its creation (or compaction)."""
    found: dict[int, bytes] = {}
    item = await _at(kv, key, 0, timeout_s)
    while item is not None and len(found) < limit:
        mod = int(item.mod_revision)  # type: ignore[attr-defined]
        found[mod] = bytes(item.value)  # type: ignore[attr-defined]
        if int(item.version) <= 1:  # type: ignore[attr-defined]
            break
        item = await _at(kv, key, mod - 1, timeout_s)
    return found


async def history(
    client: etcd3aio.Etcd3Client, prefix: str, key: str, *, limit: int = 50, timeout_s: float = 2.0
) -> list[Entry]:
    """The revisions of ``key``, newest first, at most ``limit`` (module docstring)."""
    kv = _kv(client)
    values = await _revisions(kv, key, limit, timeout_s)
    records = {
        rev: decode_record(raw)
        for rev, raw in (await _revisions(kv, audit_key(prefix, key), limit, timeout_s)).items()
    }
    entries = []
    for revision in sorted(set(values) | set(records), reverse=True)[:limit]:
        if revision in values:
            value: bytes | None = values[revision]
        else:
            item = await _at(kv, key, revision, timeout_s)
            current = item is not None and int(item.mod_revision) == revision  # type: ignore[attr-defined]
            value = bytes(item.value) if current else None  # type: ignore[union-attr]
        entries.append(Entry(revision, value, records.get(revision)))
    return entries


class RollbackError(Exception):
    """A rollback that was not written, worded for the operator; ``status``: the CLI's exit status."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


async def rollback(
    client: etcd3aio.Etcd3Client,
    prefix: str,
    key: str,
    by: str,
    validate: Callable[[bytes | None], Awaitable[None] | None],
    *,
    revision: int | None = None,
    timeout_s: float = 2.0,
) -> tuple[int, bytes | None, int]:
    """Give ``key`` the value it had at ``revision`` (default: the value before the current one);
    returns ``(revision restored, value written or None for a delete, revision of the write)``.

    ``validate(value)`` (``None``: the key was absent then, so the rollback deletes it) raises
    :class:`ConfigError` for a value (or a removal) that no longer validates: nothing is written
    (:class:`RollbackError`, status 2), nor for a ``revision`` etcd has compacted away (its value is
    unknown, not absent); a key that changed meanwhile: status 1, nothing written."""
    kv = _kv(client)
    now = await _at(kv, key, 0, timeout_s)
    expect = (0, 0) if now is None else (int(now.create_revision), int(now.version))  # type: ignore[attr-defined]
    if revision is None:
        entries = await history(client, prefix, key, limit=2, timeout_s=timeout_s)
        if len(entries) < 2:
            raise RollbackError(f"{key}: no earlier revision to go back to (see kvgate policy history)")
        revision = entries[1].revision
    if revision < 1:
        raise RollbackError(f"{key}: --revision must be at least 1, got {revision}")
    try:  # not _at: a compacted revision is not one where the key was absent (that would delete it)
        response = await kv.get(key, revision=revision, timeout=timeout_s)
    except ETCD_ERRORS as exc:
        if _compacted(exc):
            raise RollbackError(
                f"{key}: revision {revision} is compacted (etcd no longer has its value); nothing written"
            ) from exc
        raise
    value = bytes(response.kvs[0].value) if response.kvs else None
    try:
        checked = validate(value)
        if checked is not None:
            await checked
    except ConfigError as exc:
        what = "its removal" if value is None else "its value"
        raise RollbackError(
            f"{key} at revision {revision}: {what} no longer validates, nothing written: {exc}"
        ) from exc
    written = await write(
        client, prefix, key, value, Record(by, "rollback", revision), expect=expect, timeout_s=timeout_s
    )
    if written is None:
        raise RollbackError(f"{key} changed while rolling back; nothing written, try again", 1)
    return revision, value, written
