"""A real OTLP/gRPC trace receiver for tests: the collector's ``TraceService`` (``opentelemetry-proto``)
served on 127.0.0.1, keeping every span it is sent (Envoy's and kvgate's exporters speak to it as to any
OpenTelemetry collector)."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.polling import poll


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One span as exported: ids in hex (``parent`` empty for a root), kind as OTLP numbers it
    (2 server, 3 client), every attribute of the span and of its resource."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    attributes: dict[str, Any] = field(default_factory=dict)
    resource: dict[str, Any] = field(default_factory=dict)


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    """The receiver; ``endpoint`` is its ``host:port``; :attr:`spans` grows as exports arrive."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent=s.parent_span_id.hex(),
                            kind=s.kind,
                            attributes={kv.key: _value(kv.value) for kv in s.attributes},
                            resource=resource,
                        )
                    )
        with self._lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, check: Any, timeout_s: float, what: str) -> list[ReceivedSpan]:
        """The spans once ``check(spans)`` is true (polled; fails after ``timeout_s``)."""
        return poll(lambda: (lambda s: s if check(s) else None)(self.snapshot()), timeout_s, what, 0.05)

    def start(self) -> Collector:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)
