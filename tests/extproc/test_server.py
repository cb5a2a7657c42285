"""The ext_proc stream over real gRPC (grpc.aio, xds-protos messages), driven as Envoy drives it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, cast

import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from contracts.events import EndpointId
from contracts.tracing import Timeline
from extproc.config import parse_config
from extproc.processor import ProcessorConfig
from extproc.routing.request import ParsedRequest
from extproc.routing.router import Decision, LazyPrompt, Router, Tokens
from extproc.server import ExternalProcessor, Gateway
from extproc.xds.ejection import Ejection
from tests.polling import until

MODEL = "SmolLM2-135M-Instruct"
ADDRESSES = [f"127.0.0.{i + 1}:8000" for i in range(4)]


@pytest.fixture
async def gateway(model_dir: str) -> AsyncIterator[Gateway]:
    config = parse_config(
        {
            "extproc": {
                "listen": "127.0.0.1:0",
                "health_listen": "127.0.0.1:0",
                "metrics_listen": "",
                "max_body_bytes": 8 * 1024 * 1024,
                "conformance": True,
            },
            # A context longer than test_multi_megabyte_body's prompt, so that it is routed, not refused.
            "models": [{"name": MODEL, "model_dir": model_dir, "max_model_len": 1 << 22}],
            "endpoints": [{"id": f"e{i}", "address": a, "models": [MODEL]} for i, a in enumerate(ADDRESSES)]
            + [{"id": "other", "address": "127.0.0.9:8000", "models": ["other-model"]}],
        }
    )
    gw = Gateway(config)
    await gw.start()
    yield gw
    await gw.aclose(grace_s=0)


def headers_msg(
    path: str,
    method: str = "POST",
    end: bool = False,
    extra: dict[str, str] | None = None,
    metadata: Metadata | None = None,
) -> pb.ProcessingRequest:
    hs = {
        ":path": path,
        ":method": method,
        "x-request-id": "r1",
        "content-type": "application/json",
        **(extra or {}),
    }
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()]),
            end_of_stream=end,
        ),
        metadata_context=metadata,
    )


def body_msgs(body: bytes, chunk: int = 65536) -> list[pb.ProcessingRequest]:
    parts = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    return [
        pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=i == len(parts) - 1))
        for i, p in enumerate(parts)
    ]


def chat_body(content: str, model: str = MODEL, **extra: Any) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}], **extra})


async def run(gw: Gateway, msgs: Iterable[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.ports['extproc']}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        return [r async for r in stub.Process(iter(list(msgs)))]


def decision(resps: list[pb.ProcessingResponse]) -> tuple[str, str, dict[str, str]]:
    first = resps[0]
    assert first.WhichOneof("response") == "request_headers", first
    set_headers = {
        h.header.key: h.header.raw_value.decode()
        for h in first.request_headers.response.header_mutation.set_headers
    }
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert first.request_headers.response.clear_route_cache
    assert lb["x-gateway-destination-endpoint"].string_value == set_headers["x-gateway-destination-endpoint"]
    return (
        set_headers["x-gateway-destination-endpoint"],
        lb["x-kvgate-destination-primary"].string_value,
        set_headers,
    )


def streamed_body(resps: list[pb.ProcessingResponse]) -> bytes:
    chunks = [r.request_body.response.body_mutation.streamed_response for r in resps[1:]]
    assert all(len(c.body) <= 62_000 for c in chunks)
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    return b"".join(c.body for c in chunks)


def error_of(resps: list[pb.ProcessingResponse]) -> tuple[int, dict[str, Any]]:
    assert len(resps) == 1 and resps[0].HasField("immediate_response"), resps
    imm = resps[0].immediate_response
    ctype = {h.header.key: h.header.raw_value for h in imm.headers.set_headers}["content-type"]
    assert ctype == b"application/json"
    return imm.status.code, orjson.loads(imm.body)


async def test_routes_and_streams_body_back(gateway: Gateway) -> None:
    body = chat_body("hello " * 50)
    resps = await run(gateway, [headers_msg("/v1/chat/completions"), *body_msgs(body, chunk=100)])
    destination, primary, hs = decision(resps)
    picks = destination.split(",")
    assert len(picks) == 3 and len(set(picks)) == 3 and set(picks) <= set(ADDRESSES)
    assert primary == picks[0]
    assert hs["content-length"] == str(len(body))
    assert streamed_body(resps) == body


async def test_multi_megabyte_body(gateway: Gateway) -> None:
    body = chat_body("x" * (3 * 1024 * 1024))
    resps = await run(gateway, [headers_msg("/v1/chat/completions"), *body_msgs(body)])
    decision(resps)
    assert streamed_body(resps) == body
    assert len(resps) == 1 + -(-len(body) // 62_000)


async def test_a_large_body_is_tokenized_off_the_event_loop(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one stream's large prompt is being tokenized, other streams are answered: the tokenizing of a
    body of at least ``offload_bytes`` runs in a worker thread. Here it waits until a ``GET /v1/models``
    on another stream has been answered, which on the event loop could never happen."""
    tokens = gateway.router.tokens
    models_answered = threading.Event()

    def blocking_tokens(
        request: ParsedRequest,
        *,
        exact_count: bool = False,
        timeline: Timeline | None = None,
        window: bool = False,
    ) -> Tokens:
        assert models_answered.wait(10), "GET /v1/models was not answered while the prompt was tokenized"
        return tokens(request, exact_count=exact_count, timeline=timeline, window=window)

    monkeypatch.setattr(gateway.router, "tokens", blocking_tokens)
    body = chat_body("hello " * 20_000)  # 120 KB: over the 32 KiB offload threshold
    routed = asyncio.create_task(run(gateway, [headers_msg("/v1/chat/completions"), *body_msgs(body)]))
    models = await run(gateway, [headers_msg("/v1/models", method="GET", end=True)])
    assert models[0].immediate_response.status.code == 200
    models_answered.set()
    resps = await asyncio.wait_for(routed, 10)
    decision(resps)
    assert streamed_body(resps) == body


