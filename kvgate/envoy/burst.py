"""Envoy clusters and routes of the hosted burst endpoints (:mod:`extproc.burst`).

Each ``[[burst]]`` endpoint gets its own cluster, ``kvgate_burst_<name>``: ``STRICT_DNS`` on its host
name, TLS with SNI = that name and its certificate verified (chain to ``ca_file`` or the system bundle,
SAN = the name), and an upstream HTTP filter, ``envoy.filters.http.credential_injector``, that writes
``Authorization: Bearer <key>`` over whatever the request carries, the key a static generic secret
Envoy reads from ``api_key_file`` (never rendered into the config, never logged). A route matching
``x-kvgate-burst: <name>`` (set only by the ext_proc: clients' copies are stripped before any filter)
sends the request there with ``Host`` rewritten to the name. Envoy reads the key file at start: a
rotated key needs an Envoy restart (``kvgate up`` restarts it with the stack). A hosted 401 or 403 (a
refusal of the gateway's key, not of the client) reaches the client as a 502 OpenAI error from Envoy's
custom response filter, never as the hosted answer, which may quote the key's last characters.
"""

from __future__ import annotations

import os
from typing import Any

from contracts.epp import EXTPROC_CLUSTER, MODEL_HEADER, TENANT_HEADER
from contracts.errors import ConfigError
from extproc.burst import clusters
from extproc.burst.core import BURST_HEADER, CLUSTER_PREFIX, BurstEndpoint
from extproc.burst.records import BurstCredential

#: The system CA bundle (Debian/Ubuntu path) for endpoints without ``ca_file``.
SYSTEM_CA_BUNDLE = clusters.SYSTEM_CA_BUNDLE


secret_name = clusters.secret_name

#: Request headers a burst route removes before the hosted endpoint (besides the credentials every route
#: removes, ``kvgate.envoy.bootstrap.CREDENTIAL_HEADERS``): the gateway's own (the endpoint picked, the
#: model, the tenant: its rate limit has counted it), those that choose which organization or project of
#: the key's account is billed, and the client's addresses (not for a third party).
REQUEST_HEADERS_REMOVED = (
    BURST_HEADER,
    MODEL_HEADER,
    TENANT_HEADER,
    "openai-organization",
    "openai-project",
    "x-forwarded-for",
    "x-real-ip",
    "forwarded",
    "x-envoy-external-address",
)
#: Response headers a burst route removes before the client: the hosted account's session cookies and
#: its organization and project.
RESPONSE_HEADERS_REMOVED = ("set-cookie", "openai-organization", "openai-project")


#: Statuses by which a hosted endpoint refuses the gateway's own key (a wrong, revoked or unfunded key, a
#: model the account may not use): its answer is not the client's to read (OpenAI's names the key's last
#: characters) and the client's own credentials were fine, so Envoy answers :data:`REFUSED_STATUS` instead.
CREDENTIAL_REFUSALS = (401, 403)
REFUSED_STATUS = 502
REFUSED_MESSAGE = "The hosted endpoint this request overflowed to refused the gateway's credential."
_CUSTOM_RESPONSE = "type.googleapis.com/envoy.extensions.filters.http.custom_response.v3.CustomResponse"
_STATUS_INPUT = "type.googleapis.com/envoy.type.matcher.v3.HttpResponseStatusCodeMatchInput"
_LOCAL_POLICY = (
    "type.googleapis.com/envoy.extensions.http.custom_response.local_response_policy.v3.LocalResponsePolicy"
)
CUSTOM_RESPONSE_FILTER = "envoy.filters.http.custom_response"


def custom_response_filter() -> dict[str, Any]:
    """Envoy's custom response filter (placed before the router), with no matcher of its own: only a burst
    route's (:func:`refusal_override`) answers anything."""
    return {"name": CUSTOM_RESPONSE_FILTER, "typed_config": {"@type": _CUSTOM_RESPONSE}}


def refusal_override() -> dict[str, Any]:
    """A burst route's custom response config: an upstream :data:`CREDENTIAL_REFUSALS` status becomes a
    local :data:`REFUSED_STATUS` reply, whose body the listener's local reply config makes OpenAI JSON
    (``gateway_error``, :data:`REFUSED_MESSAGE`); the hosted answer's headers and body are dropped."""
    predicates = [
        {
            "single_predicate": {
                "input": {"name": "status", "typed_config": {"@type": _STATUS_INPUT}},
                "value_match": {"exact": str(code)},
            }
        }
        for code in CREDENTIAL_REFUSALS
    ]
    return {
        CUSTOM_RESPONSE_FILTER: {
            "@type": _CUSTOM_RESPONSE,
            "custom_response_matcher": {
                "matcher_list": {
                    "matchers": [
                        {
                            "predicate": {"or_matcher": {"predicate": predicates}},
                            "on_match": {
                                "action": {
                                    "name": "credential_refused",
                                    "typed_config": {
                                        "@type": _LOCAL_POLICY,
                                        "status_code": REFUSED_STATUS,
                                        "body": {"inline_string": REFUSED_MESSAGE},
                                    },
                                }
                            },
                        }
                    ]
                }
            },
        }
    }


