"""How the bundled Envoy survives failures: which engine a request may go to, what is retried, what
times out, and how every ext_proc replica hears about a failed try.

* **Engines.** ``kvgate_engines`` is an EDS cluster fed by the ext_proc replicas themselves (gRPC EDS on
  the ext_proc port, :mod:`extproc.xds.eds`): every endpoint the gateway may pick, and nothing else. Its
  load balancer is Envoy's ``override_host`` policy, which takes the decision's ordered list
  ``pick,fallback,...`` from ``envoy.lb`` dynamic metadata (written only by the ext_proc) and, on each
  retry, tries the next host of that list. A list that runs out, or names a host outside the cluster,
  falls to the *fallback policy*: no host at all when failing closed (a subset balancer whose selector
  never matches: 503), the least-loaded engine of the cluster when failing open.
* **Retries** (:data:`RETRY_ON`) only for tries that returned no response byte: the connection was
  refused, reset or closed before the response began, the HTTP/2 stream was refused, a stream got no
  response headers within its first-byte bound, or the engine answered 503 (draining, overloaded; that
  body is not forwarded). Nothing has reached the client then, so the next host of the list can serve it
  in full; the engine that failed may have begun the work, which is lost. Once an engine's response has
  begun, nothing is retried: a stream cut mid-way ends for the client. A request whose whole bound ran
  out is not retried either. At most ``max_retries`` per request and, across the cluster, a retry budget of
  20 % of active requests (at least 10 at once). Bodies larger than the connection buffer
  (``buffer_limit_bytes``) cannot be replayed and are not retried.
* **Timeouts.** The ext_proc sets each request's total bound and, for streams, its first-byte bound
  (``x-envoy-upstream-rq-timeout-ms``, ``x-envoy-upstream-rq-per-try-timeout-ms``; per model,
  :mod:`extproc.routing.timeouts`); Envoy's per-try timeout stops at the response headers, so a stream
  that has started is bounded only by the total and by the stream idle timeout. Clients cannot set these
  headers (:data:`ENVOY_CONTROL_HEADERS` are stripped before any filter).
* **Idle timeouts: a hold, then an engine.** Before its decision the ext_proc may hold a request (flow
  control's queue, a cascade step, a prefill half) with nothing moving either way, and the bundled
  streamed bodies run no message timer (``tests/kvgate/envoy/test_message_timeout.py``): the listener's
  stream idle timeout is the only bound, so it is at least the longest hold the ext_proc may ask for
  (:func:`listener_idle_timeout_s`: the filter's ``max_message_timeout``, 600 s). Every route a decision
  leads to (matched on the header it sets: :data:`~contracts.epp.MODEL_HEADER`, a burst or migration
  route) sets its own ``idle_timeout``, ``stream_idle_timeout_s`` or the model's; Envoy takes it when it
  chooses the route again after the ext_proc's reply and re-arms its idle timer with it at the next byte
  that moves, the body the ext_proc sends back (measured on 1.40: a reply with no body would leave the
  listener's bound running), so an engine may stay silent exactly as long as before. Only a request with
  no decision (the ext_proc's, or fail-open's skipped ext_proc) keeps the listener's longer bound.
* **Failed tries reach every ext_proc.** The router's ``upstream_log`` sends one entry per *failed*
  upstream try (:func:`failure_loggers`: connect failure, first-byte timeout, reset, protocol error, or an
  engine's 503) over gRPC access-log streams, one per ext_proc replica, log name
  :data:`~contracts.epp.FAILURE_LOG_NAME`; each replica ejects that endpoint for a while
  (:mod:`extproc.xds.ejection`). A request that ran out of its whole bound is reported by the listener's
  access log instead (:func:`timeout_loggers`). Successful tries are not logged: they cost nothing here.
* **Completions reach every ext_proc.** The listener's access log sends one entry per request the
  ext_proc routed (its ``kvgate.decision`` metadata is present: every routed decision sets it, Envoy's own
  local replies and the gateway's answers have none) once the response is complete, to every replica, log
  name :data:`~contracts.epp.COMPLETION_LOG_NAME` (:func:`completion_loggers`, flushed every
  :data:`COMPLETION_FLUSH_S`): the request id, the engine that served it and its timings, so the worker
  that routed it counts the engine's load down and flow control learns that a slot is free. A request
  whose engine could not be reached is logged too (it ended there: its routed count is given back).
* **ext_proc replicas** are health-checked by gRPC health on the ext_proc port (service ``liveness``)
  and ejected at once on a connect failure, so a killed replica costs at most its in-flight decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contracts.epp import (
    COMPLETION_LOG_NAME,
    DECISION_ENDPOINT,
    DECISION_NS,
    DESTINATION,
    ENGINES_CLUSTER,
    EXTPROC_CLUSTER,
    FAILURE_LOG_NAME,
    LB_NS,
    MODEL_HEADER,
)
from extproc.config import GatewayConfig
from kvgate.envoy.hosts import cluster_type

_OVERRIDE_HOST = "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
_SUBSET = "type.googleapis.com/envoy.extensions.load_balancing_policies.subset.v3.Subset"
_ROUND_ROBIN = "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
_LEAST_REQUEST = "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"
_GRPC_LOG = "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"
_PREVIOUS_HOSTS = "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
_HTTP_OPTS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

#: Retried: no response byte came back (see the module docstring). ``reset`` covers a reset or closed
#: connection before the response began and a try's first-byte timeout.
RETRY_ON = "reset,connect-failure,refused-stream,retriable-status-codes"
RETRIABLE_STATUS = (503,)
#: Response flags of a failed upstream try: connection failure, timeout, connection termination, remote
#: reset, protocol error. Not overflow (UO): Envoy's circuit breakers are cluster-wide, not the engine's.
FAILURE_FLAGS = ("UF", "UT", "UC", "UR", "UPE")
#: Request headers Envoy's router obeys: a client must never set retries, timeouts or hedging.
ENVOY_CONTROL_HEADERS = (
    "x-envoy-max-retries",
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
    "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-upstream-rq-timeout-alt-response",
    "x-envoy-expected-rq-timeout-ms",
    "x-envoy-hedge-on-per-try-timeout",
    "x-envoy-upstream-stream-duration-ms",
    "x-envoy-is-timeout-retry",
)
#: How often (s) Envoy sends the buffered failure entries to each ext_proc.
FAILURE_FLUSH_S = 0.05
#: How often (s) Envoy sends the buffered completion entries to each ext_proc: a held request waits at
#: most about this long after a slot freed up.
COMPLETION_FLUSH_S = 0.02


@dataclass(frozen=True, slots=True)
class Resilience:
    """``fail_open``: with the ext_proc unreachable, send requests to the least-loaded healthy engine of the
    cluster (the Inference Extension's FailOpen; any model's engine) instead of answering 503. Envoy can
    only go on without its processor when it kept the body, so the ext_proc then gets each body whole
    (BUFFERED body mode): bodies are limited by Envoy's buffer (``buffer_limit_bytes``; 413 beyond).
    ``max_retries``: further fallbacks tried per request. ``stream_idle_timeout_s``: no byte either way
    for this long ends a routed stream (a non-streamed answer is silent until it is complete: keep this
    above the longest one); a request the ext_proc holds before its decision is bounded by
    :func:`listener_idle_timeout_s` instead. ``eds_initial_fetch_s``: how long Envoy waits for the first
    endpoint list before it starts serving without one (the list follows as soon as an ext_proc
    answers)."""

    fail_open: bool = False
    max_retries: int = 2
    stream_idle_timeout_s: float = 300.0
    #: (model, seconds): that model's own stream idle timeout (``[[models]] idle_timeout_s``), on a route
    #: chosen by the header the ext_proc sets (:data:`~contracts.epp.MODEL_HEADER`).
    model_idle_timeouts: tuple[tuple[str, float], ...] = ()
    eds_initial_fetch_s: float = 2.0
    extproc_health_interval_s: float = 0.5


def model_idle_timeouts(config: GatewayConfig) -> tuple[tuple[str, float], ...]:
    """The ``[[models]]`` of a gateway config that set their own ``idle_timeout_s``."""
    return tuple((m.name, m.idle_timeout_s) for m in config.models if m.idle_timeout_s is not None)


def listener_idle_timeout_s(res: Resilience, max_hold_s: float) -> float:
    """The listener's (HCM's) stream idle timeout: ``stream_idle_timeout_s``, or the longest hold the
    ext_proc may ask Envoy for (``max_hold_s``, the filter's ``max_message_timeout``) if longer. Routed
    requests get ``stream_idle_timeout_s`` (or their model's) from their route (:func:`routes`)."""
    return max(res.stream_idle_timeout_s, max_hold_s)


def routes(res: Resilience, action: dict[str, Any]) -> list[dict[str, Any]]:
    """The listener's routes, all to ``action`` (cluster, retries, response headers): one per model with
    its own idle timeout, matched on the model header the ext_proc set (the route is chosen again after
    the ext_proc's reply), then any other decided request's (the model header present:
    ``stream_idle_timeout_s``), then the default, for a request with no decision (the listener's idle
    timeout, :func:`listener_idle_timeout_s`). The model header never reaches an engine."""
    out = [
        {
            "match": {"prefix": "/", "headers": [{"name": MODEL_HEADER, "string_match": {"exact": model}}]},
            "route": {**action, "idle_timeout": f"{idle}s"},
            "request_headers_to_remove": [MODEL_HEADER],
        }
        for model, idle in res.model_idle_timeouts
    ]
    out.append(
        {
            "match": {"prefix": "/", "headers": [{"name": MODEL_HEADER, "present_match": True}]},
            "route": {**action, "idle_timeout": f"{res.stream_idle_timeout_s}s"},
            "request_headers_to_remove": [MODEL_HEADER],
        }
    )
    out.append({"match": {"prefix": "/"}, "route": action, "request_headers_to_remove": [MODEL_HEADER]})
    return out


def retry_policy(res: Resilience) -> dict[str, Any]:
    """The route's retry policy (the next try goes to the next host of the decision's list)."""
    return {
        "retry_on": RETRY_ON,
        "retriable_status_codes": list(RETRIABLE_STATUS),
        "num_retries": res.max_retries,
        "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
    }


def extproc_retry_policy(res: Resilience) -> dict[str, Any]:
    """An ext_proc stream that fails before its replica answered (the replica died, the connection was
    closed under it) is opened again on another replica."""
    return {
        "retry_on": "reset,connect-failure,refused-stream,unavailable",
        "num_retries": max(1, res.max_retries),
        "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": _PREVIOUS_HOSTS},
            }
        ],
        "host_selection_retry_max_attempts": 3,
    }


