"""The migration proxy's failed tries, reported to every ext_proc as Envoy reports its own.

For an opted-in model Envoy's upstream is the proxy, which answers 200 while it continues a stream
elsewhere: Envoy's ``upstream_log`` never sees the engine's failure, so without this the ext_procs would
never eject an engine that resets or refuses the proxy's tries (only their scrape notices a dead one; an
engine that still answers ``/metrics`` but resets requests would stay in every pick). So the proxy sends
each failed try to each ext_proc's gRPC access-log service (the ext_proc port,
``envoy.service.accesslog.v3.AccessLogService``), as an ``HTTPAccessLogEntry`` under
:data:`~contracts.epp.FAILURE_LOG_NAME`, the log Envoy's router writes: the upstream address and the
failure as Envoy's response flag (``upstream_connection_failure``: refused or unreachable;
``upstream_remote_reset``: reset, closed, or a stream ended before ``[DONE]``) or the engine's status
(a 503 ejects, as from Envoy; another 5xx does not). The ext_procs apply it exactly as Envoy's entries
(:class:`extproc.xds.als.FailedTries`). With the secure profile the reports go over mTLS under the
identity the proxy is started with (``kvgate up --secure``: Envoy's, the one caller an ext_proc port
admits; README.md); given as :class:`~runtime.tls.ReloadingClientCerts`, a rotated certificate is taken
up by the next report (new channels; the old ones close once their reports are sent). The ext_proc's
role is not checked on this hop (the chain and address are; gRPC's Python client cannot check a URI SAN,
only an exact DNS name through ``grpc.ssl_target_name_override``: README.md, "Whom it reached").
Sending is fire-and-forget with a short deadline: a report lost to a restarting ext_proc costs one
ejection there, never a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from contracts.epp import FAILURE_LOG_NAME
from runtime.tls import ReloadingClientCerts, secure_channel

log = logging.getLogger(__name__)

CONNECT_FAILURE = "upstream_connection_failure"
REMOTE_RESET = "upstream_remote_reset"
#: Seconds a report may take to reach one ext_proc.
DEADLINE_S = 2.0


def entry(host: str, flag: str | None = None, status: int | None = None) -> accesslog_pb2.HTTPAccessLogEntry:
    """The access-log entry of one failed try to ``host`` (``ip:port``): a response flag or a status."""
    address, _, port = host.rpartition(":")
    out = accesslog_pb2.HTTPAccessLogEntry()
    sa = out.common_properties.upstream_remote_address.socket_address
    sa.address, sa.port_value = address.strip("[]"), int(port)
    if flag is not None:
        setattr(out.common_properties.response_flags, flag, True)
    if status is not None:
        out.response.response_code.value = status
    return out


def message(entries: Sequence[accesslog_pb2.HTTPAccessLogEntry]) -> als_pb2.StreamAccessLogsMessage:
    msg = als_pb2.StreamAccessLogsMessage()
    msg.identifier.log_name = FAILURE_LOG_NAME
    msg.http_logs.log_entry.extend(entries)
    return msg


class FailureReports:
    """Reports failed tries to the ext_procs at ``targets`` (``host:port`` of each one's gRPC port); over
    mTLS with ``credentials`` (an ext_proc with ``[extproc] tls_*`` takes nothing else; fixed, or
    following rotation), else plain."""

    def __init__(
        self,
        targets: Sequence[str],
        credentials: grpc.ChannelCredentials | ReloadingClientCerts | None = None,
    ) -> None:
        self._targets = list(targets)
        self._credentials = credentials
        self._channels: list[grpc.aio.Channel] = []
        self._pending: set[asyncio.Task[None]] = set()

    def failed(self, host: str, flag: str | None = None, status: int | None = None) -> None:
        """Report one failed try (from the event loop; returns at once)."""
        if not self._targets:
            return
        try:
            one = entry(host, flag, status)
        except ValueError:
            return  # not ip:port: nothing an ext_proc could match
        if not self._channels:
            self._channels = [self._channel(t) for t in self._targets]
        for target, channel in zip(self._targets, self._channels, strict=True):
            task = asyncio.create_task(self._send(target, channel, one))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    def _channel(self, target: str) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(target)
        # Following rotation: each report after one goes on a channel with the new certificate, and
        # the replaced channel closes once its reports are sent (runtime.tls.RotatingChannel).
        return secure_channel(target, self._credentials)

    async def _send(
        self, target: str, channel: grpc.aio.Channel, one: accesslog_pb2.HTTPAccessLogEntry
    ) -> None:
        stub = als_pb2_grpc.AccessLogServiceStub(channel)

        async def messages() -> object:
            yield message([one])

        try:
            await stub.StreamAccessLogs(messages(), timeout=DEADLINE_S)
        except grpc.aio.AioRpcError as exc:
            log.info("failed-try report to ext_proc %s not delivered: %s", target, exc.code().name)

    async def aclose(self) -> None:
        if self._pending:
            await asyncio.wait(self._pending, timeout=DEADLINE_S)
        for channel in self._channels:
            await channel.close()
