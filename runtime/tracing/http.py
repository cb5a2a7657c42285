"""A span per request of an aiohttp server (the agent's admin and slot API): its parent the caller's
``traceparent`` (the ext_proc's ``slot_restore`` span), named ``METHOD /route`` (the route's pattern,
never the path as sent; ``HTTP /route`` for a method the conventions do not know), with the method, the
route and the status as attributes. The span is the task's current one while the handler runs, so calls
it makes (kvcached's client) carry it on."""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from runtime.tracing.tracer import TRACE_HEADERS, SpanKind, Tracer, active

#: The methods OpenTelemetry's HTTP conventions call known (RFC 9110's, PATCH, QUERY); any other one
#: (aiohttp also parses WebDAV's, and methods in lower case) is ``_OTHER``, its span named ``HTTP <route>``.
KNOWN_METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH", "QUERY")
)
OTHER_METHOD = "_OTHER"


def traced(tracer: Tracer, skip: Iterable[str] = ()) -> Middleware:
    """The middleware; ``skip``: paths never traced (probes and scrapes: ``/healthz``, ``/metrics``)."""
    skipped = frozenset(skip)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in skipped:
            return await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        carrier = {k: request.headers[k] for k in TRACE_HEADERS if k in request.headers}
        method = request.method if request.method in KNOWN_METHODS else OTHER_METHOD
        attributes = {"http.request.method": method, "http.route": route}
        if method == OTHER_METHOD:
            attributes["http.request.method_original"] = request.method
        span = tracer.start(
            f"{'HTTP' if method == OTHER_METHOD else method} {route}",
            parent=tracer.extract(carrier),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
        status = 500
        try:
            with active(span):
                response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                Tracer.fail(span, "server error")
            span.end()

    return middleware
