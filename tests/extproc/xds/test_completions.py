"""Completions: reading Envoy's completion-log entries in memory, then ``StreamAccessLogs`` over real gRPC on
the gateway's ext_proc port handing each one to ``on_completion`` (failed tries still eject)."""

from __future__ import annotations

import time

import pytest
from envoy.config.core.v3.address_pb2 import Address, SocketAddress
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from google.protobuf.duration_pb2 import Duration
from google.protobuf.wrappers_pb2 import UInt32Value

from contracts.epp import COMPLETION_LOG_NAME, FAILURE_LOG_NAME
from contracts.events import EndpointId
from extproc.xds.als import Completion, completion
from tests.extproc.xds.conftest import gateway_on
from tests.extproc.xds.test_als import entry, messages, send


def done(
    ip: str | None = "10.0.0.1",
    port: int = 8000,
    request_id: str = "r-1",
    status: int | None = 200,
    ttfb_ms: int | None = 120,
    duration_ms: int | None = 900,
    last_byte_ms: int | None = None,
) -> al.HTTPAccessLogEntry:
    """One request as Envoy's listener logs it: the upstream host, request id, status and timings."""
    common = al.AccessLogCommon()
    if ip is not None:
        common.upstream_remote_address.CopyFrom(
            Address(socket_address=SocketAddress(address=ip, port_value=port))
        )
    if ttfb_ms is not None:
        common.time_to_first_upstream_rx_byte.CopyFrom(Duration(nanos=ttfb_ms * 1_000_000))
    if duration_ms is not None:
        common.duration.CopyFrom(Duration(seconds=duration_ms // 1000, nanos=duration_ms % 1000 * 1_000_000))
    if last_byte_ms is not None:
        common.time_to_last_downstream_tx_byte.CopyFrom(Duration(nanos=last_byte_ms * 1_000_000))
    out = al.HTTPAccessLogEntry(common_properties=common)
    out.request.request_id = request_id
    if status is not None:
        out.response.response_code.CopyFrom(UInt32Value(value=status))
    return out


@pytest.mark.parametrize(
    ("log_entry", "expected"),
    [
        (done(), Completion("10.0.0.1:8000", "r-1", 200, 0.12, 0.9)),
        (done(duration_ms=2500), Completion("10.0.0.1:8000", "r-1", 200, 0.12, 2.5)),
        (done(ip="::1", port=9000, status=503), Completion("[::1]:9000", "r-1", 503, 0.12, 0.9)),
        # The engine was never reached (or never answered): no status, no first byte.
        (done(status=None, ttfb_ms=None), Completion("10.0.0.1:8000", "r-1", 0, None, 0.9)),
        # No duration: the time to the last byte sent downstream; neither: unknown.
        (done(duration_ms=None, last_byte_ms=700), Completion("10.0.0.1:8000", "r-1", 200, 0.12, 0.7)),
        (done(duration_ms=None), Completion("10.0.0.1:8000", "r-1", 200, 0.12, None)),
        # No upstream host (every try failed to connect): it still ends a routed request.
        (done(ip=None), Completion("", "r-1", 200, 0.12, 0.9)),
        (done(request_id=""), None),  # no request id: nothing to match
    ],
)  # fmt: skip
def test_completion_reads_host_id_status_and_timings(
    log_entry: al.HTTPAccessLogEntry, expected: Completion | None
) -> None:
    assert completion(log_entry) == expected


def with_metadata(entry: al.HTTPAccessLogEntry, **namespaces: dict[str, object]) -> al.HTTPAccessLogEntry:
    for ns, fields in namespaces.items():
        entry.common_properties.metadata.filter_metadata[ns.replace("_", ".")].update(fields)
    return entry


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        # The decision's model, endpoint and prediction, and the engine's count from json_to_metadata.
        (
            {"kvgate_decision": {"model": "m", "endpoint": "sim-0", "matched_tokens": 64.0},
             "kvgate_usage": {"cached_tokens": 48.0}},
            ("m", "sim-0", 64, 48),
        ),
        # A streamed answer (or an engine without the field): no count, not compared.
        (
            {"kvgate_decision": {"model": "m", "endpoint": "sim-0", "matched_tokens": 0.0}},
            ("m", "sim-0", 0, None),
        ),
        # Ill-typed values are ignored, never trusted.
        (
            {"kvgate_decision": {"model": 3.0, "endpoint": "", "matched_tokens": -1.0},
             "kvgate_usage": {"cached_tokens": "12"}},
            (None, None, None, 12),
        ),
        # A digit string that is no number (superscript two: isdigit() but not float()): ignored.
        ({"kvgate_usage": {"cached_tokens": "\u00b2"}}, (None, None, None, None)),
        ({}, (None, None, None, None)),
    ],
)  # fmt: skip
def test_completion_reads_the_drift_alarm_metadata(
    fields: dict[str, dict[str, object]], expected: tuple[object, ...]
) -> None:
    done_ = completion(with_metadata(done(), **fields))
    assert done_ is not None
    assert (done_.model, done_.endpoint, done_.predicted_tokens, done_.cached_tokens) == expected


def test_completion_reads_a_responses_requests_scope_and_response_id() -> None:
    """extproc/affinity learns from these two: the decision's scope, json_to_metadata's response id."""
    fields = {
        "kvgate_decision": {"responses_scope": "tenant:acme"},
        "kvgate_usage": {"response_id": "resp_1"},
    }
    got = completion(with_metadata(done(), **fields))
    assert got is not None and (got.responses_scope, got.response_id) == ("tenant:acme", "resp_1")
    plain = completion(with_metadata(done(), kvgate_usage={"response_id": "chatcmpl-1"}))
    assert plain is not None and plain.responses_scope is None  # not a Responses API request: not learned