def threads_calling(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str, key: Callable[..., object] | None = None
) -> list[Any]:
    """From now on, each call of ``owner.name`` (a class's method or an object's) appends the name of the
    thread it ran in, or ``(key(*args, **kwargs), thread name)`` with ``key``; the call goes on as before."""
    calls: list[Any] = []
    original = getattr(owner, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        thread = threading.current_thread().name
        calls.append(thread if key is None else (key(*args, **kwargs), thread))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return calls


@pytest.fixture
def finished_in(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads :meth:`LazyPrompt.finish` ran in, in order, from now on."""
    return threads_calling(monkeypatch, LazyPrompt, "finish")


async def test_the_rest_of_a_large_lazy_prompt_is_hashed_off_the_event_loop(
    gateway: Gateway, finished_in: list[str]
) -> None:
    """A never-seen long prompt is tokenized only to its first block before the answer; the rest of its
    window, hashed for the index record after the answer, is tokenized in a worker thread too."""
    body = chat_body(" ".join(f"w{i}" for i in range(20_000)))  # ~130 KB, every block new
    resps = await run(gateway, [headers_msg("/v1/chat/completions"), *body_msgs(body)])
    decision(resps)
    assert finished_in and threading.main_thread().name not in finished_in[:1], finished_in
    assert len(gateway.index.occupancy()) == 1 and max(gateway.index.occupancy().values()) > 1  # recorded


async def test_the_rest_of_a_small_body_is_settled_by_the_characters_left(
    gateway: Gateway, finished_in: list[str]
) -> None:
    """A body under ``offload_bytes`` whose prompt has thousands of characters left to tokenize after its
    first unheld block (a ~4k-token first turn, ~20 KB) has that rest tokenized in a worker thread
    (``offload_rest_chars``); one with a few hundred left, on the event loop."""
    body = chat_body(" ".join(f"v{i}" for i in range(3_000)))  # ~20 KB, every block new
    assert len(body) < 32 * 1024
    decision(await run(gateway, [headers_msg("/v1/chat/completions"), *body_msgs(body)]))
    assert finished_in and finished_in[0] != threading.main_thread().name, finished_in
    finished_in.clear()
    body = chat_body(" ".join(f"u{i}" for i in range(60)))  # ~300 characters left
    decision(await run(gateway, [headers_msg("/v1/chat/completions"), *body_msgs(body)]))
    assert finished_in and finished_in[0] == threading.main_thread().name, finished_in


async def test_a_stream_cancelled_while_its_rest_is_settled_closes_after_the_thread(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Envoy may end a stream while a worker thread settles its rest: the stream is closed (its decision
    committed, finishing that prompt) only once the thread is done, never beside it."""
    entered, release = threading.Event(), threading.Event()
    settling = threading.Event()  # set while the worker thread is inside settle
    settle, commit = LazyPrompt.settle, Router.commit
    committed_while_settling: list[bool] = []

    def blocking_settle(self: LazyPrompt) -> None:
        settling.set()
        entered.set()
        assert release.wait(10), "never released"
        settle(self)
        settling.clear()

    def recording_commit(self: Router, decision: Decision, now: float) -> None:
        committed_while_settling.append(settling.is_set())
        commit(self, decision, now)

    monkeypatch.setattr(LazyPrompt, "settle", blocking_settle)
    monkeypatch.setattr(Router, "commit", recording_commit)
    servicer = ExternalProcessor(
        gateway.router, ProcessorConfig(max_body_bytes=1 << 20, offload_rest_chars=0), gateway.metrics
    )
    body = chat_body(" ".join(f"c{i}" for i in range(3_000)))

    async def messages() -> AsyncIterator[pb.ProcessingRequest]:
        for msg in [headers_msg("/v1/chat/completions"), *body_msgs(body)]:
            yield msg
        await asyncio.Event().wait()  # the stream stays open: Envoy's next message never comes

    async def drain() -> None:
        async for _ in servicer.Process(messages(), cast(grpc.aio.ServicerContext, None)):
            pass

    stream = asyncio.create_task(drain())
    assert await asyncio.to_thread(entered.wait, 10), "the rest was not settled in a worker thread"
    stream.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stream
    assert committed_while_settling == [] and gateway.index.occupancy() == {}  # nothing beside the thread
    release.set()
    await until(lambda: bool(committed_while_settling), 10)
    assert committed_while_settling == [False]
    assert sum(gateway.index.occupancy().values()) > 1  # the whole window recorded after all


async def test_a_stream_cancelled_before_its_routing_replies_went_out_leaves_nothing_taken(
    gateway: Gateway,
) -> None:
    """Decided, then cancelled while the shell awaits something before handing the replies to Envoy (a
    slot restore here; a prefill half or a cascade step likewise): Envoy never routes it and logs no
    completion, so the stream's close releases what decide took (in flight and outstanding) and records
    nothing in the index."""
    entered = asyncio.Event()

    class Restorer:
        async def before_routing(self, decision: Decision, headers: object = None) -> str:
            entered.set()
            await asyncio.Event().wait()  # never restored: the client leaves first
            return "restored"

    servicer = ExternalProcessor(
        gateway.router,
        ProcessorConfig(max_body_bytes=1 << 20),
        gateway.metrics,
        restorer=cast(Any, Restorer()),
    )

    async def messages() -> AsyncIterator[pb.ProcessingRequest]:
        for msg in [headers_msg("/v1/chat/completions"), *body_msgs(chat_body("hello there"))]:
            yield msg
        await asyncio.Event().wait()

    async def drain() -> None:
        async for _ in servicer.Process(messages(), cast(grpc.aio.ServicerContext, None)):
            pass

    stream = asyncio.create_task(drain())
    await asyncio.wait_for(entered.wait(), 10)
    assert sum(s.outstanding for s in gateway.router.fleet) == 1
    stream.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stream
    assert [(s.in_flight, s.outstanding) for s in gateway.router.fleet if s.in_flight or s.outstanding] == []
    assert gateway.index.occupancy() == {}


async def test_oversize_body_is_413(gateway: Gateway) -> None:
    body = chat_body("x" * (9 * 1024 * 1024))
    status, err = error_of(await run(gateway, [headers_msg("/v1/chat/completions"), *body_msgs(body)]))
    assert status == 413 and err["error"]["type"] == "invalid_request_error"


async def test_shared_prefix_sticks_distinct_prefixes_spread(gateway: Gateway) -> None:
    system = "You are a meticulous assistant. " * 40
    firsts = set()
    for i in range(4):
        body = orjson.dumps(
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": f"{i} {system}"},
                    {"role": "user", "content": "q"},
                ],
            }
        )
        firsts.add(decision(await run(gateway, [headers_msg("/v1/chat/completions"), *body_msgs(body)]))[1])
    assert len(firsts) == 4  # cold prefixes spread over all replicas
    picks = set()
    for q in ("a", "b", "c"):
        body = orjson.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "system", "content": f"2 {system}"}, {"role": "user", "content": q}],
            }
        )
        picks.add(decision(await run(gateway, [headers_msg("/v1/chat/completions"), *body_msgs(body)]))[1])
    assert len(picks) == 1


