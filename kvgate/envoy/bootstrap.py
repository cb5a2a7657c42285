"""The Envoy bootstrap for the OpenAI listener, rendered from code (the one source of truth).

``envoy/gateway.yaml`` in the repository is this module's output for the default ports
(``kvgate envoy-config``), checked by a test to stay identical. What it sets up:

* an OpenAI listener whose client-sent routing headers are stripped before any filter runs;
* the ext_proc filter in Endpoint Picker Protocol mode (FULL_DUPLEX_STREAMED request body, trailers
  sent, response headers sent for the served-endpoint read-back), failing CLOSED with 503;
* an ORIGINAL_DST upstream cluster that takes its host from ``envoy.lb`` dynamic metadata written
  only by the ext_proc, never from a header; streaming-safe timeouts; a raised buffer limit;
* local replies (Envoy's own errors: ext_proc down, upstream unreachable) as OpenAI-style JSON;
* what happened to each request: an ``x-request-id`` on every response, ``x-kvgate-endpoint`` (the engine
  that served it) on proxied ones, and a JSON-lines access log (:data:`ACCESS_LOG_FORMAT`);
* for the ext_procs, gRPC access-log entries (:mod:`kvgate.envoy.resilience`): failed tries, timed-out
  requests, and one completion per routed request;
* a listener without ``SO_REUSEPORT``, so a second Envoy on the same port fails to start instead of
  silently sharing the port.

With ``tls`` set (``kvgate up --secure``; ``envoy/gateway-secure.yaml`` for the default paths) the same
bootstrap gets the transport security of :mod:`kvgate.envoy.tls` and nothing else changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from contracts.epp import (
    ANSWERED_KEY,
    CASCADE_STEP_HEADER,
    DECISION_BLOCKS,
    DECISION_CASCADE_STEP,
    DECISION_ENDPOINT,
    DECISION_MATCHED,
    DECISION_MODEL,
    DECISION_NS,
    DECISION_TENANT,
    DECISION_US,
    DESTINATION,
    ENDPOINT_HEADER,
    ENGINES_CLUSTER,
    EXTPROC_CLUSTER,
    LB_NS,
    MIGRATE_UPSTREAMS_HEADER,
    MIGRATION_LIMIT_HEADER,
    MODEL_HEADER,
    PRIMARY,
    REJECTED_KEY,
    REJECTED_NS,
    SUBSET_NS,
    TENANT_HEADER,
    TTFT_DEADLINE_UPSTREAM,
    UPSTREAM_HEADER,
)
from contracts.errors import ConfigError
from contracts.federation import CLIENT_SALT_HEADER, HOP_HEADER, PEER_HEADER, REFUSED_HEADER, SALTED_HEADER
from extproc.burst.core import BURST_HEADER, BurstEndpoint
from extproc.burst.records import BurstCredential
from kvgate.envoy import auth as envoy_auth
from kvgate.envoy import burst as envoy_burst
from kvgate.envoy import federation as envoy_federation
from kvgate.envoy import migration as envoy_migration
from kvgate.envoy import resilience
from kvgate.envoy import stats as envoy_stats
from kvgate.envoy import tracing as envoy_tracing
from kvgate.envoy.resilience import ENVOY_CONTROL_HEADERS, Resilience
from kvgate.envoy.tls import EnvoyTls, secure_profile
from kvgate.envoy.usage import stream_id_filter, usage_filter

#: Headers a client may never set: routing decisions, retries, timeouts and client addresses come from
#: the ext_proc and this config alone. A client's ``x-forwarded-for`` is dropped too when no proxy in front
#: is trusted (``EnvoyParams.trusted_hops`` 0).
STRIPPED_REQUEST_HEADERS = (
    DESTINATION,
    PRIMARY,
    "x-envoy-original-dst-host",
    UPSTREAM_HEADER,
    TENANT_HEADER,
    MODEL_HEADER,
    *ENVOY_CONTROL_HEADERS,
    # Client addresses only Envoy may state (it writes x-forwarded-for from the peer it saw).
    "x-real-ip",
    "forwarded",
    # The hosted burst endpoint the ext_proc picked (extproc/burst): a client may not choose it.
    BURST_HEADER,
    # The migration proxy's hosts and limit (kvgate/envoy/migration.py): Envoy writes them per route.
    MIGRATE_UPSTREAMS_HEADER,
    MIGRATION_LIMIT_HEADER,
    # What is left of the request's TTFT deadline (extproc/flow): set by the ext_proc only when it has one.
    TTFT_DEADLINE_UPSTREAM,
    # Federation's (extproc/federation): set by a forwarding ext_proc only; the federation listener keeps
    # a linked peer's hop and salted flag (kvgate/envoy/federation.py). With or without federation no
    # client's copy reaches the ext_proc or an engine.
    HOP_HEADER,
    PEER_HEADER,
    SALTED_HEADER,
    CLIENT_SALT_HEADER,
    # Response-only names (a cascade step, a peer's refusal; and x-kvgate-endpoint where the config adds
    # it, render()): no engine needs a client's copy.
    CASCADE_STEP_HEADER,
    REFUSED_HEADER,
)

#: Credential headers: removed from every request at the router (after the ext_proc read them), so no engine
#: ever sees a client's key, token or session.
CREDENTIAL_HEADERS = ("authorization", "proxy-authorization", "x-api-key", "api-key", "cookie")

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HTTP_OPTS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_EARLY = "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"
_LOGGERS = "type.googleapis.com/envoy.extensions.access_loggers."
#: Access-log paths that name a stream of the Envoy process: Envoy's stream loggers write them through
#: its own descriptor (opening ``/dev/stdout`` as a file would append past whatever shares it).
_STREAM_LOGGERS = {
    "/dev/stdout": ("envoy.access_loggers.stdout", _LOGGERS + "stream.v3.StdoutAccessLog"),
    "/dev/stderr": ("envoy.access_loggers.stderr", _LOGGERS + "stream.v3.StderrAccessLog"),
}


def _decision(key: str) -> str:
    return f"%DYNAMIC_METADATA({DECISION_NS}:{key})%"


#: The access log: one JSON object per request, with exactly these fields (``null`` where unknown, e.g.
#: no engine for a request the gateway answered itself). Never the body, the query string (it may carry
#: a key), the Authorization header or any other credential. ``endpoint``: ``ip:port`` Envoy sent the
#: request to; ``endpoint_id``, ``model``, ``matched_blocks`` (leading prompt blocks the pick held),
#: ``prompt_blocks`` (blocks looked up) and ``decision_us``: the ext_proc's decision (dynamic metadata
#: ``kvgate.decision``); ``ttfb_ms``: request start to the engine's first response byte (about the time to
#: first token of a stream); ``duration_ms``: request start to the last byte sent; ``tenant``: with
#: ``[auth]`` only, the decision's (not the ``x-kvgate-tenant`` header: a burst route removes it before
#: the hosted endpoint, and the access log sees request headers as the route left them).
ACCESS_LOG_FORMAT: dict[str, str] = {
    "start_time": "%START_TIME%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "method": "%REQ(:METHOD)%",
    "path": "%PATH(NQ:PATH)%",
    "protocol": "%PROTOCOL%",
    "status": "%RESPONSE_CODE%",
    "flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "endpoint": "%UPSTREAM_HOST%",
    "endpoint_id": _decision(DECISION_ENDPOINT),
    "model": _decision(DECISION_MODEL),
    "tenant": _decision(DECISION_TENANT),
    "matched_blocks": _decision(DECISION_MATCHED),
    "prompt_blocks": _decision(DECISION_BLOCKS),
    "decision_us": _decision(DECISION_US),
    "ttfb_ms": "%RESPONSE_DURATION%",
    "duration_ms": "%DURATION%",
    "bytes_received": "%BYTES_RECEIVED%",
    "bytes_sent": "%BYTES_SENT%",
}


def _admin_address(params: EnvoyParams) -> dict[str, Any]:
    """The admin's address: ``params.admin_socket`` (mode 0600) when set, else TCP on loopback."""
    if params.admin_socket is not None:
        return {"pipe": {"path": params.admin_socket, "mode": 0o600}}
    return _addr("127.0.0.1", params.admin_port)


