"""Federation in the Envoy bootstrap (``extproc/federation/README.md``): the forwarding hop and the
listener peers forward to.

* Forwarding is a host of ``kvgate_engines`` like any endpoint: the ext_proc serves each linked peer's
  ingress in that cluster's EDS with the metadata ``envoy.transport_socket_match {kvgate-federation:
  true}`` and puts it first in a forwarded request's destination list, the local pick after it. So a try
  the peer refuses, resets or answers 503 goes on to the local pick (the cluster's retry policy), and the
  failed try reaches the ext_procs' failure log (the peer's health). The matching transport socket is
  mTLS with this cluster's federation certificate (``federation-<cluster>``, its dedicated identity); the
  peer must chain to ``ca`` and carry a ``spiffe://kvgate.local/federation-`` URI SAN.
* The federation listener: the OpenAI listener's filter chain again (ext_proc, routes, logs), on its own
  address, behind TLS that requires a client certificate with such a URI SAN. Envoy hands the verified
  URI to the ext_proc as the request attribute ``connection.uri_san_peer_certificate``; the ext_proc
  believes the hop and tenant headers only when it is a linked cluster's identity. This listener keeps
  the peer's ``x-kvgate-hop``, ``x-kvgate-tenant``, ``x-kvgate-kv-salted`` and ``x-kvgate-client-salt``;
  the OpenAI listener strips
  them all (a client can never make a request look forwarded, nor assert a tenant or a salt).
* ``[auth]``: a forwarded request carries no credentials (the ext_proc and the router remove them); the
  peer admits it as the tenant the linked cluster asserts when its link trusts tenants, else refuses it.
  A refusal of a forwarded request (401/403/429 from the peer's ext_proc, or its ``local_ratelimit``)
  carries ``x-kvgate-federation-refused``; this cluster's engine route retries on that header, so the try
  goes on to the local pick as a 503 would. The failure log also takes 401 tries with that header logged:
  the ext_procs count a peer's ``federation_untrusted`` (its link trusts no tenant of ours) as its failure.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from certs.authority import identity_uri
from contracts.epp import ENGINES_CLUSTER, TENANT_HEADER
from contracts.federation import CLIENT_SALT_HEADER, HOP_HEADER, REFUSED_HEADER, SALTED_HEADER

_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
PEER_ATTRIBUTE = "connection.uri_san_peer_certificate"
MATCH_KEY = "kvgate-federation"
"""Key of the EDS host metadata (``envoy.transport_socket_match``) that selects the federation socket."""
IDENTITY_KEY = "kvgate-federation-identity"
"""Key of the EDS host metadata with the peer's identity URI: selects the socket requiring exactly it."""
LISTENER = "federation"
_ROUTER = "envoy.filters.http.router"
PEER_PREFIX = identity_uri("federation-")


@dataclass(frozen=True, slots=True)
class EnvoyFederation:
    """``listen_host``/``listen_port``: the federation listener; ``cert``/``key``: this cluster's federation
    certificate (presented on that listener and to peers when forwarding); ``ca``: the CA peers chain to."""

    cert: str
    key: str
    ca: str
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    #: The linked clusters' identity URIs known when rendering (the config file's links): a forward to
    #: one of them requires exactly that SAN (the EDS host names its identity); a link known only from
    #: etcd (or with an identity changed there) is checked against the ``federation-`` prefix.
    identities: tuple[str, ...] = ()
    #: Benchmarks only: Envoy's fault filter holds every request arriving on the federation listener this
    #: long (ms), standing in for the round trip between regions; 0: no fault filter.
    inject_delay_ms: float = 0.0


def _tls_context(fed: EnvoyFederation, exact: str | None = None) -> dict[str, Any]:
    matcher = {"exact": exact} if exact is not None else {"prefix": PEER_PREFIX}
    return {
        "tls_certificates": [
            {"certificate_chain": {"filename": fed.cert}, "private_key": {"filename": fed.key}}
        ],
        "validation_context": {
            "trusted_ca": {"filename": fed.ca},
            "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": matcher}],
        },
    }


def _delay(ms: float) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.fault",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
            "delay": {
                "fixed_delay": f"{ms / 1000.0:.6f}s",
                "percentage": {"numerator": 100, "denominator": "HUNDRED"},
            },
        },
    }


