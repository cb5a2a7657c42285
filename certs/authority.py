"""Certificate building, sans IO: a dev CA and leaf certificates from given keys and a given ``now``.

Every certificate is ECDSA P-256 / SHA-256. The CA is ``CA:TRUE, pathlen:0`` (it signs leaves only);
leaves are ``CA:FALSE`` with ``digitalSignature`` key usage, the extended key usages of their role and
the subject alternative names asked for, plus ``DNS:<name>`` (the server name Envoy sends as SNI) and
an identity URI ``spiffe://kvgate.local/<name>`` that Envoy matches on (a service identity that does
not depend on which address the service has).

Service names are ``<role>`` or ``<role>-<suffix>``; the role fixes the default usage:

=============  =========================================================
role           default extended key usage
=============  =========================================================
envoy-edge     server + client (listener; client of ext_proc and engines)
extproc        server + client (gRPC server; client of engine metrics)
agent          server + client
kvcached       server + client (QUIC peers authenticate each other)
engine         server
oidc           server (the dev OIDC issuer's JWKS endpoint)
operator       client (an operator's tools: ``POST /drain`` on an agent, ``kvgate policy``)
client         client (API clients; suffix required: ``client-alice``)
etcd           server + client (an etcd member; it dials itself with it under client-cert auth)
root           client (etcd's root user: ``kvgate etcd bootstrap``; :mod:`kvgate.etcdsec`)
federation     server + client (a cluster's federation identity, ``federation-<cluster>``: its gateways'
               summary service and stream, its Envoy's forwarding; extproc/federation)
=============  =========================================================
"""

from __future__ import annotations

import datetime as dt
import enum
import ipaddress
import re

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certs.errors import CertError

#: Trust domain of the identity URI every leaf carries.
TRUST_DOMAIN = "kvgate.local"
#: Certificates start this long before ``now``, so a peer whose clock lags a little accepts them.
BACKDATE = dt.timedelta(minutes=5)
CA_DAYS = 30
LEAF_DAYS = 7

_ROLES = (
    *("envoy-edge", "extproc", "agent", "kvcached", "engine", "oidc", "operator", "etcd", "root"),
    "federation",
    "client",
)
_NAME = re.compile(rf"^({'|'.join(_ROLES)})(-[a-z0-9][a-z0-9-]{{0,39}})?$")
#: The service names :func:`role_of` takes, in words (``kvgate certs issue --help``, its errors).
NAMES_TEXT = (
    f"{', '.join(_ROLES[:-1])} or client-NAME, optionally with a -suffix of lowercase letters, digits "
    "and dashes"
)


class Usage(enum.Enum):
    """Which side of a TLS handshake a leaf may take (its extended key usages)."""

    SERVER = "server"
    CLIENT = "client"
    BOTH = "both"

    def oids(self) -> list[x509.ObjectIdentifier]:
        server = [ExtendedKeyUsageOID.SERVER_AUTH] if self is not Usage.CLIENT else []
        client = [ExtendedKeyUsageOID.CLIENT_AUTH] if self is not Usage.SERVER else []
        return server + client


def role_of(name: str) -> str:
    """The role of a service name (``engine-gpu3`` -> ``engine``); :class:`CertError` if malformed."""
    m = _NAME.match(name)
    if m is None or (m.group(1) == "client" and m.group(2) is None):
        raise CertError(f"bad service name {name!r}: expected one of {NAMES_TEXT}")
    return m.group(1)


def default_usage(name: str) -> Usage:
    """The usage a leaf of this service gets when none is asked for (table in the module docstring)."""
    role = role_of(name)
    usages = {
        "engine": Usage.SERVER,
        "oidc": Usage.SERVER,
        "operator": Usage.CLIENT,
        "root": Usage.CLIENT,
        "client": Usage.CLIENT,
    }
    return usages.get(role, Usage.BOTH)


def identity_uri(name: str) -> str:
    """The identity URI SAN of service ``name``: ``spiffe://kvgate.local/<name>``."""
    return f"spiffe://{TRUST_DOMAIN}/{name}"