@dataclass(frozen=True, slots=True)
class EnvoyParams:
    """Addresses (``host``/ports) and limits of the rendered bootstrap.

    ``buffer_limit_bytes``: per-connection buffer (must exceed the largest request body streamed
    through ext_proc chunking, i.e. 62 KB, and bounds memory per connection). ``message_timeout_s``:
    how long Envoy waits for each ext_proc reply (Envoy's 200 ms default is too tight under load).
    ``max_message_timeout_s``: the longest wait the ext_proc may ask for instead, per reply, with a
    ``ProcessingResponse`` carrying only ``override_message_timeout`` (while it holds a request in a
    queue); larger asks are refused by Envoy.
    """

    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    admin_port: int = 9901
    #: Envoy's admin on this Unix socket (mode 0600: this user only) instead of ``127.0.0.1:admin_port``;
    #: the admin can raise the log level until requests' credentials are logged, so no other local user
    #: may reach it.
    admin_socket: str | None = None
    extproc_host: str = "127.0.0.1"
    extproc_port: int = 9002
    #: Every ext_proc replica (``host``, ``port``) behind the one ``kvgate_extproc`` cluster; empty: the
    #: single ``extproc_host:extproc_port``.
    extproc_addresses: tuple[tuple[str, int], ...] = ()
    buffer_limit_bytes: int = 4 * 1024 * 1024
    message_timeout_s: float = 5.0
    max_message_timeout_s: float = 600.0
    upstream_connect_timeout_s: float = 2.0
    tls: EnvoyTls | None = None
    #: JWT verification, per-tenant rate limits and the ext_proc's auth options (kvgate/envoy/auth.py).
    auth: envoy_auth.EdgeAuth | None = None
    #: Send response headers to the ext_proc (served-endpoint read-back). Off by default: the ORIGINAL_DST
    #: cluster always serves the pick, so the read-back would only cost a round trip before every
    #: response's first byte. Tenants (``auth``) turn it on: refunds and usage settlement need it.
    served_readback: bool = False
    #: Where Envoy writes the access log (:data:`ACCESS_LOG_FORMAT`): a file path, ``/dev/stdout`` or
    #: ``/dev/stderr``; ``None``: no access log. Envoy buffers it and writes every 10 s
    #: (``--file-flush-interval-msec``) or every 64 KiB (``--file-flush-min-size-kb``), and on exit.
    access_log_path: str | None = "/dev/stdout"
    #: Add ``x-kvgate-endpoint: ip:port`` (the engine that served it) to every proxied response.
    endpoint_header: bool = True
    #: Proxies in front of Envoy whose ``x-forwarded-for`` entries are trusted (Envoy's
    #: ``xff_num_trusted_hops``); 0: clients connect directly, their own list is dropped.
    trusted_hops: int = 0
    #: Send every ext_proc one gRPC access-log entry per routed request once its response is complete
    #: (:func:`kvgate.envoy.resilience.completion_loggers`): the engines' load and flow control's
    #: dispatch follow it. Off only to measure its cost.
    completion_log: bool = True
    #: Retries, fallbacks, fail-open, stream idle timeout, ext_proc health checks (resilience.py).
    resilience: Resilience = field(default_factory=Resilience)
    #: A listener on ``stats_host:stats_port`` serving only ``GET /stats/prometheus`` from the admin
    #: (kvgate/envoy/stats.py), for Prometheus; ``None``: none. Needs ``admin_socket`` or a fixed admin port.
    stats_port: int | None = None
    stats_host: str = "127.0.0.1"
    #: Envoy's OpenTelemetry tracer (kvgate/envoy/tracing.py; the gateway config's ``[tracing]``);
    #: ``None``: Envoy traces nothing.
    tracing: envoy_tracing.EnvoyTracing | None = None
    #: Cross-cluster federation: the listener linked peers forward to and the forwarding transport
    #: socket (kvgate/envoy/federation.py); ``None``: none.
    federation: envoy_federation.EnvoyFederation | None = None
    #: Hosted burst endpoints (``[[burst]]``): a TLS cluster and a route each (kvgate/envoy/burst.py).
    burst: tuple[BurstEndpoint, ...] = ()
    #: Credentials etcd ``burst/<name>`` records may name (``[burst_credentials]``): a static secret
    #: each, and the etcd endpoints' clusters over CDS from the ext_procs (kvgate/envoy/burst.py).
    burst_credentials: tuple[BurstCredential, ...] = ()
    #: In-flight migration: opted-in models' requests through the migration proxy
    #: (kvgate/envoy/migration.py); ``None``: no model is opted in.
    migration: envoy_migration.EnvoyMigration | None = None


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _local_reply() -> dict[str, Any]:
    """Envoy's own errors (ext_proc down, engine unreachable, timeouts) as OpenAI-style JSON.

    The ext_proc's immediate responses already carry an OpenAI JSON body; it marks them with dynamic
    metadata ``kvgate.rejected`` so the first mapper passes their body through unchanged. Every other
    local reply gets a JSON body: a ``type`` per status where one fits, ``gateway_error`` otherwise.
    """

    def status(code: int, kind: str, message: str) -> dict[str, Any]:
        return {
            "filter": {
                "status_code_filter": {
                    "comparison": {
                        "op": "EQ",
                        "value": {"default_value": code, "runtime_key": f"kvgate.local_reply.{code}"},
                    }
                }
            },
            "body_format_override": _json_error(kind, message),
        }

    def answered(kind: str, content_type: str) -> dict[str, Any]:
        """An answer the ext_proc returns itself (a cascade step's), passed through with its type."""
        return {
            "filter": {
                "metadata_filter": {
                    "match_if_key_not_found": False,
                    "matcher": {
                        "filter": REJECTED_NS,
                        "path": [{"key": ANSWERED_KEY}],
                        "value": {"string_match": {"exact": kind}},
                    },
                }
            },
            "body_format_override": {
                "text_format_source": {"inline_string": "%LOCAL_REPLY_BODY%"},
                "content_type": content_type,
            },
        }

    return {
        "mappers": [
            answered("json", "application/json"),
            answered("sse", "text/event-stream"),
            {
                # match_if_key_not_found defaults to TRUE in Envoy: it must be false here.
                "filter": {
                    "metadata_filter": {
                        "match_if_key_not_found": False,
                        "matcher": {
                            "filter": REJECTED_NS,
                            "path": [{"key": REJECTED_KEY}],
                            "value": {"bool_match": True},
                        },
                    }
                },
                "body_format_override": {
                    "text_format_source": {"inline_string": "%LOCAL_REPLY_BODY%"},
                    "content_type": "application/json",
                },
            },
            status(503, "service_unavailable", "The gateway cannot serve this request now; retry later."),
            status(504, "timeout", "The upstream engine timed out."),
            status(429, "rate_limit_error", "Rate limit exceeded."),
            status(413, "invalid_request_error", "The request body is too large."),
        ],
        "body_format": _json_error("gateway_error", "%LOCAL_REPLY_BODY%"),
    }


