"""Failed tries: reading Envoy's access-log entries in memory, then ``StreamAccessLogs`` over real gRPC on
the gateway's ext_proc port (as Envoy's ``http_grpc`` upstream logger sends them) ejecting endpoints that
the gateway's own decisions then leave out; and gRPC health on that port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import grpc
import pytest
from envoy.config.core.v3.address_pb2 import Address, SocketAddress
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf.wrappers_pb2 import UInt32Value
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contracts.epp import FAILURE_LOG_NAME
from contracts.events import EndpointId
from contracts.federation import REFUSED_HEADER, UNTRUSTED
from extproc.server import EXT_PROC_SERVICE, Gateway
from extproc.xds.als import FAILURE_FLAGS, FailedTry, failed_try
from tests.extproc.test_server import body_msgs, chat_body, decision, headers_msg, run
from tests.extproc.xds.conftest import gateway_on
from tests.polling import until


def entry(
    ip: str | None = "10.0.0.1", port: int = 8000, flags: Iterable[str] = (), status: int | None = None
) -> al.HTTPAccessLogEntry:
    """One upstream try as Envoy logs it: the host, response flags, and the engine's status if any."""
    common = al.AccessLogCommon(response_flags=al.ResponseFlags(**dict.fromkeys(flags, True)))
    if ip is not None:
        common.upstream_remote_address.CopyFrom(
            Address(socket_address=SocketAddress(address=ip, port_value=port))
        )
    out = al.HTTPAccessLogEntry(common_properties=common)
    if status is not None:
        out.response.response_code.CopyFrom(UInt32Value(value=status))
    return out


UF, UT = "upstream_connection_failure", "upstream_request_timeout"


def refused(code: str) -> al.HTTPAccessLogEntry:
    """A forwarded try a peer cluster refused with 401 and its refusal header."""
    out = entry(status=401)
    out.response.response_headers[REFUSED_HEADER] = code
    return out


@pytest.mark.parametrize("flag", FAILURE_FLAGS)
def test_each_failure_flag_is_its_kind(flag: str) -> None:
    assert failed_try(entry(flags=[flag])) == FailedTry("10.0.0.1:8000", flag)


@pytest.mark.parametrize(
    ("log_entry", "expected"),
    [
        (entry(status=503), FailedTry("10.0.0.1:8000", "http_503")),
        (entry(ip="::1", port=9000, status=503), FailedTry("[::1]:9000", "http_503")),
        # A flag names the kind even when Envoy also has a 503 (its own, for that try).
        (entry(flags=[UT], status=503), FailedTry("10.0.0.1:8000", UT)),
        (entry(flags=["upstream_remote_reset", UF]), FailedTry("10.0.0.1:8000", UF)),
        (refused(UNTRUSTED), FailedTry("10.0.0.1:8000", "federation_untrusted")),  # a peer's link: no trust
        (refused("tenant_not_trusted"), None),  # one tenant refused: not the peer's failure
        (entry(status=401), None),  # an engine's own 401
        (entry(status=200), None),
        (entry(status=500), None),
        (entry(flags=["downstream_connection_termination"]), None),
        (entry(ip=None, flags=["upstream_connection_failure"]), None),
    ],
)  # fmt: skip
def test_failed_try_reads_host_and_kind(log_entry: al.HTTPAccessLogEntry, expected: FailedTry | None) -> None:
    assert failed_try(log_entry) == expected


# -- over gRPC ------------------------------------------------------------------------------------------

ADDRESSES = ["127.0.0.1:18001", "127.0.0.1:18002", "127.0.0.1:18003"]


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    async with gateway_on(ADDRESSES) as gw:
        yield gw


def messages(log_name: str, *entries: al.HTTPAccessLogEntry) -> list[als_pb2.StreamAccessLogsMessage]:
    """A stream as Envoy sends it: the identifier with the first message only, one entry per message."""
    out = []
    for i, e in enumerate(entries):
        msg = als_pb2.StreamAccessLogsMessage(
            http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(log_entry=[e])
        )
        if i == 0:
            msg.identifier.log_name = log_name
            msg.identifier.node.id = "envoy-test"
        out.append(msg)
    return out


