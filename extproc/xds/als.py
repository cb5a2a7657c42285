"""The access-log receiver: Envoy's gRPC access-log service, fed failed tries and completed requests.

Two logs arrive here, told apart by the log name of each stream's first message:

* :data:`~contracts.epp.FAILURE_LOG_NAME`: one entry per failed upstream try (the router's
  ``upstream_log``) or timed-out request (the listener's). :func:`failed_try` reads one
  ``HTTPAccessLogEntry`` (pure): the upstream host and the failure's kind. :class:`FailedTries` maps the
  host to the fleet's endpoint by address, asks the :class:`~extproc.xds.ejection.Ejector` and ejects it
  in the fleet (which the scheduler and EDS read).
* :data:`~contracts.epp.COMPLETION_LOG_NAME`: one entry per request an ext_proc routed, once its response
  is complete (the listener's ``access_log``, :func:`kvgate.envoy.resilience.completion_loggers`).
  :func:`completion` reads it (pure) and :class:`FailedTries` hands it to ``on_completion``: every
  replica hears every completion, the one that routed the request counts it.

Entries of other log names, and failed tries to unknown addresses, are ignored.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Value

from contracts.epp import (
    COMPLETION_LOG_NAME,
    DECISION_ENDPOINT,
    DECISION_MATCHED_TOKENS,
    DECISION_MODEL,
    DECISION_NS,
    DECISION_RESPONSES_SCOPE,
    FAILURE_LOG_NAME,
    USAGE_CACHED,
    USAGE_NS,
    USAGE_RESPONSE_ID,
)
from contracts.federation import FORWARD_STREAMED, REFUSED_HEADER, UNTRUSTED
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
UNTRUSTED_KIND = UNTRUSTED
"""The kind of a forwarded try a peer cluster refused with 401 :data:`~contracts.federation.UNTRUSTED`
(``extproc/federation/README.md``: its link does not trust this cluster's tenants)."""


@dataclass(frozen=True, slots=True)
class FailedTry:
    """A failed try: the upstream ``address`` (``ip:port``, ``[ipv6]:port``) and its ``kind``."""

    address: str
    kind: str


@dataclass(frozen=True, slots=True)
class Completion:
    """A request an ext_proc routed, complete: the ``address`` (``ip:port``, ``[ipv6]:port``) of the
    engine Envoy last sent it to, its ``request_id`` (Envoy's ``x-request-id``, the id the ext_proc decided
    it under), the response ``status`` (0: none, e.g. the engine was unreachable or the client left
    first), ``ttfb_s``: seconds from the request's start to the engine's first response byte, and
    ``duration_s``: seconds from the request's start to its end (each ``None`` when Envoy did not
    record it). From the entry's metadata (``None`` when absent): the decision's ``model``, ``endpoint``
    id and ``predicted_tokens`` (prompt tokens the pick was predicted to hold), and ``cached_tokens``,
    the prompt tokens the engine reported it reused (:mod:`kvgate.envoy.usage`)."""

    address: str
    request_id: str
    status: int
    ttfb_s: float | None
    duration_s: float | None
    model: str | None = None
    endpoint: str | None = None
    predicted_tokens: int | None = None
    cached_tokens: int | None = None
    #: A Responses API request's affinity scope (decision metadata) and the response id Envoy read from
    #: its JSON answer (:mod:`extproc.affinity`); ``None`` otherwise.
    responses_scope: str | None = None
    response_id: str | None = None
    #: A request forwarded to a peer cluster, streamed (decision metadata): its ``ttfb_s`` is the peer's.
    streamed: bool = False


def _upstream(common: accesslog_pb2.AccessLogCommon) -> str | None:
    """``ip:port`` (``[ipv6]:port``) of the entry's upstream host, ``None`` when it has none."""
    if not common.upstream_remote_address.HasField("socket_address"):
        return None
    sa = common.upstream_remote_address.socket_address
    host = f"[{sa.address}]" if ":" in sa.address else sa.address
    return f"{host}:{sa.port_value}"


def _seconds(common: accesslog_pb2.AccessLogCommon, name: str) -> float | None:
    if not common.HasField(name):
        return None
    value: Duration = getattr(common, name)
    return value.seconds + value.nanos / 1e9


def completion(entry: accesslog_pb2.HTTPAccessLogEntry) -> Completion | None:
    """The completion ``entry`` records, or ``None`` (no request id). ``address`` is ``""`` when the
    request reached no upstream host (every try failed to connect): it still ends a routed request, whose
    outstanding count it releases. ``duration_s`` is Envoy's request ``duration``, else the time to its
    last byte sent downstream."""
    common = entry.common_properties
    address = _upstream(common) or ""
    request_id = entry.request.request_id
    if not request_id:
        return None
    duration = _seconds(common, "duration")
    if duration is None:
        duration = _seconds(common, "time_to_last_downstream_tx_byte")
    meta = common.metadata.filter_metadata
    decision = meta[DECISION_NS].fields if DECISION_NS in meta else None
    usage = meta[USAGE_NS].fields if USAGE_NS in meta else None
    return Completion(
        address,
        request_id,
        entry.response.response_code.value,
        _seconds(common, "time_to_first_upstream_rx_byte"),
        duration,
        model=_text(decision, DECISION_MODEL),
        endpoint=_text(decision, DECISION_ENDPOINT),
        predicted_tokens=_count(decision, DECISION_MATCHED_TOKENS),
        cached_tokens=_count(usage, USAGE_CACHED),
        responses_scope=_text(decision, DECISION_RESPONSES_SCOPE),
        response_id=_text(usage, USAGE_RESPONSE_ID),
        streamed=_text(decision, FORWARD_STREAMED) == "1",
    )


def _text(fields: Mapping[str, Value] | None, key: str) -> str | None:
    value = fields.get(key) if fields is not None else None
    if value is None or not value.HasField("string_value"):
        return None
    return value.string_value or None


def _count(fields: Mapping[str, Value] | None, key: str) -> int | None:
    """A non-negative whole number under ``key`` (a number, or a numeric string), else ``None``."""
    value = fields.get(key) if fields is not None else None
    if value is None:
        return None
    if value.HasField("number_value"):
        number = value.number_value
    elif value.HasField("string_value") and value.string_value.isascii() and value.string_value.isdigit():
        number = float(value.string_value)
    else:
        return None
    return int(number) if math.isfinite(number) and number >= 0 else None


def failed_try(entry: accesslog_pb2.HTTPAccessLogEntry) -> FailedTry | None:
    """The failed try ``entry`` records, or ``None`` (no upstream socket address, or neither a failure
    flag of :data:`FAILURE_FLAGS` nor a 503 response nor a peer's 401 :data:`UNTRUSTED_KIND`)."""
    common = entry.common_properties
    address = _upstream(common)
    if address is None:
        return None
    flags = common.response_flags
    for name in FAILURE_FLAGS:
        if getattr(flags, name):
            return FailedTry(address, name)
    if entry.response.response_code.value == REFUSED_STATUS:
        return FailedTry(address, REFUSED_KIND)
    if (
        entry.response.response_code.value == 401
        and entry.response.response_headers.get(REFUSED_HEADER) == UNTRUSTED
    ):
        return FailedTry(address, UNTRUSTED_KIND)  # a linked peer that does not trust our tenants
    return None


class FailedTries(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """``StreamAccessLogs``: each failed try of :data:`~contracts.epp.FAILURE_LOG_NAME` to a fleet
    endpoint ejects it (:meth:`Ejector.fail` at ``clock()``, monotonic seconds) in ``fleet``; each
    ejection is logged at WARNING (endpoint id, kind, duration; never request content) and handed to
    ``on_ejection``. Each entry of :data:`~contracts.epp.COMPLETION_LOG_NAME` that :func:`completion`
    reads is handed to :attr:`on_completion` on the event loop, whether or not this replica routed it
    (every completion frees a slot at an engine); it must be cheap, and an exception it raises is logged
    and skipped. :meth:`aclose` ends the open streams (Envoy reopens one to another replica)."""

    def __init__(
        self,
        fleet: Fleet,
        ejector: Ejector,
        clock: Callable[[], float],
        on_ejection: Callable[[Ejection], None] | None = None,
        on_completion: Callable[[Completion], None] | None = None,
    ) -> None:
        self._fleet = fleet
        self._ejector = ejector
        self._clock = clock
        self._on_ejection = on_ejection
        #: Told of each completion (``None``: completions are read and dropped); may be set after
        #: construction, before the first completion it should hear.
        self.on_completion = on_completion
        #: Told of every failed try before the fleet lookup (federation: tries to a peer's ingress).
        self.on_failed_try: Callable[[FailedTry], None] | None = None
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
            if log_name == FAILURE_LOG_NAME:
                for entry in msg.http_logs.log_entry:
                    self._failed(entry)
            elif log_name == COMPLETION_LOG_NAME:
                for entry in msg.http_logs.log_entry:
                    self._complete(entry)

    def _failed(self, entry: accesslog_pb2.HTTPAccessLogEntry) -> None:
        try:
            failed = failed_try(entry)
            if failed is not None:
                if self.on_failed_try is not None:
                    self.on_failed_try(failed)
                self.record(failed)
        except Exception:  # one bad entry must not end Envoy's log stream (and lose the rest)
            log.exception("failed-try log entry skipped")

    def _complete(self, entry: accesslog_pb2.HTTPAccessLogEntry) -> None:
        callback = self.on_completion
        if callback is None:
            return
        try:
            done = completion(entry)
            if done is not None:
                callback(done)
        except Exception:  # one bad completion must not end Envoy's log stream (and lose the rest)
            log.exception("completion log entry skipped")