def _access_log(path: str) -> dict[str, Any]:
    log_format = {"json_format": ACCESS_LOG_FORMAT}
    stream = _STREAM_LOGGERS.get(path)
    if stream is not None:
        name, type_url = stream
        return {"name": name, "typed_config": {"@type": type_url, "log_format": log_format}}
    return {
        "name": "envoy.access_loggers.file",
        "typed_config": {"@type": _LOGGERS + "file.v3.FileAccessLog", "path": path, "log_format": log_format},
    }


def _json_error(kind: str, message: str) -> dict[str, Any]:
    return {
        "json_format": {"error": {"message": message, "type": kind, "param": None, "code": None}},
        "content_type": "application/json",
    }


def refuse_fail_open_with_auth(fail_open: bool, auth: envoy_auth.EdgeAuth | None) -> None:
    """:class:`ConfigError` for fail-open with ``[auth]``: with every ext_proc down Envoy would skip it, and
    with it the gateway's authentication (jwt_authn lets missing tokens through: the ext_proc decides)
    and the tenant header the rate limit is keyed on."""
    if fail_open and auth is not None:
        raise ConfigError(
            "--fail-open cannot be used with [auth]: with every ext_proc down Envoy would skip it and "
            "serve unauthenticated requests; drop --fail-open (Envoy then fails closed, 503)"
        )