def engines_cluster(res: Resilience, connect_timeout_s: float, buffer_limit: int) -> dict[str, Any]:
    """``kvgate_engines``: EDS from the ext_procs, balanced by the decision's list (``override_host``)."""
    if res.fail_open:
        fallback = {"name": "least_request", "typed_config": {"@type": _LEAST_REQUEST}}
    else:
        fallback = {
            "name": "no_host",
            "typed_config": {
                "@type": _SUBSET,
                "fallback_policy": "NO_FALLBACK",
                "subset_selectors": [{"keys": ["kvgate-no-such-key"]}],
                "subset_lb_policy": {
                    "policies": [
                        {"typed_extension_config": {"name": "rr", "typed_config": {"@type": _ROUND_ROBIN}}}
                    ]
                },
            },
        }
    return {
        "name": ENGINES_CLUSTER,
        "type": "EDS",
        "eds_cluster_config": {
            "service_name": ENGINES_CLUSTER,
            "eds_config": {
                "resource_api_version": "V3",
                "initial_fetch_timeout": f"{res.eds_initial_fetch_s}s",
                "api_config_source": {
                    "api_type": "GRPC",
                    "transport_api_version": "V3",
                    "set_node_on_first_message_only": True,
                    "grpc_services": [{"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}}],
                },
            },
        },
        "connect_timeout": f"{connect_timeout_s}s",
        "per_connection_buffer_limit_bytes": buffer_limit,
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": {
                            "@type": _OVERRIDE_HOST,
                            "override_host_sources": [
                                {"metadata": {"key": LB_NS, "path": [{"key": DESTINATION}]}}
                            ],
                            "fallback_policy": {"policies": [{"typed_extension_config": fallback}]},
                        },
                    }
                }
            ]
        },
        # Used by the fail-open fallback only (override_host ignores host health; the ext_procs eject).
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 2,
            "consecutive_gateway_failure": 2,
            "interval": "1s",
            "base_ejection_time": "2s",
            "max_ejection_percent": 50,
        },
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": 100000,
                    "max_pending_requests": 100000,
                    "max_requests": 100000,
                    "retry_budget": {"budget_percent": {"value": 20.0}, "min_retry_concurrency": 10},
                }
            ]
        },
    }