async def test_subset_hint(gateway: Gateway) -> None:
    def subset(values: list[str]) -> Metadata:
        s = Struct()
        s.update({"x-gateway-destination-endpoint-subset": values})
        return Metadata(filter_metadata={"envoy.lb.subset_hint": s})

    msgs = [headers_msg("/v1/chat/completions", metadata=subset([ADDRESSES[2]])), *body_msgs(chat_body("hi"))]
    assert decision(await run(gateway, msgs))[0] == ADDRESSES[2]
    msgs = [headers_msg("/v1/chat/completions", metadata=subset(["10.9.9.9:1"])), *body_msgs(chat_body("hi"))]
    status, err = error_of(await run(gateway, msgs))
    assert status == 503 and err["error"]["type"] == "service_unavailable"


async def test_conformance_selection_header(gateway: Gateway) -> None:
    msgs = [
        headers_msg("/v1/completions", extra={"test-epp-endpoint-selection": "127.0.0.3, 127.0.0.4:8000"}),
        *body_msgs(orjson.dumps({"model": MODEL, "prompt": "hello"})),
    ]
    destination, _, _ = decision(await run(gateway, msgs))
    assert set(destination.split(",")) == {ADDRESSES[2], ADDRESSES[3]}


async def test_bodyless_requests(gateway: Gateway) -> None:
    resps = await run(gateway, [headers_msg("/v1/models", method="GET", end=True)])
    imm = resps[0].immediate_response
    assert imm.status.code == 200
    assert {m["id"] for m in orjson.loads(imm.body)["data"]} == {MODEL, "other-model"}
    status, err = error_of(await run(gateway, [headers_msg("/admin", method="GET", end=True)]))
    assert status == 404 and err["error"]["type"] == "invalid_request_error"
    status, _ = error_of(await run(gateway, [headers_msg("/v1/chat/completions", end=True)]))
    assert status == 400


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b'{"model": "\xff\xfe"}', 400),
        (chat_body("hi", model="nope"), 404),
        (orjson.dumps({"model": MODEL, "messages": "hi"}), 400),
    ],
)
async def test_bad_bodies(gateway: Gateway, body: bytes, status: int) -> None:
    got, err = error_of(await run(gateway, [headers_msg("/v1/chat/completions"), *body_msgs(body)]))
    assert got == status and "message" in err["error"] and "Traceback" not in err["error"]["message"]