async def test_every_completion_reaches_the_callback_and_failures_still_eject() -> None:
    """Completions of the completion log reach ``on_completion`` (for any address: a capacity signal even
    when another replica routed it); the failure log's entries eject and are no completions; other
    logs are ignored; a callback that raises skips that entry only."""
    heard: list[Completion] = []

    def on_completion(c: Completion) -> None:
        if c.request_id == "boom":
            raise RuntimeError("a bug in the callback")
        heard.append(c)

    async with gateway_on(["127.0.0.1:18001", "127.0.0.1:18002"]) as gw:
        gw.failed_tries.on_completion = on_completion
        await send(
            gw,
            messages(
                COMPLETION_LOG_NAME,
                done("127.0.0.1", 18001, "a"),
                done("127.0.0.1", 18002, "boom"),
                done("127.0.0.1", 19999, "elsewhere"),
                done(None, request_id="no-host"),
                with_metadata(done("127.0.0.1", 18001, "odd"), kvgate_usage={"cached_tokens": "\u00b2"}),
                done("127.0.0.1", 18001, "after"),
            ),
        )
        await send(gw, messages(FAILURE_LOG_NAME, entry("127.0.0.1", 18002, ["upstream_connection_failure"])))
        await send(gw, messages("some-other-log", done("127.0.0.1", 18001, "other")))
        assert [(c.request_id, c.address) for c in heard] == [
            ("a", "127.0.0.1:18001"),
            ("elsewhere", "127.0.0.1:19999"),
            ("no-host", ""),  # ends a routed request all the same (its outstanding count)
            ("odd", "127.0.0.1:18001"),  # an odd field is ignored, the entry kept ...
            ("after", "127.0.0.1:18001"),  # ... and the stream goes on
        ]
        ejected = gw.fleet.get(EndpointId("e1"))
        assert ejected is not None and ejected.ejected_until > 0
        healthy = gw.fleet.get(EndpointId("e0"))
        assert healthy is not None and healthy.ejected_until == 0.0


async def test_completions_feed_the_drift_alarm_only_when_the_pick_served_a_2xx() -> None:
    """Over real gRPC: a 2xx with both counts, served by the pick, is a drift sample; one served by a
    fallback (another cache), an error, or one without the engine's count is not."""

    def answered(port: int, endpoint: str, cached: float | None, status: int = 200) -> al.HTTPAccessLogEntry:
        usage = {} if cached is None else {"kvgate_usage": {"cached_tokens": cached}}
        decision = {"model": "m", "endpoint": endpoint, "matched_tokens": 64.0}
        return with_metadata(done("127.0.0.1", port, status=status), kvgate_decision=decision, **usage)

    async with gateway_on(["127.0.0.1:18001", "127.0.0.1:18002"]) as gw:
        await send(
            gw,
            messages(
                COMPLETION_LOG_NAME,
                answered(18001, "e0", 0.0),  # a sample: predicted 64, reused 0
                answered(18001, "e1", 0.0),  # e1 was the pick, e0 served it (a fallback): skipped
                answered(18001, "e0", 0.0, status=500),  # an error: skipped
                answered(18001, "e0", None),  # a stream (no count): skipped
                answered(18001, "e0", 64.0),  # a sample
            ),
        )
        (view,) = gw.drift.views(0.0)
    assert (view.model, view.endpoint, view.samples, view.ratio, view.error) == ("m", "e0", 2, 0.5, 0.5)


def test_completion_reads_a_streamed_forward() -> None:
    """Peer health judges the first byte only of a streamed forward (extproc/federation/health.py)."""
    got = completion(with_metadata(done(), kvgate_decision={"forward_streamed": "1"}))
    assert got is not None and got.streamed
    plain = completion(with_metadata(done(), kvgate_decision={"model": "m"}))
    assert plain is not None and not plain.streamed


async def test_a_tripped_drift_alarm_clears_at_its_windows_end_and_leaves_with_its_endpoint() -> None:
    """The alarm's gauge is read at each scrape after the windows expire (it stayed tripped while its
    endpoint got no traffic), and an endpoint that left the fleet takes its series with it."""
    async with gateway_on(["127.0.0.1:18001", "127.0.0.1:18002"]) as gw:
        tripped = gw.metrics.registry.get_sample_value
        labels = {"model": "m", "endpoint": "e0", "source": "responses"}
        long_ago = time.monotonic() - 2 * gw.drift.policy.max_age_s
        for _ in range(gw.drift.policy.min_samples):
            gw.drift.observe("m", "e0", 1000, 0, long_ago)  # the engine reused nothing: tripped
        assert ("m", "e0", "responses") in gw.drift.published
        assert tripped("kvgate_drift_tripped", labels) == 0.0  # its samples have aged out since
        now = time.monotonic()
        for _ in range(gw.drift.policy.min_samples):
            gw.drift.observe("m", "e1", 1000, 0, now)
        assert tripped("kvgate_drift_tripped", labels | {"endpoint": "e1"}) == 1.0
        gw.fleet.remove(EndpointId("e1"))
        assert tripped("kvgate_drift_tripped", labels | {"endpoint": "e1"}) is None
