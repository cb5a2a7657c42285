"""runtime.identity: identity URIs read from certificates as ssl and cryptography present them."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509

from certs.store import dev_bundle
from runtime.identity import certificate_uris, hop_callers, peercert_uris


def test_peercert_uris_reads_the_uri_sans_of_getpeercert() -> None:
    peercert = {
        "subject": ((("commonName", "extproc"),),),
        "subjectAltName": (
            ("DNS", "localhost"),
            ("IP Address", "127.0.0.1"),
            ("URI", "spiffe://kvgate.local/extproc"),
        ),
    }
    assert peercert_uris(peercert) == ["spiffe://kvgate.local/extproc"]
    assert peercert_uris({"subject": ()}) == []
    assert peercert_uris({}) == [] and peercert_uris(None) == []


def test_certificate_uris_of_a_dev_leaf(tmp_path: Path) -> None:
    leaf = dev_bundle(tmp_path, ["kvcached-node-0"], dt.datetime.now(dt.UTC))["kvcached-node-0"]
    cert = x509.load_pem_x509_certificate(leaf.cert.read_bytes())
    assert certificate_uris(cert) == ["spiffe://kvgate.local/kvcached-node-0"]
    ca = x509.load_pem_x509_certificate(leaf.ca.read_bytes())
    assert certificate_uris(ca) == []  # no SAN extension


def test_hop_callers() -> None:
    feed = hop_callers("feed")
    assert feed(["spiffe://kvgate.local/extproc-1"]) and not feed(["spiffe://kvgate.local/agent"])
    with pytest.raises(KeyError):
        hop_callers("nowhere")