async def test_model_without_tokenizer_still_routes(gateway: Gateway) -> None:
    resps = await run(
        gateway, [headers_msg("/v1/chat/completions"), *body_msgs(chat_body("hi", model="other-model"))]
    )
    assert decision(resps)[0] == "127.0.0.9:8000"


async def test_served_endpoint_read_back_and_in_flight(gateway: Gateway) -> None:
    fleet = gateway.fleet
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['extproc']}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        call = stub.Process()
        await call.write(headers_msg("/v1/chat/completions"))
        for m in body_msgs(chat_body("served read back")):
            await call.write(m)
        first = await call.read()
        destination = first.request_headers.response.header_mutation.set_headers[0].header.raw_value.decode()
        while True:
            r = await call.read()
            if r.request_body.response.body_mutation.streamed_response.end_of_stream:
                break
        pick, fallback = destination.split(",")[:2]
        assert fleet.by_address(pick).in_flight == 1  # type: ignore[union-attr]
        # Envoy reports the request went to the fallback, via the route's upstream-host header.
        await call.write(
            pb.ProcessingRequest(
                response_headers=pb.HttpHeaders(
                    headers=HeaderMap(
                        headers=[
                            HeaderValue(key=":status", raw_value=b"200"),
                            HeaderValue(key="x-kvgate-upstream-host", raw_value=fallback.encode()),
                        ]
                    )
                )
            )
        )
        resp = await call.read()
        mutation = resp.response_headers.response.header_mutation
        assert "x-kvgate-upstream-host" in mutation.remove_headers
        assert {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers} == {
            "x-conformance-test-served-endpoint": fallback
        }
        assert fleet.by_address(pick).in_flight == 0  # type: ignore[union-attr]
        assert fleet.by_address(fallback).in_flight == 1  # type: ignore[union-attr]
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
    served = fleet.by_address(fallback)
    assert served is not None
    for _ in range(100):  # the server's finally-block runs after the stream closes
        if served.in_flight == 0:
            break
        await __import__("asyncio").sleep(0.01)
    assert served.in_flight == 0
    # the fallback now holds the prefix in the index, and in the working set cache-spread reads
    assert gateway.index.occupancy().get(EndpointId(served.id), 0) > 0
    assert gateway.router.working_set is not None  # on by default (index.working_set_s = 20)
    assert gateway.router.working_set.sizes(time.monotonic()).get(EndpointId(served.id), 0) > 0


