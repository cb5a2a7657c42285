"""etcd ``burst/<name>`` records and the credentials they name (extproc/burst/records.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from contracts.errors import ConfigError
from extproc.burst.core import BurstEndpoint
from extproc.burst.records import (
    BurstCredential,
    BurstSink,
    BurstTable,
    check_record,
    parse_credentials,
    parse_record,
)

CRED = BurstCredential("openai", "/etc/kvgate/openai.key", frozenset({"api.openai.com"}), "/etc/ca.pem")
CREDS = {CRED.name: CRED}


def rec(**changes: Any) -> dict[str, Any]:
    return {"host": "api.openai.com", "credential": "openai", "models": {"small": "gpt-4o-mini"}, **changes}


def test_a_record_takes_its_key_file_and_ca_from_the_declared_credential() -> None:
    e = parse_record(rec(port=8443), "hosted", CREDS)
    assert (e.name, e.host, e.port, dict(e.models)) == (
        "hosted",
        "api.openai.com",
        8443,
        {"small": "gpt-4o-mini"},
    )
    assert (e.api_key_file, e.ca_file, e.credential) == (CRED.api_key_file, CRED.ca_file, "openai")
    assert e.header_value == "kvgate_burst_hosted"  # the CDS route's cluster header


@pytest.mark.parametrize(
    ("doc", "name", "reason"),
    [
        (rec(credential="other"), "hosted", "not declared"),
        (rec(host="evil.example.com"), "hosted", "may not be sent to"),
        (rec(api_key="sk-x"), "hosted", "unknown"),
        (rec(api_key_file="/etc/shadow"), "hosted", "unknown"),
        (rec(ca_file="/tmp/ca.pem"), "hosted", "unknown"),
        (rec(host="10.0.0.1"), "hosted", "DNS name"),
        (rec(port=70000), "hosted", "port"),
        (rec(models={}), "hosted", "models"),
        (rec(engine="vllm"), "hosted", "openai_compat"),
        (rec(name="other"), "hosted", "must be 'hosted'"),
        (rec(), "Bad Name", "lowercase"),
        ([1], "hosted", "expected a table"),
    ],
)
def test_bad_records_are_refused_with_the_field(doc: object, name: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        parse_record(doc, name, CREDS)


def test_credentials_from_the_gateway_config() -> None:
    raw = {"openai": {"api_key_file": "/k", "hosts": ["api.openai.com"], "ca_file": "/ca"}}
    (c,) = parse_credentials(raw)
    assert c == BurstCredential("openai", "/k", frozenset({"api.openai.com"}), "/ca")
    assert c.secret == "kvgate_burst_credential_openai"
    assert parse_credentials(None) == ()
    for bad in (
        {"openai": {"api_key_file": "/k"}},  # hosts required
        {"openai": {"api_key_file": "/k", "hosts": []}},
        {"openai": {"api_key_file": "/k", "hosts": ["1.2.3.4"]}},
        {"openai": {"api_key": "sk", "hosts": ["a.b"]}},
        {"Bad": {"api_key_file": "/k", "hosts": ["a.b"]}},
    ):
        with pytest.raises(ConfigError):
            parse_credentials(bad)


def test_the_cli_check_without_a_gateway_config_checks_the_shape_only() -> None:
    assert check_record(json.dumps(rec(credential="any")).encode(), "hosted", None).credential == "any"
    with pytest.raises(ConfigError, match="unknown"):
        check_record(json.dumps(rec(api_key="sk")).encode(), "hosted", None)
    with pytest.raises(ConfigError, match="credential: required"):
        check_record(json.dumps({"host": "a.b", "models": {"m": "n"}}).encode(), "hosted", None)
    with pytest.raises(ConfigError, match="not JSON"):
        check_record(b"{", "hosted", None)
    with pytest.raises(ConfigError, match="not declared"):
        check_record(json.dumps(rec(credential="other")).encode(), "hosted", CREDS)


def test_the_table_refuses_a_bad_record_and_keeps_the_last_good_one() -> None:
    static = BurstEndpoint("fixed", "api.other.com", {"big": "x"}, "/fixed.key")
    table = BurstTable((static,), (CRED,))
    changes: list[int] = []
    sink = BurstSink(table, lambda: changes.append(table.version))
    assert sink.put("hosted", json.dumps(rec()).encode(), backlog=True)
    good = table.dynamic()
    assert [e.name for e in table.endpoints] == ["fixed", "hosted"] and changes == [1]
    assert not sink.put("hosted", json.dumps(rec(host="evil.example.com")).encode(), backlog=False)
    assert not sink.put("hosted", b"not json", backlog=False)
    assert table.dynamic() == good and table.refused == 2 and changes == [1]
    assert not sink.put("hosted", json.dumps(rec()).encode(), backlog=False)  # the same: no change
    # Neither a static endpoint's name nor a model another endpoint bursts.
    assert table.put("fixed", json.dumps(rec(models={"other": "y"})).encode()) is not None
    assert "already bursts" in str(table.put("second", json.dumps(rec(models={"big": "y"})).encode()))
    assert "already bursts" in str(table.put("second", json.dumps(rec()).encode()))
    assert sink.delete("hosted") and table.endpoints == (static,) and changes == [1, 2]
    assert not sink.delete("hosted")