def check_files(endpoint: BurstEndpoint | BurstCredential) -> None:
    """:class:`ConfigError` unless the key file and CA bundle are readable files and the key file holds
    one header-safe token (its bytes are checked, never logged). Run where Envoy's config is rendered."""
    ca = endpoint.ca_file or SYSTEM_CA_BUNDLE
    what_ = "burst" if isinstance(endpoint, BurstEndpoint) else "burst credential"
    for what, path in (("api_key_file", endpoint.api_key_file), ("ca_file", ca)):
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ConfigError(f"{what_} {endpoint.name}: {what} {path!r} is not a readable file")
    with open(endpoint.api_key_file, "rb") as f:  # Envoy sends the file's bytes as they are
        key = f.read()
    if not key or any(c <= 0x20 or c >= 0x7F for c in key):
        raise ConfigError(
            f"{what_} {endpoint.name}: api_key_file {endpoint.api_key_file!r} must hold the key alone "
            "(printable ASCII, no spaces, no trailing newline)"
        )


def secrets(endpoints: tuple[BurstEndpoint, ...]) -> list[dict[str, Any]]:
    """Static generic secrets: each endpoint's key, read by Envoy from its file."""
    return [
        {"name": secret_name(e), "generic_secret": {"secret": {"filename": e.api_key_file}}}
        for e in endpoints
    ]


def cluster(endpoint: BurstEndpoint, connect_timeout_s: float) -> dict[str, Any]:
    """The endpoint's cluster (:func:`extproc.burst.clusters.cluster`), its files checked first."""
    check_files(endpoint)
    return clusters.cluster(endpoint, connect_timeout_s, secret_name(endpoint), SYSTEM_CA_BUNDLE)


def routes(endpoints: tuple[BurstEndpoint, ...], idle_s: float) -> list[dict[str, Any]]:
    """One route per endpoint, matched on the ext_proc's ``x-kvgate-burst`` header (first: it wins over
    the model routes); :data:`REQUEST_HEADERS_REMOVED` do not go upstream, :data:`RESPONSE_HEADERS_REMOVED`
    do not come back. ``idle_s``: the stream idle timeout of routed requests (the listener's is longer,
    for requests the ext_proc holds)."""
    return [
        {
            "match": {"prefix": "/", "headers": [{"name": BURST_HEADER, "string_match": {"exact": e.name}}]},
            "route": {
                "cluster": e.cluster,
                "timeout": "0s",
                "idle_timeout": f"{idle_s}s",
                "host_rewrite_literal": e.host,
            },
            "request_headers_to_remove": list(REQUEST_HEADERS_REMOVED),
            "response_headers_to_remove": list(RESPONSE_HEADERS_REMOVED),
            "typed_per_filter_config": refusal_override(),
        }
        for e in endpoints
    ]


def dynamic_routes(idle_s: float) -> list[dict[str, Any]]:
    """The route of etcd's endpoints (after the config's own): ``x-kvgate-burst`` holds the cluster's name
    (``kvgate_burst_<name>``, a cluster the ext_proc serves over CDS), ``Host`` becomes its DNS name;
    ``idle_s`` as for :func:`routes`."""
    return [
        {
            "match": {
                "prefix": "/",
                "headers": [{"name": BURST_HEADER, "string_match": {"prefix": CLUSTER_PREFIX}}],
            },
            "route": {
                "cluster_header": BURST_HEADER,
                "timeout": "0s",
                "idle_timeout": f"{idle_s}s",
                "auto_host_rewrite": True,
            },
            "request_headers_to_remove": list(REQUEST_HEADERS_REMOVED),
            "response_headers_to_remove": list(RESPONSE_HEADERS_REMOVED),
            "typed_per_filter_config": refusal_override(),
        }
    ]


def apply_credentials(
    config: dict[str, Any], credentials: tuple[BurstCredential, ...], initial_fetch_s: float
) -> None:
    """Burst endpoints from etcd (``burst/<name>``): each declared credential a static secret (Envoy reads
    the key file at start; checked here), and the clusters from the ext_procs over gRPC CDS (the
    ``kvgate_extproc`` cluster, like the engine cluster's EDS). Their route is :func:`dynamic_routes`."""
    for c in credentials:
        check_files(c)
    static = config["static_resources"]
    static.setdefault("secrets", []).extend(
        {"name": c.secret, "generic_secret": {"secret": {"filename": c.api_key_file}}} for c in credentials
    )
    config["dynamic_resources"] = {
        "cds_config": {
            "resource_api_version": "V3",
            "initial_fetch_timeout": f"{initial_fetch_s}s",
            "api_config_source": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [{"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}}],
            },
        }
    }