async def test_health_services(gateway: Gateway) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['health']}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_model_name_rewrite(gateway: Gateway) -> None:
    msgs = [
        headers_msg("/v1/chat/completions", extra={"x-gateway-model-name-rewrite": "other-model"}),
        *body_msgs(chat_body("rewrite me")),
    ]
    resps = await run(gateway, msgs)
    destination, _, hs = decision(resps)
    body = streamed_body(resps)
    assert destination == "127.0.0.9:8000"
    assert orjson.loads(body)["model"] == "other-model" and hs["content-length"] == str(len(body))


async def test_garbage_collection_runs_after_the_answer(gateway: Gateway) -> None:
    """With the collector started (as ``kvgate extproc`` starts it, [extproc] gc = "deferred"), a
    collection that is due runs once the stream's bookkeeping is done (extproc/collector)."""
    collector = gateway.collector
    collector.start()
    try:
        kept: list[list[object]] = [[] for _ in range(2 * 700)]  # survivors: past CPython's young threshold
        resps = await run(gateway, [headers_msg("/v1/chat/completions"), *body_msgs(chat_body("hi " * 20))])
        assert decision(resps)[0]
        assert sum(collector.collections) >= 1
        del kept
    finally:
        collector.stop()


async def test_an_endpoint_that_leaves_the_fleet_takes_its_ejection_series(gateway: Gateway) -> None:
    gateway._on_ejection(Ejection(EndpointId("e0"), "http_503", 1, time.monotonic(), 1.0))
    gateway._on_ejection(Ejection(EndpointId("e1"), "http_503", 1, time.monotonic(), 1.0))
    text = generate_latest(gateway.metrics.registry).decode()
    assert 'kvgate_endpoint_ejections_total{endpoint="e0",kind="http_503"} 1.0' in text
    gateway.fleet.remove(EndpointId("e0"))
    text = generate_latest(gateway.metrics.registry).decode()
    assert 'kvgate_endpoint_ejections_total{endpoint="e0"' not in text
    assert 'kvgate_endpoint_ejections_total{endpoint="e1",kind="http_503"} 1.0' in text


async def test_a_scrape_expires_the_drift_windows_on_the_event_loop(gateway: Gateway) -> None:
    """Prometheus scrapes on the metrics server's thread; the drift windows are the event loop's
    (every completion and engine reading changes them there): expiring them from the scrape's thread
    raced the loop (a lost update of a window's sums, a dict changing size mid-iteration). The scrape
    has the loop do it."""
    loop_thread = threading.get_ident()
    seen: list[int] = []
    monitor_views, counter_views = gateway.drift.views, gateway.counter_drift.views

    def drift_views(now: float) -> Any:
        seen.append(threading.get_ident())
        return monitor_views(now)

    def counters_views(now: float) -> Any:
        seen.append(threading.get_ident())
        return counter_views(now)

    gateway.drift.views = drift_views  # type: ignore[method-assign]
    gateway.counter_drift.views = counters_views  # type: ignore[method-assign]
    gateway.drift.observe(MODEL, "e0", 32, 0, time.monotonic())
    text = await asyncio.to_thread(lambda: generate_latest(gateway.metrics.registry).decode())
    assert 'kvgate_drift_samples{endpoint="e0",model="' + MODEL + '",source="responses"} 1.0' in text
    assert seen == [loop_thread, loop_thread]


async def test_an_endpoint_that_leaves_the_fleet_takes_each_kinds_ejection_series(gateway: Gateway) -> None:
    """``kvgate_endpoint_ejections{endpoint,kind}``: an endpoint that left the fleet (a replaced pod has a
    new name) leaves no series behind, so their number does not grow with churn; the others stay."""
    registry = gateway.metrics.registry
    name = "kvgate_endpoint_ejections_total"
    for endpoint, kind in [
        ("e1", "http_503"),
        ("e1", "upstream_reset_before_response_started"),
        ("e2", "http_503"),
    ]:
        gateway._on_ejection(Ejection(EndpointId(endpoint), kind, 1, 0.0, 1.0))
    assert registry.get_sample_value(name, {"endpoint": "e1", "kind": "http_503"}) == 1.0
    gateway.fleet.remove(EndpointId("e1"))
    assert registry.get_sample_value(name, {"endpoint": "e1", "kind": "http_503"}) is None
    kind = "upstream_reset_before_response_started"
    assert registry.get_sample_value(name, {"endpoint": "e1", "kind": kind}) is None
    assert registry.get_sample_value(name, {"endpoint": "e2", "kind": "http_503"}) == 1.0