def extproc_cluster(res: Resilience, addresses: tuple[tuple[str, int], ...]) -> dict[str, Any]:
    """``kvgate_extproc``: every ext_proc replica, HTTP/2, gRPC-health-checked, ejected on connect failure;
    by address, or by DNS name when one is a name (a STATIC cluster takes addresses only)."""
    return {
        "name": EXTPROC_CLUSTER,
        "type": cluster_type(h for h, _ in addresses),
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTS,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": EXTPROC_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(h, p)}} for h, p in addresses]}],
        },
        "health_checks": [
            {
                "timeout": "1s",
                "interval": f"{res.extproc_health_interval_s}s",
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": "liveness"},
            }
        ],
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "interval": "1s",
            "base_ejection_time": "1s",
            "max_ejection_percent": 100,
        },
    }


def failure_log_clusters(
    addresses: tuple[tuple[str, int], ...], base: dict[str, Any]
) -> list[dict[str, Any]]:
    """One cluster per ext_proc replica (a copy of ``base``, the ``kvgate_extproc`` cluster, with one host
    and no health check): Envoy's gRPC access logger streams to one host of a cluster, and every replica
    must hear every failure."""
    out = []
    for i, (host, port) in enumerate(addresses):
        cluster = {k: v for k, v in base.items() if k not in ("health_checks", "outlier_detection")}
        cluster["name"] = failure_log_cluster(i)
        cluster["type"] = cluster_type((host,))
        cluster["load_assignment"] = {
            "cluster_name": cluster["name"],
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(host, port)}}]}],
        }
        out.append(cluster)
    return out


