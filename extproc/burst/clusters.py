"""An Envoy cluster of a hosted burst endpoint, as a plain dict (pure: no file is read).

Shared by the bootstrap's ``[[burst]]`` clusters (:mod:`kvgate.envoy.burst`, which checks the key and CA
files first) and the CDS the ext_proc serves for etcd's endpoints (:mod:`extproc.xds.cds`): ``STRICT_DNS``
on the host name, TLS with SNI = that name and its certificate verified (SAN = the name), and the upstream
``credential_injector`` writing ``Authorization: Bearer <key>`` from a static secret Envoy reads itself.
"""

from __future__ import annotations

from typing import Any

from extproc.burst.core import BurstEndpoint
from extproc.burst.records import SECRET_PREFIX

#: The system CA bundle (Debian/Ubuntu path) for endpoints without ``ca_file``.
SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"

_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_HTTP_OPTS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_INJECTOR = "type.googleapis.com/envoy.extensions.filters.http.credential_injector.v3.CredentialInjector"
_GENERIC = "type.googleapis.com/envoy.extensions.http.injected_credentials.generic.v3.Generic"
_CODEC = "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"


def secret_name(endpoint: BurstEndpoint) -> str:
    """The static secret the endpoint's key comes from: its own (``[[burst]]``), or its credential's (an
    etcd record, :mod:`extproc.burst.records`)."""
    if endpoint.credential is not None:
        return SECRET_PREFIX + endpoint.credential
    return f"{endpoint.cluster}_key"


def cluster(
    endpoint: BurstEndpoint, connect_timeout_s: float, secret: str, system_ca: str = SYSTEM_CA_BUNDLE
) -> dict[str, Any]:
    """The endpoint's cluster: DNS, verified TLS with SNI (chain to ``ca_file``, else ``system_ca``), the
    key injected upstream from the static secret ``secret``. Reads no file."""
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
                    "credential": {"name": secret},
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
                        "trusted_ca": {"filename": endpoint.ca_file or system_ca},
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
