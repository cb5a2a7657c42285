"""Chain verification as a TLS peer does it, at a given ``now`` (cryptography's X.509 verifier).

A server leaf is checked for the address a client dials (``DNS:`` or ``IP:`` name) and the
``serverAuth`` usage; a client leaf for ``clientAuth``. Both must chain to the given CA and be within
their validity period at ``now``. The web-PKI profile it applies is stricter than Envoy's or
OpenSSL's checks, so a leaf that passes here is accepted by both.
"""

from __future__ import annotations

import datetime as dt
import ipaddress

from cryptography import x509
from cryptography.x509 import DNSName, IPAddress
from cryptography.x509 import verification as v

from certs.errors import CertError


def verify_server(leaf: x509.Certificate, ca: x509.Certificate, host: str, now: dt.datetime) -> None:
    """:class:`CertError` unless ``leaf`` is a valid server certificate for ``host`` from ``ca``."""
    subject: v.Subject
    try:
        subject = IPAddress(ipaddress.ip_address(host))
    except ValueError:
        subject = DNSName(host)
    verifier = v.PolicyBuilder().store(v.Store([ca])).time(now).max_chain_depth(1)
    try:
        verifier.build_server_verifier(subject).verify(leaf, [])
    except v.VerificationError as exc:
        raise CertError(f"server certificate rejected for {host}: {exc}") from exc


def verify_client(leaf: x509.Certificate, ca: x509.Certificate, now: dt.datetime) -> None:
    """:class:`CertError` unless ``leaf`` is a valid client certificate from ``ca``."""
    verifier = v.PolicyBuilder().store(v.Store([ca])).time(now).max_chain_depth(1)
    try:
        verifier.build_client_verifier().verify(leaf, [])
    except v.VerificationError as exc:
        raise CertError(f"client certificate rejected: {exc}") from exc
