"""The failed-try receiver: Envoy's gRPC access-log service, fed one entry per failed upstream try.

Envoy's router ``upstream_log`` (an ``envoy.access_loggers.http_grpc`` logger per ext_proc replica, log
name :data:`~contracts.epp.FAILURE_LOG_NAME`, filtered to failed tries) streams
``StreamAccessLogsMessage`` s here. :func:`failed_try` reads one ``HTTPAccessLogEntry`` (pure): the
upstream host and the failure's kind. :class:`FailedTries` is the grpc.aio shell: it maps the host to
the fleet's endpoint by address, asks the :class:`~extproc.xds.ejection.Ejector` and ejects it in the
fleet (which the scheduler and EDS read). Entries of other log names and unknown addresses are ignored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from contracts.epp import FAILURE_LOG_NAME
from extproc.fleet import Fleet
from extproc.xds.ejection import Ejection, Ejector

log = logging.getLogger(__name__)

FAILURE_FLAGS = (
    "upstream_connection_failure",
    "upstream_request_timeout",
    "upstream_connection_termination",
    "upstream_remote_reset",
    "upstream_overflow",
    "upstream_protocol_error",
    "stream_idle_timeout",
)
"""``AccessLogCommon.response_flags`` fields that mark a failed try (Envoy's UF, UT, UC, UR, UO, UPE, and SI:
a request whose engine stayed silent past the model's idle timeout, from the listener's log), in the
order a kind is chosen when several are set; the kind is the field's name."""
REFUSED_STATUS = 503
REFUSED_KIND = "http_503"
"""The kind of a try the engine answered with 503 (draining, overloaded) and no failure flag."""


@dataclass(frozen=True, slots=True)
class FailedTry:
    """A failed try: the upstream ``address`` (``ip:port``, ``[ipv6]:port``) and its ``kind``."""

    address: str
    kind: str


def failed_try(entry: accesslog_pb2.HTTPAccessLogEntry) -> FailedTry | None:
    """The failed try ``entry`` records, or ``None`` (no upstream socket address, or neither a failure
    flag of :data:`FAILURE_FLAGS` nor a 503 response)."""
    common = entry.common_properties
    if not common.upstream_remote_address.HasField("socket_address"):
        return None
    sa = common.upstream_remote_address.socket_address
    host = f"[{sa.address}]" if ":" in sa.address else sa.address
    address = f"{host}:{sa.port_value}"
    flags = common.response_flags
    for name in FAILURE_FLAGS:
        if getattr(flags, name):
            return FailedTry(address, name)
    if entry.response.response_code.value == REFUSED_STATUS:
        return FailedTry(address, REFUSED_KIND)
    return None


class FailedTries(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """``StreamAccessLogs``: each failed try of :data:`~contracts.epp.FAILURE_LOG_NAME` to a fleet
    endpoint ejects it (:meth:`Ejector.fail` at ``clock()``, monotonic seconds) in ``fleet``; each
    ejection is logged at WARNING (endpoint id, kind, duration; never request content) and handed to
    ``on_ejection``. :meth:`aclose` ends the open streams (Envoy reopens one to another replica)."""

    def __init__(
        self,
        fleet: Fleet,
        ejector: Ejector,
        clock: Callable[[], float],
        on_ejection: Callable[[Ejection], None] | None = None,
    ) -> None:
        self._fleet = fleet
        self._ejector = ejector
        self._clock = clock
        self._on_ejection = on_ejection
        self._closed = asyncio.Event()

    async def aclose(self) -> None:
        self._closed.set()

    def record(self, failed: FailedTry) -> Ejection | None:
        """Apply one failed try: the new ejection, or ``None`` (unknown address, already ejected)."""
        state = self._fleet.by_address(failed.address)
        if state is None:
            log.debug("failed try to %s ignored: not a fleet endpoint", failed.address)
            return None
        ejection = self._ejector.fail(state.id, failed.kind, self._clock())
        if ejection is None:
            return None
        self._fleet.eject(state.id, ejection.until)
        log.warning(
            "endpoint %s ejected for %.1f s after a failed try (%s; ejection %d in a row)",
            state.id,
            ejection.duration_s,
            ejection.kind,
            ejection.count,
        )
        if self._on_ejection is not None:
            self._on_ejection(ejection)
        return ejection

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext,
    ) -> als_pb2.StreamAccessLogsResponse:
        if self._closed.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "ext_proc draining")
        reader = asyncio.create_task(self._read(request_iterator))
        closed = asyncio.create_task(self._closed.wait())
        try:
            await asyncio.wait((reader, closed), return_when=asyncio.FIRST_COMPLETED)
            if reader.done():
                reader.result()
        finally:
            reader.cancel()
            closed.cancel()
        return als_pb2.StreamAccessLogsResponse()

    async def _read(self, messages: AsyncIterator[als_pb2.StreamAccessLogsMessage]) -> None:
        """The identifier (and so the log name) comes with a stream's first message only."""
        log_name: str | None = None
        async for msg in messages:
            if msg.HasField("identifier"):
                log_name = msg.identifier.log_name
            if log_name != FAILURE_LOG_NAME:
                continue
            for entry in msg.http_logs.log_entry:
                failed = failed_try(entry)
                if failed is not None:
                    self.record(failed)
