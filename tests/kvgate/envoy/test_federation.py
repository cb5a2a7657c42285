"""The federation parts of the Envoy bootstrap: the federation listener (mTLS, peers' identities only,
keeps the peer's hop, tenant and salted flag), the OpenAI listener stripping them, a peer's refusal
retried on the local pick, the forwarding transport socket
selected by EDS host metadata, and Envoy itself accepting the result (plain and secure profiles)."""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2

from certs.store import dev_bundle
from contracts.epp import TENANT_HEADER
from contracts.federation import CLIENT_SALT_HEADER, HOP_HEADER, PEER_HEADER, REFUSED_HEADER, SALTED_HEADER
from extproc.admission.tenants import RequestRate
from extproc.xds.eds import PEER_IDENTITY_KEY, PEER_MATCH_KEY, SOCKET_MATCH_NS, snapshot
from kvgate.envoy.auth import EdgeAuth
from kvgate.envoy.bootstrap import CREDENTIAL_HEADERS, EnvoyParams, render
from kvgate.envoy.federation import EnvoyFederation
from kvgate.envoy.tls import EnvoyTls, write_sds
from tests.kvgate.envoy.test_bootstrap import validate


def fed(tmp_path: Path) -> EnvoyFederation:
    bundle = dev_bundle(tmp_path / "fed", ["federation-a"], dt.datetime.now(dt.UTC))
    leaf = bundle["federation-a"]
    return EnvoyFederation(cert=str(leaf.cert), key=str(leaf.key), ca=str(leaf.ca), listen_port=10443)


def listeners(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {li["name"]: li for li in cfg["static_resources"]["listeners"]}


def stripped(listener: dict[str, Any]) -> set[str]:
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return {m["remove"] for m in hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]}


def test_the_rendered_federation_parts(tmp_path: Path) -> None:
    cfg = render(EnvoyParams(federation=fed(tmp_path)))
    by_name = listeners(cfg)
    openai, peer = by_name["openai"], by_name["federation"]
    assert {HOP_HEADER, PEER_HEADER, TENANT_HEADER, SALTED_HEADER, CLIENT_SALT_HEADER} <= stripped(openai)
    assert not {HOP_HEADER, TENANT_HEADER, SALTED_HEADER, CLIENT_SALT_HEADER} & stripped(peer)
    assert PEER_HEADER in stripped(peer)
    tls = peer["filter_chains"][0]["transport_socket"]["typed_config"]
    assert tls["require_client_certificate"] is True
    san = tls["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"]
    assert san == [{"san_type": "URI", "matcher": {"prefix": "spiffe://kvgate.local/federation-"}}]
    assert peer["address"]["socket_address"]["port_value"] == 10443
    for listener in (openai, peer):
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
        assert ext_proc["typed_config"]["request_attributes"] == ["connection.uri_san_peer_certificate"]
    engines = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "kvgate_engines")
    (match,) = engines["transport_socket_matches"]
    assert match["match"] == {PEER_MATCH_KEY: True}


def test_eds_marks_peer_ingresses_for_the_federation_socket() -> None:
    snap = snapshot((("10.0.0.1:8000", 1),), {"10.9.0.1:10443": "spiffe://kvgate.local/federation-b"})
    cla = endpoint_pb2.ClusterLoadAssignment()
    snap.resource.Unpack(cla)
    hosts = {
        f"{h.endpoint.address.socket_address.address}:{h.endpoint.address.socket_address.port_value}": h
        for h in cla.endpoints[0].lb_endpoints
    }
    assert set(hosts) == {"10.0.0.1:8000", "10.9.0.1:10443"}
    peer_meta = hosts["10.9.0.1:10443"].metadata.filter_metadata[SOCKET_MATCH_NS]
    assert peer_meta.fields[PEER_MATCH_KEY].bool_value is True
    assert peer_meta.fields[PEER_IDENTITY_KEY].string_value == "spiffe://kvgate.local/federation-b"
    assert SOCKET_MATCH_NS not in hosts["10.0.0.1:8000"].metadata.filter_metadata


def test_an_injected_delay_is_a_fault_filter_on_the_federation_listener_only(tmp_path: Path) -> None:
    cfg = render(EnvoyParams(federation=dataclasses.replace(fed(tmp_path), inject_delay_ms=20)))
    by_name = listeners(cfg)
    first = by_name["federation"]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0]
    assert first["name"] == "envoy.filters.http.fault"
    assert first["typed_config"]["delay"]["fixed_delay"] == "0.020000s"
    openai = by_name["openai"]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    assert all(f["name"] != "envoy.filters.http.fault" for f in openai)
    validate(tmp_path, EnvoyParams(federation=dataclasses.replace(fed(tmp_path), inject_delay_ms=20)))


