"""A certificate directory: the dev CA and per-service leaves as files, written safely.

Layout of a directory ``D`` (mode 0700)::

    D/ca.pem  D/ca.key                 the dev CA (``init_ca``)
    D/<name>.pem  D/<name>.key         one leaf per service (``issue``), e.g. envoy-edge, extproc

Private keys are created with mode 0600 from the start (``os.open`` with ``O_CREAT | O_EXCL``), so they
are never readable by others, not even briefly. Every file is written to a temporary file in the same
directory and renamed over the old one, so a reader (Envoy's directory watch, the ext_proc's reloader)
sees either the old or the new file, never half of one. On rotation the key is replaced first, then the
certificate: a reader that catches the pair in between finds a mismatched pair, rejects it and keeps
serving the old one until the certificate lands.
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from certs.authority import (
    CA_DAYS,
    LEAF_DAYS,
    Usage,
    build_ca,
    build_leaf,
    cert_pem,
    key_pem,
    load_cert_pem,
    load_key_pem,
    new_key,
    parse_san,
    role_of,
)
from certs.errors import CertError

KEY_MODE = 0o600
CERT_MODE = 0o644
DIR_MODE = 0o700
#: Default SANs of ``dev_bundle`` leaves: what a client on this machine dials.
LOCAL_SANS = ("DNS:localhost", "IP:127.0.0.1")


@dataclass(frozen=True, slots=True)
class LeafFiles:
    """Where one service's material lives: its certificate, its key and the CA that signed it."""

    name: str
    cert: Path
    key: Path
    ca: Path


def ca_paths(directory: Path) -> tuple[Path, Path]:
    """``(ca.pem, ca.key)`` of a certificate directory."""
    return directory / "ca.pem", directory / "ca.key"


def leaf_files(directory: Path, name: str) -> LeafFiles:
    """The paths of service ``name``'s files in ``directory`` (whether or not they exist yet)."""
    role_of(name)
    return LeafFiles(name, directory / f"{name}.pem", directory / f"{name}.key", ca_paths(directory)[0])


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` with ``data``: a new file created with ``mode`` (never wider), fsynced, renamed.

    The temporary file keeps ``path``'s suffix (``.key``/``.pem``), so git ignores a leftover one too.
    """
    tmp = path.with_name(f".{path.stem}.{secrets.token_hex(6)}{path.suffix}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(tmp, flags, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CertError(f"cannot write {path}: {exc.strerror}") from exc
    _fsync_dir(path.parent)


def ensure_dir(directory: Path) -> None:
    """Create ``directory`` (mode 0700) if missing."""
    try:
        directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise CertError(f"cannot create {directory}: {exc.strerror}") from exc


def init_ca(directory: Path, now: dt.datetime, *, days: int = CA_DAYS, force: bool = False) -> Path:
    """Mint a new dev CA into ``directory``; returns the CA certificate's path.

    Refuses to replace an existing CA unless ``force`` (every leaf it signed would stop verifying).
    """
    cert_path, key_path = ca_paths(directory)
    if cert_path.exists() and not force:
        raise CertError(f"{cert_path} exists: pass --force to replace the CA (its leaves stop verifying)")
    key = new_key()
    cert = build_ca(key, now, days=days)  # refused (a bad lifetime) before a file is touched
    ensure_dir(directory)
    write_atomic(key_path, key_pem(key), KEY_MODE)
    write_atomic(cert_path, cert_pem(cert), CERT_MODE)
    return cert_path


def load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA certificate and key of ``directory``; :class:`CertError` if absent or unreadable."""
    cert_path, key_path = ca_paths(directory)
    return load_cert_pem(_read(cert_path), str(cert_path)), load_key_pem(_read(key_path), str(key_path))


def issue(
    directory: Path,
    name: str,
    sans: Iterable[str],
    now: dt.datetime,
    *,
    days: int = LEAF_DAYS,
    usage: Usage | None = None,
) -> LeafFiles:
    """Issue (or rotate) service ``name``'s leaf with a fresh key; key replaced first, then cert."""
    files = leaf_files(directory, name)
    names = [parse_san(s) for s in sans]
    ca_cert, ca_key = load_ca(directory)
    key = new_key()
    cert = build_leaf(ca_cert, ca_key, key, name, names, now, days=days, usage=usage)
    write_atomic(files.key, key_pem(key), KEY_MODE)
    write_atomic(files.cert, cert_pem(cert), CERT_MODE)
    return files


def ca_valid_for(directory: Path, now: dt.datetime, days: int) -> bool:
    """Whether ``directory`` holds a readable CA that stays valid ``days`` more days from ``now``."""
    try:
        ca_cert, _ = load_ca(directory)
    except CertError:
        return False
    return (
        ca_cert.not_valid_before_utc <= now and now + dt.timedelta(days=days) <= ca_cert.not_valid_after_utc
    )


def dev_bundle(
    directory: Path,
    services: Iterable[str],
    now: dt.datetime,
    *,
    sans: Iterable[str] = LOCAL_SANS,
    days: int = LEAF_DAYS,
    ca_days: int = CA_DAYS,
) -> dict[str, LeafFiles]:
    """Everything a local secure stack needs, in one go: the CA (kept if it outlives the new leaves,
    minted otherwise) and a fresh leaf per service, each with ``sans`` and its role's default usage."""
    wanted = list(sans)
    if not ca_valid_for(directory, now, days):
        init_ca(directory, now, days=max(ca_days, days), force=True)
    return {name: issue(directory, name, wanted, now, days=days) for name in services}


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CertError(f"cannot read {path}: {exc.strerror}") from exc


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