def render(params: EnvoyParams) -> dict[str, Any]:
    """The bootstrap as a plain dict (dump it as YAML or JSON). Raises ``ConfigError`` for a secure
    profile (``tls``) whose JWT keys would come over plain HTTP or whose migration proxy is not on
    loopback, and for fail-open with ``[auth]``."""
    refuse_fail_open_with_auth(params.resilience.fail_open, params.auth)
    response_headers = params.served_readback or params.auth is not None
    res = params.resilience
    extprocs = _extprocs(params)
    # No route-wide bound: the ext_proc sets each request's (x-envoy-upstream-rq-timeout-ms, per model).
    action = {"cluster": ENGINES_CLUSTER, "timeout": "0s", "retry_policy": resilience.retry_policy(res)}
    route: dict[str, Any] = {}
    upstream_headers = [ENDPOINT_HEADER] if params.endpoint_header else []
    if response_headers:
        upstream_headers.append(UPSTREAM_HEADER)  # read back and removed by the ext_proc
    # Overwrites any copy the engine sent; a client cannot set response headers. The cascade step of an
    # escalated request (extproc/cascade) comes from the ext_proc's decision metadata; absent (empty) for
    # every other request, so no header is added then.
    route["response_headers_to_add"] = [
        *(
            {
                "header": {"key": key, "value": "%UPSTREAM_HOST%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
            for key in upstream_headers
        ),
        {
            "header": {"key": CASCADE_STEP_HEADER, "value": _decision(DECISION_CASCADE_STEP)},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        },
    ]
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _EXT_PROC,
            "grpc_service": {
                "envoy_grpc": {"cluster_name": EXTPROC_CLUSTER},
                "retry_policy": resilience.extproc_retry_policy(res),
            },
            "failure_mode_allow": res.fail_open,
            # The ext_proc sets each request's x-envoy-upstream-rq-* bounds; Envoy ignores x-envoy-*
            # mutations unless allowed (clients' copies are stripped before any filter).
            "mutation_rules": {"allow_envoy": True},
            "status_on_error": {"code": "ServiceUnavailable"},
            "message_timeout": f"{params.message_timeout_s}s",
            "max_message_timeout": f"{params.max_message_timeout_s}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                # Fail-open needs Envoy to keep the body: in FULL_DUPLEX_STREAMED mode it has handed
                # the body to the ext_proc and must fail closed (measured on 1.40).
                "request_body_mode": "BUFFERED" if res.fail_open else "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SKIP" if res.fail_open else "SEND",
                "response_header_mode": "SEND" if response_headers else "SKIP",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SKIP",
            },
            "metadata_options": {
                "forwarding_namespaces": {"untyped": [SUBSET_NS, LB_NS]},
                "receiving_namespaces": {"untyped": [LB_NS, REJECTED_NS, DECISION_NS]},
            },
        },
    }
    stripped = (
        STRIPPED_REQUEST_HEADERS
        + ((ENDPOINT_HEADER,) if params.endpoint_header else ())
        + (("x-forwarded-for",) if params.trusted_hops == 0 else ())
    )
    hcm = {
        "@type": _HCM,
        "stat_prefix": "openai",
        "codec_type": "AUTO",
        "request_timeout": "0s",
        # At least the longest hold before a decision; routed requests get their route's (resilience.py).
        "stream_idle_timeout": f"{resilience.listener_idle_timeout_s(res, params.max_message_timeout_s)}s",
        "always_set_request_id_in_response": True,
        # The downstream peer is the client (or the last of trusted_hops proxies, whose x-forwarded-for
        # entries name it); Envoy appends the peer to x-forwarded-for, and regenerates the x-request-id of
        # every request from outside (preserve_external_request_id stays false).
        "use_remote_address": True,
        "xff_num_trusted_hops": params.trusted_hops,
        "early_header_mutation_extensions": [
            {
                "name": "kvgate.strip_routing_headers",
                "typed_config": {
                    "@type": _EARLY,
                    "mutations": [{"remove": h} for h in stripped],
                },
            }
        ],
        "access_log": [
            *([_access_log(params.access_log_path)] if params.access_log_path else []),
            *resilience.timeout_loggers(len(extprocs)),
            *(resilience.completion_loggers(len(extprocs)) if params.completion_log else []),
        ],
        "local_reply_config": _local_reply(),
        "route_config": {
            "name": "openai",
            # For every route, at the router, after every filter: jwt_authn and the ext_proc still see them.
            "request_headers_to_remove": list(CREDENTIAL_HEADERS),
            "virtual_hosts": [
                {
                    "name": "openai",
                    "domains": ["*"],
                    "routes": [
                        {**r, **route}
                        for r in (
                            *envoy_burst.routes(params.burst, res.stream_idle_timeout_s),
                            *(
                                envoy_burst.dynamic_routes(res.stream_idle_timeout_s)
                                if params.burst_credentials
                                else ()
                            ),
                            *envoy_migration.routes(params.migration, res.stream_idle_timeout_s),
                            *resilience.routes(res, action),
                        )
                    ],
                }
            ],
        },
        "http_filters": envoy_auth.http_filters(
            params.auth,
            ext_proc,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": _ROUTER, "upstream_log": resilience.failure_loggers(len(extprocs))},
            },
        ),
    }
    if params.completion_log:  # the engine's reused prompt tokens, for the drift alarm (extproc/drift)
        filters: list[dict[str, Any]] = hcm["http_filters"]  # type: ignore[assignment]
        filters.insert(-1, usage_filter())
        filters.insert(-1, stream_id_filter())  # a streamed Responses answer's id (extproc/affinity)
    if params.burst or params.burst_credentials:  # a hosted refusal of the gateway's key (burst routes)
        hcm["http_filters"].insert(-1, envoy_burst.custom_response_filter())  # type: ignore[attr-defined]
    if params.tracing is not None:
        hcm["tracing"] = envoy_tracing.hcm_tracing(params.tracing)
    extproc_cluster = resilience.extproc_cluster(res, extprocs)
    config: dict[str, Any] = {
        # A node identity: xDS (the ext_procs' EDS) and SDS require one.
        "node": {"id": "kvgate-envoy", "cluster": "kvgate"},
        "admin": {"address": _admin_address(params)},
        "static_resources": {
            "listeners": [
                {
                    "name": "openai",
                    "address": _addr(params.listen_host, params.listen_port),
                    # Off: a second Envoy on this port fails to bind instead of sharing its connections.
                    "enable_reuse_port": False,
                    "per_connection_buffer_limit_bytes": params.buffer_limit_bytes,
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                extproc_cluster,
                resilience.engines_cluster(res, params.upstream_connect_timeout_s, params.buffer_limit_bytes),
                *resilience.failure_log_clusters(extprocs, extproc_cluster),
                # The secure profile refuses a plain-HTTP JWKS (ConfigError).
                *envoy_auth.clusters(params.auth, secure=params.tls is not None),
            ],
        },
    }
    if params.burst:
        static = config["static_resources"]
        static["clusters"].extend(
            envoy_burst.cluster(e, params.upstream_connect_timeout_s) for e in params.burst
        )
        static.setdefault("secrets", []).extend(envoy_burst.secrets(params.burst))
    if params.burst_credentials:
        envoy_burst.apply_credentials(config, params.burst_credentials, res.eds_initial_fetch_s)
    if params.migration is not None:
        if params.tls is not None:  # plain HTTP to the proxy: this machine only
            envoy_migration.require_loopback(params.migration)
        config["static_resources"]["clusters"].append(
            envoy_migration.cluster(
                params.migration, params.upstream_connect_timeout_s, params.buffer_limit_bytes
            )
        )
    if params.tracing is not None:
        config["static_resources"]["clusters"].append(envoy_tracing.collector_cluster(params.tracing))
        config["layered_runtime"] = envoy_tracing.runtime_layer(params.tracing)
    if params.tls is not None:
        config = secure_profile(config, params.tls)
    if params.federation is not None:
        config = envoy_federation.apply(config, params.federation)
    if params.stats_port is not None:  # plaintext, like the ext_proc's metrics (after TLS: not a peer)
        static = config["static_resources"]
        static["listeners"].append(envoy_stats.stats_listener(params.stats_host, params.stats_port))
        static["clusters"].append(envoy_stats.admin_cluster(config["admin"]["address"]))
    return config


def _extprocs(params: EnvoyParams) -> tuple[tuple[str, int], ...]:
    return params.extproc_addresses or ((params.extproc_host, params.extproc_port),)


def render_yaml(params: EnvoyParams) -> str:
    command = "kvgate envoy-config" + (" --secure" if params.tls is not None else "")
    header = f"# Generated by `{command}` (kvgate/envoy/bootstrap.py). Do not edit by hand.\n"
    body: str = yaml.safe_dump(render(params), sort_keys=False, width=100)
    return header + body


def render_baseline(addresses: Sequence[str], lb_policy: str = "ROUND_ROBIN") -> str:
    """A benchmark baseline: this bootstrap (same listener, timeouts, limits, free ports) without the
    ext_proc filter, its upstream a STATIC cluster over ``addresses`` balanced by ``lb_policy``
    (``ROUND_ROBIN``, ``LEAST_REQUEST``)."""
    config = render(EnvoyParams(listen_port=0, admin_port=0, extproc_port=1))
    static = config["static_resources"]
    hcm = static["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    # Nothing is held without the ext_proc: a request's idle bound is a routed one's.
    hcm["stream_idle_timeout"] = f"{Resilience().stream_idle_timeout_s}s"
    for f in hcm["http_filters"]:
        f["typed_config"].pop("upstream_log", None)  # the failure log goes to the ext_procs
    engines = next(c for c in static["clusters"] if c["name"] == "kvgate_engines")
    lb_endpoints = [{"endpoint": {"address": _addr(*_split(a))}} for a in addresses]
    static["clusters"] = [
        {
            "name": "kvgate_engines",
            "type": "STATIC",
            "lb_policy": lb_policy,
            "connect_timeout": engines["connect_timeout"],  # the same limits as kvgate's own cluster
            "per_connection_buffer_limit_bytes": engines["per_connection_buffer_limit_bytes"],
            "circuit_breakers": engines["circuit_breakers"],
            "load_assignment": {
                "cluster_name": "kvgate_engines",
                "endpoints": [{"lb_endpoints": lb_endpoints}],
            },
        }
    ]
    body: str = yaml.safe_dump(config, sort_keys=False, width=100)
    return body


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)