def failure_log_cluster(i: int) -> str:
    return f"{EXTPROC_CLUSTER}_log_{i}"


def failure_loggers(count: int) -> list[dict[str, Any]]:
    """The router's ``upstream_log``: each failed try, to each of ``count`` ext_proc replicas."""
    failed = {
        "or_filter": {
            "filters": [
                {"response_flag_filter": {"flags": list(FAILURE_FLAGS)}},
                # An engine's own 503 (Envoy's local 503s have no upstream try to log).
                {"status_code_filter": _status_eq(503)},
            ]
        }
    }
    return _grpc_loggers(count, failed)


def timeout_loggers(count: int) -> list[dict[str, Any]]:
    """The listener's access log of requests that ran out of their whole bound (``UT``) or whose engine
    stayed silent past the idle timeout (``SI``): Envoy logs that try upstream with no flag and no status
    (measured on 1.40), so only the request's own entry, whose upstream host is the engine it waited for,
    tells the ext_procs."""
    return _grpc_loggers(count, {"response_flag_filter": {"flags": ["UT", "SI"]}})


def completion_loggers(count: int) -> list[dict[str, Any]]:
    """The listener's access log of every request the ext_proc routed (``kvgate.decision`` metadata
    present), once its response is complete, to each of ``count`` ext_proc replicas: the completion
    signal (:data:`~contracts.epp.COMPLETION_LOG_NAME`)."""
    routed = {
        "metadata_filter": {
            # match_if_key_not_found defaults to TRUE in Envoy: it must be false here.
            "match_if_key_not_found": False,
            "matcher": {
                "filter": DECISION_NS,
                "path": [{"key": DECISION_ENDPOINT}],
                "value": {"present_match": True},
            },
        }
    }
    return _grpc_loggers(count, routed, COMPLETION_LOG_NAME, COMPLETION_FLUSH_S)


def _grpc_loggers(
    count: int, only: dict[str, Any], log_name: str = FAILURE_LOG_NAME, flush_s: float = FAILURE_FLUSH_S
) -> list[dict[str, Any]]:
    return [
        {
            "name": "envoy.access_loggers.http_grpc",
            "filter": only,
            "typed_config": {
                "@type": _GRPC_LOG,
                "common_config": {
                    "log_name": log_name,
                    "transport_api_version": "V3",
                    "grpc_service": {"envoy_grpc": {"cluster_name": failure_log_cluster(i)}},
                    "buffer_flush_interval": f"{flush_s}s",
                },
            },
        }
        for i in range(count)
    ]


def _status_eq(code: int) -> dict[str, Any]:
    return {
        "comparison": {
            "op": "EQ",
            "value": {"default_value": code, "runtime_key": f"kvgate.failed_try.{code}"},
        }
    }


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}
