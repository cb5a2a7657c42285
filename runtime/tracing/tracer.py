"""A daemon's tracer: OpenTelemetry's SDK behind a few calls, or nothing at all.

:func:`build` gives ``None`` when ``[tracing] enabled`` is false: callers keep a ``Tracer | None`` and test
it once per request, so an untraced process creates no span object and loads no exporter. When enabled, a
:class:`Tracer` owns its own ``TracerProvider`` (never the global one: tests run several in a process),
samples new traces at ``sampling_ratio`` and follows a traced parent's decision (``ParentBased``), reads and
writes W3C ``traceparent``/``tracestate`` only (no baggage: a client's baggage could carry anything), and
exports batches to an OTLP/gRPC collector.

What goes into attributes is the caller's choice and always one of a fixed set of names with numbers,
model names, endpoint ids, statuses; never a prompt, token ids, a request body or a credential.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from contextlib import AbstractContextManager

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from contracts.tracing import Timeline, TracingSettings

log = logging.getLogger(__name__)

#: The only propagation headers read from or written to a request.
TRACE_HEADERS = ("traceparent", "tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()
#: One ``tracestate`` list member (W3C Trace Context, section 3.3.1): a simple key (lower-case letter, then
#: up to 255 of ``a-z 0-9 _ - * /``) or a multi-tenant ``tenant@system`` key, ``=``, a value of up to 256
#: printable ASCII characters other than ``,`` and ``=`` (not ending in a space).
_TS_KEY_CHARS = r"[a-z0-9_\-*/]"
_TS_MEMBER = re.compile(
    rf"(?:[a-z]{_TS_KEY_CHARS}{{0,255}}|[a-z0-9]{_TS_KEY_CHARS}{{0,240}}@[a-z]{_TS_KEY_CHARS}{{0,13}})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)

__all__ = [
    "TRACE_HEADERS", "Span", "SpanKind", "Tracer", "active", "build", "current_headers", "current_span",
]  # fmt: skip


class Tracer:
    """Spans of one process (``settings.service_name``), exported to ``settings.endpoint``."""

    def __init__(self, settings: TracingSettings, exporter: SpanExporter | None = None) -> None:
        """``exporter``: where batches go instead of OTLP/gRPC to ``settings.endpoint`` (benchmarks)."""
        self.settings = settings
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name}),
            sampler=ParentBased(TraceIdRatioBased(settings.sampling_ratio)),
        )
        if exporter is None:
            exporter = OTLPSpanExporter(endpoint=f"http://{settings.endpoint}", insecure=True)
        self._provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=settings.flush_interval_s * 1000)
        )
        self._tracer = self._provider.get_tracer("kvgate")

    @staticmethod
    def extract(headers: Mapping[str, str]) -> Context | None:
        """The remote parent named by ``headers``' ``traceparent`` (keys lower-case); ``None`` without a
        valid one."""
        if "traceparent" not in headers:
            return None
        carrier = {k: headers[k] for k in TRACE_HEADERS if k in headers}
        if not _valid_tracestate(carrier.get("tracestate", "")):
            # OpenTelemetry would drop it too, after logging the offending member as sent (line breaks
            # and all): a client's header never writes a log line.
            del carrier["tracestate"]
        ctx = _PROPAGATOR.extract(carrier)
        return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None

    def start(
        self,
        name: str,
        *,
        parent: Context | Span | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        start_ns: int | None = None,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> Span:
        """A started span (end it with ``span.end()``); ``parent``: a remote context, a span, or none (the
        task's current span, see :func:`active`; else a new trace, sampled at the ratio). Not made current."""
        ctx = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
        return self._tracer.start_span(
            name, context=ctx, kind=kind, start_time=start_ns, attributes=attributes
        )

    def emit(self, timeline: Timeline, parent: Span) -> None:
        """``timeline``'s phases as child spans of ``parent``, with their recorded bounds."""
        ctx = trace.set_span_in_context(parent)
        for name, start, end in timeline.spans:
            self._tracer.start_span(name, context=ctx, start_time=start).end(end_time=end)

    @staticmethod
    def headers(span: Span) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming ``span``, for an outgoing request."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
        return carrier

    @staticmethod
    def fail(span: Span, reason: str) -> None:
        """Mark ``span`` failed with a short, fixed ``reason`` (never a message that quotes input)."""
        span.set_status(Status(StatusCode.ERROR, reason))

    def shutdown(self) -> None:
        """Flush what is batched (bounded by the exporter's timeout) and stop exporting."""
        try:
            self._provider.shutdown()
        except Exception:  # a collector gone at exit must not fail the daemon's stop
            log.warning("tracing: the last spans could not be exported", exc_info=True)


def _valid_tracestate(value: str) -> bool:
    """Whether every member of a ``tracestate`` value is well formed (empty members allowed)."""
    return all(not m or _TS_MEMBER.fullmatch(m) for m in (m.strip(" \t") for m in value.split(",")))


def active(span: Span) -> AbstractContextManager[Span]:
    """Make ``span`` the current one of this task while in the ``with`` block (not ended on exit): spans
    started there without a parent, and :func:`current_headers`, name it."""
    return trace.use_span(span, end_on_exit=False)


def current_span() -> Span:
    """The task's current span (a non-recording one when none is)."""
    return trace.get_current_span()


def current_headers() -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of the task's current span, for an outgoing call; empty when
    no span is current (tracing off, or outside a traced request)."""
    carrier: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        _PROPAGATOR.inject(carrier)
    return carrier


def build(settings: TracingSettings) -> Tracer | None:
    """A :class:`Tracer` when ``settings.enabled``, else ``None``."""
    return Tracer(settings) if settings.enabled else None
