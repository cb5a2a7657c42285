"""A span per request of an aiohttp server (the agent's admin and slot API): its parent the caller's
``traceparent`` (the ext_proc's ``slot_restore`` span), named ``METHOD /route`` (the route's pattern,
never the path as sent), with the method, the route and the status as attributes. The span is the task's
current one while the handler runs, so calls it makes (kvcached's client) carry it on."""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from runtime.tracing.tracer import TRACE_HEADERS, SpanKind, Tracer, active


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
        span = tracer.start(
            f"{request.method} {route}",
            parent=tracer.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "http.route": route},
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
