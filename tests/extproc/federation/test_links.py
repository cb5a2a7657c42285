"""Federation links: config parsing and validation, and the etcd overlay keeping the last good link."""

from __future__ import annotations

import json
from typing import Any

import pytest

from contracts.errors import ConfigError
from extproc.config import parse_config
from extproc.federation.links import LinkTable, parse_federation, parse_link

LINK: dict[str, Any] = {
    "cluster": "b",
    "ingress": "127.0.0.1:10443",
    "service": "127.0.0.1:9500",
    "identity": "spiffe://kvgate.local/federation-b",
    "rtt_ms": 20,
    "egress_requests_per_s": 50,
    "egress_bytes_per_s": 1e7,
}


def test_parse_a_whole_section() -> None:
    config = parse_federation({"cluster": "a", "ttl_s": 2.0, "links": [LINK]})
    assert config.cluster == "a" and config.ttl_s == 2.0
    (link,) = config.links
    assert link.rtt_ms == 20.0 and link.identity.endswith("federation-b")
    assert config.forward_first_byte_s == 60.0  # a hung peer's non-streamed try: a minute, not request_s
    assert parse_federation({"cluster": "a", "forward_first_byte_s": 5}).forward_first_byte_s == 5.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rtt_ms": -1}, "rtt_ms"),
        ({"rtt_ms": 20_000}, "rtt_ms"),
        ({"ingress": "nope"}, "ingress"),
        ({"identity": "https://x"}, "identity"),
        ({"egress_bytes_per_s": "lots"}, "egress_bytes_per_s"),
        ({"cluster": "B!"}, "cluster"),
        ({"colour": "red"}, "unknown key"),
    ],
)
def test_bad_link_values_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_link({**LINK, **change}, "federation.links[0]")


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"cluster": "a", "links": [LINK, LINK]}, "two links"),
        ({"cluster": "b", "links": [LINK]}, "itself"),
        ({"cluster": "a", "ttl_s": 0.5, "refresh_s": 1.0}, "ttl_s"),
        ({"cluster": "a", "tls_cert": "c.pem"}, "set all of"),
        ({"links": []}, "cluster: required"),
        ({"cluster": "a", "forward_first_byte_s": -1}, "forward_first_byte_s"),
    ],
)
def test_bad_sections_are_refused(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_federation(section)


def test_etcd_overlay_validates_and_keeps_the_last_good_link() -> None:
    table = LinkTable(parse_federation({"cluster": "a", "links": [LINK]}))
    assert table.put("b", json.dumps({**LINK, "rtt_ms": 80}).encode()) is None
    assert table.get("b") is not None and table.get("b").rtt_ms == 80  # type: ignore[union-attr]
    version = table.version
    assert "rtt_ms" in (table.put("b", json.dumps({**LINK, "rtt_ms": -5}).encode()) or "")
    assert "not JSON" in (table.put("b", b"{") or "")
    assert "must equal" in (table.put("c", json.dumps(LINK).encode()) or "")
    assert table.get("b").rtt_ms == 80 and table.version == version  # type: ignore[union-attr]
    # a new link by key name alone
    assert (
        table.put(
            "c",
            json.dumps(
                {k: v for k, v in LINK.items() if k != "cluster"}
                | {"identity": "spiffe://kvgate.local/federation-c"}
            ).encode(),
        )
        is None
    )
    assert set(table.links()) == {"b", "c"}
    assert table.by_identity("spiffe://kvgate.local/federation-c").cluster == "c"  # type: ignore[union-attr]
    table.delete("b")  # the file's link is back
    assert table.get("b").rtt_ms == 20  # type: ignore[union-attr]
    assert "itself" in (table.put("a", json.dumps({**LINK, "cluster": "a"}).encode()) or "")


@pytest.mark.parametrize(
    "secure",
    [
        {"extproc": {"tls_cert": "x.pem", "tls_key": "x.key", "tls_client_ca": "ca.pem"}},
        {"feeds": {"tls_ca": "ca.pem", "tls_cert": "x.pem", "tls_key": "x.key"}},
    ],
)
def test_federation_without_tls_is_refused_where_the_other_hops_use_tls(secure: dict[str, Any]) -> None:
    fed_section = {"cluster": "a", "listen": "127.0.0.1:0"}
    models = [{"name": "m", "gguf": "smollm2"}]
    parse_config({"models": models, "federation": fed_section})  # the plain profile: accepted
    with pytest.raises(ConfigError, match="federation: tls_cert, tls_key and tls_ca are required"):
        parse_config({"models": models, "federation": fed_section, **secure})
    tls = {"tls_cert": "f.pem", "tls_key": "f.key", "tls_ca": "ca.pem"}
    parse_config({"models": models, "federation": {**fed_section, **tls}, **secure})
