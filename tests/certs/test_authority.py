"""The pure certificate core: names, usages, lifetimes, SANs, and verification as a TLS peer does it."""

from __future__ import annotations

import datetime as dt
import ipaddress
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from certs.authority import (
    BACKDATE,
    Usage,
    build_ca,
    build_leaf,
    default_usage,
    key_matches,
    new_key,
    parse_san,
    role_of,
)
from certs.errors import CertError
from certs.verify import verify_client, verify_server

NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
DAY = dt.timedelta(days=1)
SANS = [parse_san("DNS:localhost"), parse_san("IP:127.0.0.1")]
CA = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


@pytest.fixture(scope="module")
def ca() -> CA:
    key = new_key()
    return build_ca(key, NOW, days=30), key


def leaf(ca: CA, name: str, **kw: Any) -> x509.Certificate:
    cert, key = ca
    return build_leaf(cert, key, new_key(), name, SANS, NOW, **kw)


def eku(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_ca_is_a_short_lived_pathlen0_ca(ca: CA) -> None:
    cert, _ = ca
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign
    assert cert.not_valid_before_utc == NOW - BACKDATE
    assert cert.not_valid_after_utc == NOW + 30 * DAY
    assert cert.signature_hash_algorithm is not None and cert.signature_hash_algorithm.name == "sha256"


@pytest.mark.parametrize(
    ("name", "role", "usage", "ekus"),
    [
        ("envoy-edge", "envoy-edge", Usage.BOTH, {"server", "client"}),
        ("extproc", "extproc", Usage.BOTH, {"server", "client"}),
        ("agent-node7", "agent", Usage.BOTH, {"server", "client"}),
        ("kvcached", "kvcached", Usage.BOTH, {"server", "client"}),
        ("engine", "engine", Usage.SERVER, {"server"}),
        ("engine-gpu3", "engine", Usage.SERVER, {"server"}),
        ("oidc", "oidc", Usage.SERVER, {"server"}),
        ("operator-bob", "operator", Usage.CLIENT, {"client"}),
        ("client-alice", "client", Usage.CLIENT, {"client"}),
    ],
)
def test_roles_and_default_usages(ca: CA, name: str, role: str, usage: Usage, ekus: set[str]) -> None:
    assert role_of(name) == role and default_usage(name) is usage
    oids = {"server": ExtendedKeyUsageOID.SERVER_AUTH, "client": ExtendedKeyUsageOID.CLIENT_AUTH}
    assert eku(leaf(ca, name)) == {oids[e] for e in ekus}


@pytest.mark.parametrize("name", ["client", "Engine", "web", "engine_1", "../ca", "client-", "x" * 80])
def test_bad_names_rejected(name: str) -> None:
    with pytest.raises(CertError, match="bad service name"):
        role_of(name)


def test_leaf_sans_identity_and_constraints(ca: CA) -> None:
    cert = leaf(ca, "extproc")
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "extproc"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://kvgate.local/extproc"]
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    assert cert.issuer == ca[0].subject
    assert cert.not_valid_after_utc == NOW + 7 * DAY


def test_leaf_never_outlives_its_ca(ca: CA) -> None:
    assert leaf(ca, "engine", days=90).not_valid_after_utc == ca[0].not_valid_after_utc
    with pytest.raises(CertError, match="CA expired"):
        build_leaf(ca[0], ca[1], new_key(), "engine", SANS, NOW + 31 * DAY)
    with pytest.raises(CertError, match="lifetime"):
        leaf(ca, "engine", days=0)


@pytest.mark.parametrize("text", ["localhost", "DNS:", "DNS:bad host", "IP:300.1.1.1", "EMAIL:a@b"])
def test_bad_sans_rejected(text: str) -> None:
    with pytest.raises(CertError, match="bad SAN"):
        parse_san(text)


def test_chain_verifies_for_its_usage_only(ca: CA) -> None:
    server, client, both = leaf(ca, "engine"), leaf(ca, "client-alice"), leaf(ca, "envoy-edge")
    verify_server(server, ca[0], "127.0.0.1", NOW)
    verify_server(both, ca[0], "localhost", NOW)
    verify_client(client, ca[0], NOW)
    verify_client(both, ca[0], NOW)
    with pytest.raises(CertError, match="EKU"):
        verify_server(client, ca[0], "127.0.0.1", NOW)
    with pytest.raises(CertError, match="EKU"):
        verify_client(server, ca[0], NOW)
    with pytest.raises(CertError):
        verify_server(server, ca[0], "example.com", NOW)  # not a name the leaf carries


def test_expired_and_foreign_certificates_rejected(ca: CA) -> None:
    cert = leaf(ca, "engine", days=1)
    with pytest.raises(CertError):
        verify_server(cert, ca[0], "127.0.0.1", NOW + 2 * DAY)
    with pytest.raises(CertError):
        verify_server(cert, ca[0], "127.0.0.1", NOW - DAY)  # not yet valid
    other_key = new_key()
    other = build_ca(other_key, NOW)
    foreign = build_leaf(other, other_key, new_key(), "engine", SANS, NOW)
    with pytest.raises(CertError):
        verify_server(foreign, ca[0], "127.0.0.1", NOW)


def test_key_matches_only_its_own_certificate(ca: CA) -> None:
    key = new_key()
    cert = build_leaf(ca[0], ca[1], key, "engine", SANS, NOW)
    assert key_matches(cert, key) and not key_matches(cert, new_key())