async def send(gw: Gateway, msgs: list[als_pb2.StreamAccessLogsMessage]) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.ports['extproc']}") as channel:
        await als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(iter(msgs))


async def destinations(gw: Gateway, n: int) -> set[str]:
    """Every address in the decisions (pick and fallbacks) of ``n`` requests through the ext_proc."""
    seen: set[str] = set()
    for _ in range(n):
        resps = await run(
            gw, [headers_msg("/v1/chat/completions"), *body_msgs(chat_body("hello", model="m"))]
        )
        seen |= set(decision(resps)[0].split(","))
    return seen


async def test_a_failed_try_ejects_its_endpoint_from_decisions(gateway: Gateway) -> None:
    assert await destinations(gateway, 3) == set(ADDRESSES)
    await send(
        gateway, messages(FAILURE_LOG_NAME, entry("127.0.0.1", 18001, ["upstream_connection_failure"]))
    )
    state = gateway.fleet.get(EndpointId("e0"))
    assert state is not None and state.ejected_until > 0  # applied before the stream's answer
    assert await destinations(gateway, 10) == set(ADDRESSES[1:])
    count = gateway.metrics.registry.get_sample_value
    assert (
        count("kvgate_endpoint_ejections_total", {"endpoint": "e0", "kind": "upstream_connection_failure"})
        == 1.0
    )


async def test_a_failed_try_that_cannot_be_handled_is_skipped_and_the_stream_goes_on(
    gateway: Gateway,
) -> None:
    """An exception while one failed try is handled (here the federation hook) skips that entry only:
    the later tries of the stream still eject."""
    seen: list[FailedTry] = []

    def hook(failed: FailedTry) -> None:
        seen.append(failed)
        if len(seen) == 1:
            raise RuntimeError("a bug in the hook")

    gateway.failed_tries.on_failed_try = hook
    try:
        await send(
            gateway,
            messages(
                FAILURE_LOG_NAME,
                entry("127.0.0.1", 18001, ["upstream_connection_failure"]),
                entry("127.0.0.1", 18002, ["upstream_connection_failure"]),
            ),
        )
    finally:
        gateway.failed_tries.on_failed_try = None
    assert len(seen) == 2
    state = gateway.fleet.get(EndpointId("e1"))
    assert state is not None and state.ejected_until > 0


async def test_unknown_hosts_other_logs_and_successes_are_ignored(gateway: Gateway) -> None:
    await send(
        gateway,
        messages(
            FAILURE_LOG_NAME,
            entry("127.0.0.1", 19999, ["upstream_connection_failure"]),  # not a fleet endpoint
            entry("127.0.0.1", 18002, status=200),
        ),
    )
    await send(gateway, messages("some-other-log", entry("127.0.0.1", 18003, status=503)))
    assert all(s.ejected_until == 0.0 for s in gateway.fleet)
    assert await destinations(gateway, 3) == set(ADDRESSES)


async def test_drain_ends_open_log_streams(gateway: Gateway) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['extproc']}") as channel:
        queue: asyncio.Queue[als_pb2.StreamAccessLogsMessage] = asyncio.Queue()

        async def forever() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
            while True:
                yield await queue.get()

        call = als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(forever())
        (first,) = messages(FAILURE_LOG_NAME, entry("127.0.0.1", 18003, status=503))
        queue.put_nowait(first)
        await until(lambda: gateway.fleet.get(EndpointId("e2")).ejected_until > 0, 5)  # type: ignore[union-attr]
        await gateway.failed_tries.aclose()
        assert await asyncio.wait_for(call, 5) == als_pb2.StreamAccessLogsResponse()


@pytest.mark.parametrize("service", ["", "liveness", "readiness", EXT_PROC_SERVICE])
async def test_health_is_served_on_the_ext_proc_port_too(gateway: Gateway, service: str) -> None:
    for port in (gateway.ports["extproc"], gateway.ports["health"]):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            got = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service)
            )
            assert got.status == health_pb2.HealthCheckResponse.SERVING
