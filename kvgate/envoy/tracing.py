"""Envoy's OpenTelemetry tracer, rendered when the gateway config's ``[tracing]`` is enabled.

Envoy starts (or continues, from a client's W3C ``traceparent``) a span per request on the OpenAI
listener, and its ext_proc filter calls the ext_proc under a child span whose ``traceparent`` goes with
the gRPC call: the ext_proc's request span (:mod:`extproc.server`) is that span's child, so one trace runs
client -> Envoy -> ext_proc -> engine. Envoy samples new traces at the same ratio as the ext_proc
(``random_sampling``, percent) and exports to the same OTLP/gRPC collector through a cluster of its own,
flushing every ``flush_interval_s`` (Envoy's runtime key ``tracing.opentelemetry.flush_interval_ms``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contracts.tracing import TracingSettings
from kvgate.envoy.hosts import cluster_type

COLLECTOR_CLUSTER = "kvgate_otel_collector"
#: Envoy's ``service.name``.
ENVOY_SERVICE = "kvgate-envoy"
_OTEL = "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig"
_HTTP_OPTS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


@dataclass(frozen=True, slots=True)
class EnvoyTracing:
    """Where Envoy sends its spans (``host:port`` of an OTLP/gRPC collector), the ratio of new traces it
    samples (0..1) and how often it flushes (s)."""

    endpoint: str
    sampling_ratio: float = 1.0
    flush_interval_s: float = 1.0

    @staticmethod
    def from_settings(settings: TracingSettings) -> EnvoyTracing | None:
        """Envoy's tracing for a gateway's ``[tracing]``; ``None`` when it is off."""
        if not settings.enabled:
            return None
        return EnvoyTracing(settings.endpoint, settings.sampling_ratio, settings.flush_interval_s)


def hcm_tracing(tracing: EnvoyTracing) -> dict[str, Any]:
    """The HTTP connection manager's ``tracing``: the OpenTelemetry provider and the sampling percent."""
    return {
        "random_sampling": {"value": tracing.sampling_ratio * 100.0},
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": _OTEL,
                "grpc_service": {"envoy_grpc": {"cluster_name": COLLECTOR_CLUSTER}, "timeout": "1s"},
                "service_name": ENVOY_SERVICE,
            },
        },
    }


def collector_cluster(tracing: EnvoyTracing) -> dict[str, Any]:
    """The collector's cluster: HTTP/2 (gRPC), by address, or by DNS name."""
    host, _, port = tracing.endpoint.rpartition(":")
    host = host.strip("[]")
    kind = cluster_type((host,))
    address = {"socket_address": {"address": host, "port_value": int(port)}}
    return {
        "name": COLLECTOR_CLUSTER,
        "type": kind,
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTS,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": COLLECTOR_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
        },
    }


def runtime_layer(tracing: EnvoyTracing) -> dict[str, Any]:
    """Envoy's runtime keys for the tracer: flush batches at least every ``flush_interval_s``."""
    return {
        "layers": [
            {
                "name": "kvgate_tracing",
                "static_layer": {
                    "tracing.opentelemetry.flush_interval_ms": round(tracing.flush_interval_s * 1000),
                    "tracing.opentelemetry.min_flush_spans": 1,
                },
            }
        ]
    }