def parse_san(text: str) -> x509.GeneralName:
    """``DNS:host``, ``IP:addr`` or ``URI:uri`` -> a general name; :class:`CertError` otherwise."""
    kind, sep, value = text.partition(":")
    if not sep or not value:
        raise CertError(f"bad SAN {text!r}: expected DNS:name, IP:address or URI:uri")
    match kind.upper():
        case "DNS":
            if not re.fullmatch(r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", value):
                raise CertError(f"bad SAN {text!r}: not a DNS name")
            return x509.DNSName(value.lower())
        case "IP":
            try:
                return x509.IPAddress(ipaddress.ip_address(value))
            except ValueError as exc:
                raise CertError(f"bad SAN {text!r}: not an IP address") from exc
        case "URI":
            return x509.UniformResourceIdentifier(value)
    raise CertError(f"bad SAN {text!r}: kind must be DNS, IP or URI")


def new_key() -> ec.EllipticCurvePrivateKey:
    """A fresh P-256 private key."""
    return ec.generate_private_key(ec.SECP256R1())


def build_ca(
    key: ec.EllipticCurvePrivateKey,
    now: dt.datetime,
    *,
    days: int = CA_DAYS,
    serial: int | None = None,
) -> x509.Certificate:
    """A self-signed dev CA valid from ``now - BACKDATE`` for ``days`` days; it signs leaves only."""
    check_days(days)
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvgate dev"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"kvgate dev CA {now:%Y-%m-%dT%H:%M:%SZ}"),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(serial if serial is not None else x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
    )
    return builder.sign(key, hashes.SHA256())


def build_leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    leaf_key: ec.EllipticCurvePrivateKey,
    name: str,
    sans: list[x509.GeneralName],
    now: dt.datetime,
    *,
    days: int = LEAF_DAYS,
    usage: Usage | None = None,
    serial: int | None = None,
) -> x509.Certificate:
    """A leaf for service ``name`` signed by the CA, valid ``days`` days from ``now`` (never past the CA).

    SANs are ``sans`` plus ``DNS:<name>`` and the identity URI; ``usage`` defaults to the role's (see
    the module docstring).
    """
    role_of(name)
    check_days(days)
    if now >= ca_cert.not_valid_after_utc:
        raise CertError(f"the CA expired at {ca_cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z: run certs init")
    not_after = min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    identity = x509.UniformResourceIdentifier(identity_uri(name))
    names = [*dict.fromkeys([*sans, x509.DNSName(name), identity])]  # de-duplicated, in order
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvgate dev"),
                    x509.NameAttribute(NameOID.COMMON_NAME, name),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(leaf_key.public_key())
        .serial_number(serial if serial is not None else x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage((usage or default_usage(name)).oids()), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(leaf_key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
    )
    return builder.sign(ca_key, hashes.SHA256())


def key_matches(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> bool:
    """Whether ``key`` is the private half of ``cert``'s public key (a cert/key pair read together)."""
    return cert.public_key() == key.public_key()


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """PKCS#8 PEM, unencrypted (the file holding it is mode 0600)."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_key_pem(data: bytes, where: str) -> ec.EllipticCurvePrivateKey:
    """Parse an unencrypted PEM EC private key; :class:`CertError` naming ``where`` otherwise."""
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise CertError(f"{where}: not an unencrypted PEM private key") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{where}: not an EC private key")
    return key


def load_cert_pem(data: bytes, where: str) -> x509.Certificate:
    """Parse the first PEM certificate of ``data``; :class:`CertError` naming ``where`` otherwise."""
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise CertError(f"{where}: not a PEM certificate") from exc


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def check_days(days: int) -> None:
    """A certificate lifetime in days, 1 to 398 (the CA/Browser Forum's longest); :class:`CertError`
    otherwise."""
    if not 1 <= days <= 398:
        raise CertError(f"lifetime must be 1-398 days, got {days}")
