"""The certificate directory: file modes, atomic replacement, CA reuse, and ``kvgate certs``."""

from __future__ import annotations

import datetime as dt
import os
import stat
from pathlib import Path

import pytest
from cryptography import x509

from certs.authority import key_matches, load_key_pem
from certs.errors import CertError
from certs.store import ca_paths, dev_bundle, init_ca, issue, load_ca, write_atomic
from certs.verify import verify_client, verify_server
from kvgate.cli import main as kvgate

NOW = dt.datetime.now(dt.UTC)
SANS = ["DNS:localhost", "IP:127.0.0.1"]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def cert_of(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_keys_are_0600_even_with_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        files = dev_bundle(tmp_path / "d", ["envoy-edge", "client-a"], NOW)
    finally:
        os.umask(old)
    assert mode(tmp_path / "d") == 0o700
    assert mode(ca_paths(tmp_path / "d")[1]) == 0o600
    for leaf in files.values():
        assert mode(leaf.key) == 0o600 and mode(leaf.cert) == 0o644
        assert leaf.key.name.endswith(".key") and leaf.cert.name.endswith(".pem")  # git-ignored names
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        "ca.key",
        "ca.pem",
        "client-a.key",
        "client-a.pem",
        "envoy-edge.key",
        "envoy-edge.pem",
    ]  # no temporary files left behind


def test_write_atomic_replaces_and_creates_new_inode(tmp_path: Path) -> None:
    path = tmp_path / "x.key"
    write_atomic(path, b"one", 0o600)
    inode = path.stat().st_ino
    write_atomic(path, b"two", 0o600)
    assert path.read_bytes() == b"two" and path.stat().st_ino != inode and mode(path) == 0o600
    with pytest.raises(CertError, match="cannot write"):
        write_atomic(tmp_path / "missing" / "y.pem", b"z", 0o644)


def test_issue_chains_to_the_ca_and_rotation_changes_key_and_serial(tmp_path: Path) -> None:
    init_ca(tmp_path, NOW)
    ca, _ = load_ca(tmp_path)
    first = issue(tmp_path, "envoy-edge", SANS, NOW)
    cert1, key1 = cert_of(first.cert), first.key.read_bytes()
    verify_server(cert1, ca, "127.0.0.1", NOW)
    verify_client(cert1, ca, NOW)
    second = issue(tmp_path, "envoy-edge", SANS, NOW)
    cert2 = cert_of(second.cert)
    assert cert2.serial_number != cert1.serial_number and second.key.read_bytes() != key1
    assert key_matches(cert2, load_key_pem(second.key.read_bytes(), "key"))


def test_init_refuses_to_replace_a_ca_without_force(tmp_path: Path) -> None:
    init_ca(tmp_path, NOW)
    with pytest.raises(CertError, match="--force"):
        init_ca(tmp_path, NOW)
    before = ca_paths(tmp_path)[0].read_bytes()
    init_ca(tmp_path, NOW, force=True)
    assert ca_paths(tmp_path)[0].read_bytes() != before


def test_issue_without_a_ca_fails_cleanly(tmp_path: Path) -> None:
    with pytest.raises(CertError, match="cannot read"):
        issue(tmp_path, "engine", SANS, NOW)


def test_dev_bundle_keeps_a_ca_that_outlives_the_leaves(tmp_path: Path) -> None:
    dev_bundle(tmp_path, ["engine"], NOW)
    ca = ca_paths(tmp_path)[0].read_bytes()
    dev_bundle(tmp_path, ["engine"], NOW + dt.timedelta(days=10))
    assert ca_paths(tmp_path)[0].read_bytes() == ca
    dev_bundle(tmp_path, ["engine"], NOW + dt.timedelta(days=25))  # 25 + 7 > 30: a new CA
    assert ca_paths(tmp_path)[0].read_bytes() != ca


def test_cli_init_and_issue(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "pki")
    assert kvgate(["certs", "init", "--dir", d, "--days", "10"]) == 0
    assert kvgate(["certs", "init", "--dir", d]) == 1  # exists, no --force
    argv = ["certs", "issue", "--dir", d, "--name", "client-bob", "--san", "DNS:bob.local", "--days", "2"]
    assert kvgate([*argv, "--both"]) == 0
    out = capsys.readouterr().out
    assert "client-bob.pem" in out and "mode 0600" in out and "BEGIN" not in out  # never prints key material
    cert = cert_of(tmp_path / "pki" / "client-bob.pem")
    assert cert.not_valid_after_utc - cert.not_valid_before_utc <= dt.timedelta(days=2, minutes=5)
    ekus = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert len(ekus) == 2
    for bad in (["--name", "web", "--san", "DNS:x"], ["--name", "engine", "--san", "nonsense"]):
        with pytest.raises(SystemExit) as exited:  # bad arguments: usage, exit 2 (the module's docstring)
            kvgate(["certs", "issue", "--dir", d, *bad])
        assert exited.value.code == 2
    with pytest.raises(SystemExit):
        kvgate(["certs", "issue", "--dir", d, "--name", "engine", "--client", "--server"])