def test_a_forward_to_a_linked_peer_requires_exactly_its_identity(tmp_path: Path) -> None:
    """One upstream socket per link known at render time, requiring that link's exact SAN (selected by
    the identity EDS puts on the peer's host), before the prefix one for a link known only from etcd."""
    b, c = "spiffe://kvgate.local/federation-b", "spiffe://kvgate.local/federation-c"
    params = EnvoyParams(federation=dataclasses.replace(fed(tmp_path), identities=(b, c)))
    cfg = render(params)
    engines = next(x for x in cfg["static_resources"]["clusters"] if x["name"] == "kvgate_engines")
    got = [
        (
            m["match"],
            m["transport_socket"]["typed_config"]["common_tls_context"]["validation_context"][
                "match_typed_subject_alt_names"
            ],
        )
        for m in engines["transport_socket_matches"]
    ]
    assert got == [
        ({PEER_MATCH_KEY: True, PEER_IDENTITY_KEY: b}, [{"san_type": "URI", "matcher": {"exact": b}}]),
        ({PEER_MATCH_KEY: True, PEER_IDENTITY_KEY: c}, [{"san_type": "URI", "matcher": {"exact": c}}]),
        (
            {PEER_MATCH_KEY: True},
            [{"san_type": "URI", "matcher": {"prefix": "spiffe://kvgate.local/federation-"}}],
        ),
    ]
    validate(tmp_path, params)


@pytest.mark.parametrize("secure", [False, True])
def test_envoy_accepts_it(tmp_path: Path, secure: bool) -> None:
    tls = None
    if secure:
        certs = tmp_path / "certs"
        dev_bundle(certs, ["envoy-edge"], dt.datetime.now(dt.UTC))
        tls = EnvoyTls(certs_dir=str(certs))
        write_sds(tls)
    validate(tmp_path, EnvoyParams(tls=tls, federation=fed(tmp_path)))


def _retry(listener: dict[str, Any]) -> dict[str, Any]:
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    decided, default = [
        r
        for v in hcm["route_config"]["virtual_hosts"]
        for r in v["routes"]
        if "retry_policy" in r.get("route", {})
    ]
    policy: dict[str, Any] = decided["route"]["retry_policy"]
    assert default["route"]["retry_policy"] == policy
    return policy


def test_a_peers_refusal_is_retried_on_the_local_pick_and_its_rate_limit_says_so(tmp_path: Path) -> None:
    """With ``[auth]``: the OpenAI listener's engine route retries on the refusal header (the try goes on to
    the local pick); the federation listener's per-tenant rate limit marks its 429 as a refusal."""
    edge = EdgeAuth(jwt=None, rates=(("acme", RequestRate(5.0, 5)),), read_usage=False)
    params = EnvoyParams(auth=edge, federation=fed(tmp_path))
    by_name = listeners(render(params))
    retry = _retry(by_name["openai"])
    assert {"retriable-status-codes", "retriable-headers"} <= set(retry["retry_on"].split(","))
    assert retry["retriable_headers"] == [{"name": REFUSED_HEADER, "present_match": True}]
    hcm = by_name["federation"]["filter_chains"][0]["filters"][0]["typed_config"]
    (limit,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.local_ratelimit"]
    added = {
        h["header"]["key"]: h["header"]["value"] for h in limit["typed_config"]["response_headers_to_add"]
    }
    assert added[REFUSED_HEADER] == "rate_limited"
    openai = by_name["openai"]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    (public,) = [f for f in openai if f["name"] == "envoy.filters.http.local_ratelimit"]
    assert REFUSED_HEADER not in {
        h["header"]["key"] for h in public["typed_config"]["response_headers_to_add"]
    }
    # a peer refusing our tenants altogether reaches the failed-try log (with the refusal's code)
    router = next(f for f in openai if f["name"] == "envoy.filters.http.router")
    for logger in router["typed_config"]["upstream_log"]:
        assert logger["typed_config"]["additional_response_headers_to_log"] == [REFUSED_HEADER]
        statuses = [
            f["status_code_filter"]["comparison"]["value"]["default_value"]
            for f in logger["filter"]["or_filter"]["filters"]
            if "status_code_filter" in f
        ]
        assert statuses == [503, 401]
    # what goes to a peer's ingress takes the engine route: no credential header ever leaves the cluster
    route_config = by_name["openai"]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]
    assert set(CREDENTIAL_HEADERS) <= set(route_config["request_headers_to_remove"])
    validate(tmp_path, params)
