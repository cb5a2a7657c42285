"""The audit record of a policy change (etcd ``<prefix>audit/<family>/<name>``), sans IO.

Every write the operator's tools make to ``policy/``, ``models/``, ``objectives/``, ``tenants/`` is one
etcd transaction of two puts: the value key and its audit record ``{"by": identity, "op": "set" |
"unset" | "rollback", "from": R}`` (``from``: the revision a rollback restored), so both share one
revision (:mod:`kvgate.etcdsec.audit` writes them; gateways log each record as it arrives,
:mod:`extproc.control.plane`). Records hold no values, and :func:`log_line` has identity, key, operation
and revision only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from contracts.errors import ConfigError
from contracts.etcd import split_key

AUDIT = "audit"
"""Key family of the audit records."""
OPS = ("set", "unset", "rollback")


@dataclass(frozen=True, slots=True)
class Record:
    """An audit record: who, which operation, and for a rollback the revision restored."""

    by: str
    op: str
    restored: int | None = None


def audit_key(prefix: str, key: str) -> str:
    """``<prefix>audit/<family>/<name>`` of the value key ``<prefix><family>/<name>``."""
    parsed = split_key(prefix, key)
    if parsed is None:
        raise ConfigError(f"{key!r} is not a key under {prefix!r}")
    return f"{prefix}{AUDIT}/{parsed[0]}/{parsed[1]}"


def encode_record(record: Record) -> bytes:
    if record.op not in OPS:
        raise ConfigError(f"audit: unknown operation {record.op!r}")
    doc: dict[str, object] = {"by": record.by, "op": record.op}
    if record.restored is not None:
        doc["from"] = record.restored
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def decode_record(raw: bytes) -> Record | None:
    """An audit record, or ``None`` when the value is not one (never raises: history shows what it can)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("by"), str) or doc.get("op") not in OPS:
        return None
    restored = doc.get("from")
    return Record(doc["by"], doc["op"], restored if isinstance(restored, int) else None)


def log_line(record: Record | None, key: str, revision: int) -> str:
    """The audit log line of one change: identity, key, operation, revision; never the value."""
    if record is None:
        return f"audit: by=? key={key} op=? revision={revision} (not an audit record)"
    line = f"audit: by={record.by} key={key} op={record.op} revision={revision}"
    return line if record.restored is None else f"{line} restored={record.restored}"
