"""API keys: ``Authorization: Bearer sk-kvg-...`` (what OpenAI SDKs send), hashed at rest, revocable live.

A key is ``sk-kvg-`` + 32 random bytes (base64url, 256 bits of entropy). Only its SHA-256 is stored
(``sha256$<hex>``): whoever reads the key file cannot authenticate with what they read. A fast hash is
enough because the keys are random: slow password hashes (scrypt, argon2) exist to make guessing a
*low-entropy* secret expensive, and guessing 256 random bits is already infeasible, while a slow hash
would cost milliseconds on every request. Lookup is by hash, so no stored secret is ever compared.

Key file (JSON, written atomically by ``kvgate apikey``)::

    {"version": 1, "keys": [{"id": "key_3f2a9c01d4e5", "tenant": "acme", "hash": "sha256$...",
                             "created": 1767225600, "name": "ci", "revoked": 1767312000}]}

``revoked`` (unix seconds) marks a revoked key; it stays listed for audit. :class:`KeyFile` re-reads
the file whenever its (inode, size, mtime) changes, checked with one ``stat`` per lookup, so a
revocation takes effect on the very next request. A file that fails validation is ignored with a
logged reason and the last good set stays in force; a missing file means no valid keys.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "sk-kvg-"
HASH_SCHEME = "sha256"
FILE_VERSION = 1
_RECORD_KEYS = frozenset({"id", "tenant", "hash", "created", "name", "revoked"})


class KeyFileError(ValueError):
    """The key file is not valid; the message names the offending entry and field."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One stored key: ``id`` (public, safe to log), ``tenant``, ``hash`` (``sha256$<hex>``),
    ``created``/``revoked`` (unix seconds; ``revoked`` ``None`` while valid), optional ``name``."""

    id: str
    tenant: str
    hash: str
    created: int
    name: str | None = None
    revoked: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "tenant": self.tenant, "hash": self.hash}
        out["created"] = self.created
        if self.name is not None:
            out["name"] = self.name
        if self.revoked is not None:
            out["revoked"] = self.revoked
        return out


def new_key() -> str:
    """A fresh API key (shown once to its owner, never stored)."""
    return PREFIX + secrets.token_urlsafe(32)


def new_key_id() -> str:
    return "key_" + secrets.token_hex(6)


def hash_key(key: str) -> str:
    """The at-rest form of ``key``: ``sha256$<hex digest of its UTF-8 bytes>``."""
    return f"{HASH_SCHEME}${hashlib.sha256(key.encode()).hexdigest()}"


def looks_like_key(credential: str) -> bool:
    return credential.startswith(PREFIX)


class KeyStore:
    """Valid (unrevoked) keys by hash. Pure: built from records, answers lookups."""

    def __init__(self, keys: Iterable[ApiKey] = ()) -> None:
        self.keys = tuple(keys)
        self._by_hash = {k.hash: k for k in self.keys if k.revoked is None}

    @property
    def valid(self) -> int:
        """How many keys are unrevoked."""
        return len(self._by_hash)

    def lookup(self, key: str) -> ApiKey | None:
        """The record of a presented key, or ``None`` for an unknown or revoked one."""
        if not looks_like_key(key):
            return None
        return self._by_hash.get(hash_key(key))


def parse_keys(raw: object) -> KeyStore:
    """Validate a decoded key file; raises :class:`KeyFileError` naming the bad entry."""
    if not isinstance(raw, Mapping) or set(raw) - {"version", "keys"}:
        raise KeyFileError("expected an object with 'version' and 'keys'")
    if raw.get("version", FILE_VERSION) != FILE_VERSION:
        raise KeyFileError(f"unsupported version {raw.get('version')!r}")
    entries = raw.get("keys", [])
    if not isinstance(entries, list):
        raise KeyFileError("keys: expected a list")
    keys = [_record(e, f"keys[{i}]") for i, e in enumerate(entries)]
    ids = [k.id for k in keys]
    if len(set(ids)) != len(ids):
        raise KeyFileError("keys: duplicate id")
    return KeyStore(keys)


def _record(raw: object, where: str) -> ApiKey:
    if not isinstance(raw, Mapping):
        raise KeyFileError(f"{where}: expected an object")
    unknown = set(raw) - _RECORD_KEYS
    if unknown:
        raise KeyFileError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    for name in ("id", "tenant", "hash"):
        if not isinstance(raw.get(name), str) or not raw[name]:
            raise KeyFileError(f"{where}.{name}: expected a non-empty string")
    scheme, _, digest = raw["hash"].partition("$")
    if scheme != HASH_SCHEME or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise KeyFileError(f"{where}.hash: expected sha256$<64 hex digits>")
    for name in ("created", "revoked"):
        value = raw.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise KeyFileError(f"{where}.{name}: expected unix seconds")
    label = raw.get("name")
    if label is not None and not isinstance(label, str):
        raise KeyFileError(f"{where}.name: expected a string")
    return ApiKey(raw["id"], raw["tenant"], raw["hash"], raw.get("created") or 0, label, raw.get("revoked"))


def read_keys(path: Path) -> KeyStore:
    """Read and validate a key file (a missing file is an empty store)."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return KeyStore()
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise KeyFileError(f"not valid JSON: {exc}") from exc
    return parse_keys(raw)


def write_keys(path: Path, keys: Iterable[ApiKey]) -> None:
    """Replace the key file atomically (temp file + rename), readable by its owner only."""
    body = json.dumps({"version": FILE_VERSION, "keys": [k.to_json() for k in keys]}, indent=2) + "\n"
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class KeyFile:
    """A key file, re-read whenever it changes (one ``stat`` per lookup, so revocation is immediate)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._signature: tuple[int, int, int] | str | None = "unread"
        self._store = KeyStore()
        self._refresh()

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
            signature: tuple[int, int, int] | None = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            signature = None
        if signature == self._signature:
            return
        if signature is None:
            log.warning("API key file %s is missing: no API key is valid", self.path)
            self._signature, self._store = None, KeyStore()
            return
        try:
            store = read_keys(self.path)
        except (KeyFileError, OSError) as exc:
            log.error("API key file %s rejected, keeping the last good one: %s", self.path, exc)
            self._signature = signature
            return
        self._signature, self._store = signature, store
        log.info("API key file %s loaded: %d valid keys", self.path, store.valid)

    def lookup(self, key: str) -> ApiKey | None:
        self._refresh()
        return self._store.lookup(key)