def _hcm(listener: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def _engine_retry_policies(hcm: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        route["route"]["retry_policy"]
        for vhost in hcm["route_config"]["virtual_hosts"]
        for route in vhost["routes"]
        if route.get("route", {}).get("cluster") == ENGINES_CLUSTER and "retry_policy" in route["route"]
    ]


def _log_untrusted(logger: dict[str, Any]) -> None:
    """The failure log also takes 401 tries, with the refusal header (the ext_procs keep only a peer's
    :data:`~contracts.federation.UNTRUSTED`)."""
    only = logger.get("filter", {}).get("or_filter", {}).get("filters")
    if only is None:
        return
    status = {
        "comparison": {"op": "EQ", "value": {"default_value": 401, "runtime_key": "kvgate.failed_try.401"}}
    }
    if {"status_code_filter": status} not in only:  # (the loggers may share one filter)
        only.append({"status_code_filter": status})
    logger["typed_config"]["additional_response_headers_to_log"] = [REFUSED_HEADER]


def apply(config: dict[str, Any], fed: EnvoyFederation) -> dict[str, Any]:
    """``config`` (the rendered bootstrap, modified in place) with the federation listener, the forwarding
    transport socket and the header rules above."""
    static = config["static_resources"]
    openai = next(li for li in static["listeners"] if li["name"] == "openai")
    hcm = _hcm(openai)
    for f in hcm["http_filters"]:
        if f["name"] == "envoy.filters.http.ext_proc":
            typed = f["typed_config"]
            typed["request_attributes"] = [*typed.get("request_attributes", []), PEER_ATTRIBUTE]
    peer_listener = copy.deepcopy(openai)
    # The OpenAI listener drops a client's hop, peer or salted header before any filter (the bootstrap's
    # STRIPPED_REQUEST_HEADERS, with or without federation).
    # A peer's refusal of a forwarded request (its trust, tenant, budget or rate) goes on to the local pick.
    for retry in _engine_retry_policies(hcm):  # (routes may share one policy: added once)
        if "retriable-headers" not in retry["retry_on"].split(","):
            retry["retry_on"] = f"{retry['retry_on']},retriable-headers"
        retry["retriable_headers"] = [{"name": REFUSED_HEADER, "present_match": True}]
    # A peer whose link does not trust our tenants (401 UNTRUSTED) reaches the failed-try log (skipped).
    for f in hcm["http_filters"]:
        for logger in f["typed_config"].get("upstream_log", []) if f["name"] == _ROUTER else []:
            _log_untrusted(logger)
    # The federation listener keeps what the linked peer asserts (the ext_proc checks who it is).
    peer_hcm = _hcm(peer_listener)
    peer_hcm["stat_prefix"] = LISTENER
    if fed.inject_delay_ms > 0:
        peer_hcm["http_filters"].insert(0, _delay(fed.inject_delay_ms))
    for f in peer_hcm["http_filters"]:
        if f["name"] == "envoy.filters.http.local_ratelimit":  # a tenant over its rate here: refused
            f["typed_config"]["response_headers_to_add"].append(
                {
                    "header": {"key": REFUSED_HEADER, "value": "rate_limited"},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
            )
    kept = {HOP_HEADER, TENANT_HEADER, SALTED_HEADER, CLIENT_SALT_HEADER}
    mutations = peer_hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    mutations[:] = [m for m in mutations if m["remove"] not in kept]  # (the peer header stays dropped)
    peer_listener["name"] = LISTENER
    peer_listener["address"] = {"socket_address": {"address": fed.listen_host, "port_value": fed.listen_port}}
    downstream = {
        "@type": _TLS + "DownstreamTlsContext",
        "require_client_certificate": True,
        "common_tls_context": {"alpn_protocols": ["h2", "http/1.1"], **_tls_context(fed)},
    }
    peer_listener["filter_chains"][0]["transport_socket"] = {
        "name": "envoy.transport_sockets.tls",
        "typed_config": downstream,
    }
    static["listeners"].append(peer_listener)
    engines = next(c for c in static["clusters"] if c["name"] == ENGINES_CLUSTER)
    # One socket per link known here, requiring exactly its identity (first match wins), then the
    # prefix for a link known only from etcd.
    exact: list[tuple[dict[str, Any], str | None]] = [
        ({MATCH_KEY: True, IDENTITY_KEY: uri}, uri) for uri in dict.fromkeys(fed.identities)
    ]
    engines["transport_socket_matches"] = [
        {
            "name": f"{LISTENER}-{i}" if uri is not None else LISTENER,
            "match": match,
            "transport_socket": {
                "name": "envoy.transport_sockets.tls",
                "typed_config": {
                    "@type": _TLS + "UpstreamTlsContext",
                    "common_tls_context": _tls_context(fed, uri),
                },
            },
        }
        for i, (match, uri) in enumerate([*exact, ({MATCH_KEY: True}, None)])
    ]
    return config
