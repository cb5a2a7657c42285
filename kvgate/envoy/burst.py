"""Envoy clusters and routes of the hosted burst endpoints (:mod:`extproc.burst`).

Each ``[[burst]]`` endpoint gets its own cluster, ``kvgate_burst_<name>``: ``STRICT_DNS`` on its host
name, TLS with SNI = that name and its certificate verified (chain to ``ca_file`` or the system bundle,
SAN = the name), and an upstream HTTP filter, ``envoy.filters.http.credential_injector``, that writes
``Authorization: Bearer <key>`` over whatever the request carries, the key a static generic secret
Envoy reads from ``api_key_file`` (never rendered into the config, never logged). A route matching
``x-kvgate-burst: <name>`` (set only by the ext_proc: clients' copies are stripped before any filter)
sends the request there with ``Host`` rewritten to the name. Envoy reads the key file at start: a
rotated key needs an Envoy restart (``kvgate up`` restarts it with the stack).
"""

from __future__ import annotations

import os
from typing import Any

from contracts.epp import MODEL_HEADER
from contracts.errors import ConfigError
from extproc.burst.core import BURST_HEADER, BurstEndpoint

#: The system CA bundle (Debian/Ubuntu path) for endpoints without ``ca_file``.
SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"

_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_HTTP_OPTS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_INJECTOR = "type.googleapis.com/envoy.extensions.filters.http.credential_injector.v3.CredentialInjector"
_GENERIC = "type.googleapis.com/envoy.extensions.http.injected_credentials.generic.v3.Generic"
_CODEC = "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"


def secret_name(endpoint: BurstEndpoint) -> str:
    return f"{endpoint.cluster}_key"


def check_files(endpoint: BurstEndpoint) -> None:
    """:class:`ConfigError` unless the key file and CA bundle are readable files and the key file holds
    one header-safe token (its bytes are checked, never logged)."""
    ca = endpoint.ca_file or SYSTEM_CA_BUNDLE
    for what, path in (("api_key_file", endpoint.api_key_file), ("ca_file", ca)):
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ConfigError(f"burst {endpoint.name}: {what} {path!r} is not a readable file")
    with open(endpoint.api_key_file, "rb") as f:  # Envoy sends the file's bytes as they are
        key = f.read()
    if not key or any(c <= 0x20 or c >= 0x7F for c in key):
        raise ConfigError(
            f"burst {endpoint.name}: api_key_file {endpoint.api_key_file!r} must hold the key alone "
            "(printable ASCII, no spaces, no trailing newline)"
        )


def secrets(endpoints: tuple[BurstEndpoint, ...]) -> list[dict[str, Any]]:
    """Static generic secrets: each endpoint's key, read by Envoy from its file."""
    return [
        {"name": secret_name(e), "generic_secret": {"secret": {"filename": e.api_key_file}}}
        for e in endpoints
    ]


def cluster(endpoint: BurstEndpoint, connect_timeout_s: float) -> dict[str, Any]:
    """The endpoint's cluster: DNS, verified TLS with SNI, the key injected upstream."""
    check_files(endpoint)
    host = endpoint.host
    address = {"socket_address": {"address": host, "port_value": endpoint.port}}
    injector = {
        "name": "envoy.filters.http.credential_injector",
        "typed_config": {
            "@type": _INJECTOR,
            "overwrite": True,  # a client's Authorization (already removed by the route) never goes on
            "credential": {
                "name": "envoy.http.injected_credentials.generic",
                "typed_config": {
                    "@type": _GENERIC,
                    "credential": {"name": secret_name(endpoint)},
                    "header": "Authorization",
                    "header_value_prefix": "Bearer ",
                },
            },
        },
    }
    return {
        "name": endpoint.cluster,
        "type": "STRICT_DNS",
        "dns_lookup_family": "V4_PREFERRED",
        "connect_timeout": f"{connect_timeout_s}s",
        "load_assignment": {
            "cluster_name": endpoint.cluster,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
        },
        "transport_socket": {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": _TLS,
                "sni": host,
                "common_tls_context": {
                    "validation_context": {
                        "trusted_ca": {"filename": endpoint.ca_file or SYSTEM_CA_BUNDLE},
                        "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": host}}],
                    }
                },
            },
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTS,
                "explicit_http_config": {"http_protocol_options": {}},
                "http_filters": [
                    injector,
                    {"name": "envoy.filters.http.upstream_codec", "typed_config": {"@type": _CODEC}},
                ],
            }
        },
    }


def routes(endpoints: tuple[BurstEndpoint, ...]) -> list[dict[str, Any]]:
    """One route per endpoint, matched on the ext_proc's ``x-kvgate-burst`` header (first: it wins over
    the model routes); neither that header nor the model header goes upstream."""
    return [
        {
            "match": {"prefix": "/", "headers": [{"name": BURST_HEADER, "string_match": {"exact": e.name}}]},
            "route": {"cluster": e.cluster, "timeout": "0s", "host_rewrite_literal": e.host},
            "request_headers_to_remove": [BURST_HEADER, MODEL_HEADER],
        }
        for e in endpoints
    ]
