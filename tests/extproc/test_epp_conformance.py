"""Endpoint Picker Protocol v1 conformance without a cluster: the real ext_proc over real gRPC.

The Gateway API Inference Extension's conformance suite needs Kubernetes; the protocol itself
(``docs/proposals/004-endpoint-picker-protocol`` in gateway-api-inference-extension, REFERENCE.md section 3)
is a contract on the ext_proc stream. Each case here is one rule of it, written from the protocol (not
from the reference picker's code): a real :class:`~extproc.server.Gateway` listens on 127.0.0.1 (ephemeral
ports) with a static fleet of four endpoints for one model and one for another (no engine runs: the
protocol ends at the picker's answer), and each test sends the ``ProcessingRequest`` sequence Envoy sends
in ``FULL_DUPLEX_STREAMED`` body mode (request headers, body chunks with ``end_of_stream``, or trailers
after them) and checks the ``ProcessingResponse`` messages.

Rules covered:

* **Subset hint** (``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``): the pick and
  every fallback come from the hint only; the key absent (or its namespace without the key) means the
  whole pool; an empty hint, or one with nothing eligible in it (unknown, of another model, unhealthy,
  another port), is an ImmediateResponse 503. Read as a list of ``ip:port`` strings, as a comma-separated
  string, and as list items holding comma-separated addresses (blanks trimmed, empty items dropped).
  It holds whatever filters the scheduling profile lists (one without the ``subset`` filter too).
* **Destination**: the header ``x-gateway-destination-endpoint`` and the dynamic metadata
  ``envoy.lb / x-gateway-destination-endpoint`` carry the same value, ``ip:port`` or the ordered list
  ``ip:port,ip:port`` (distinct entries, the pick first, as many as the fleet and ``max_fallbacks``
  allow), set with ``raw_value`` and overwrite (a client's own destination header never survives); the
  route cache is cleared.
* **Streaming**: nothing is answered before the body's end; then the headers reply (with the destination
  and a corrected ``content-length``, also after a ``x-gateway-model-name-rewrite`` changes the body) and
  the body streamed back in chunks of at most 62,000 bytes, ``end_of_stream`` on the last only; a body
  ended by trailers gets its TrailersResponse after the body.
* **Errors**: 503 when no endpoint is ready, 429 when flow control sheds the request (with
  ``retry-after``), each an ImmediateResponse with an OpenAI-style JSON body.
* **Served endpoint**: ``envoy.lb / x-gateway-destination-endpoint-served`` in the response headers'
  metadata is where the request went; in conformance mode it is echoed as
  ``x-conformance-test-served-endpoint``.
* **Response phases** (``FULL_DUPLEX_STREAMED`` response bodies too, as the Inference Extension's
  gateways configure the picker): each response body chunk is sent back unchanged, ``end_of_stream`` as
  sent (in that mode the gateway forwards only what the picker returns); the response's end ends the
  request's count at its endpoint, since such a gateway writes no kvgate completion log.
* **Health**: gRPC health on the health port and on the ext_proc port: ``liveness`` SERVING while the
  process runs; ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` SERVING while some
  endpoint is routable, NOT_SERVING when none is (the protocol: the ext_proc service "same criteria as
  readiness"); an unknown service is NOT_FOUND.
* **Conformance headers** (``extproc.conformance = true`` only): ``test-epp-endpoint-selection`` (``ip`` or
  ``ip:port``, comma-separated, as the suite joins pod IPs) narrows the pick; off, it is ignored.
* **FailOpen** is an explicit choice: ``kvgate envoy-config`` renders ``failure_mode_allow: false`` and
  FULL_DUPLEX_STREAMED bodies unless ``--fail-open`` is given (then BUFFERED, the only mode in which Envoy
  can go on without its picker), and the picker answers in the mode rendered (the InferencePool side,
  ``failureMode: FailClose`` in the base and ``FailOpen`` in the dev overlay, is checked on the rendered
  Kustomize output by ``tests/deploy/test_kubernetes.py``).

Where kvgate differs from the reference picker (each is a choice within the protocol):

* A subset hint entry must be ``ip:port``, as the protocol writes it; the reference picker also takes a
  bare IP as "any port of that IP". kvgate matches addresses exactly, so a bare IP in a hint matches
  nothing (503), never more than the data plane named.
* With both a conformance selection and a subset hint, kvgate picks from their intersection (the hint
  is a MUST of the protocol; the selection only narrows); the reference picker lets the test header
  override the hint.
* Without ``x-gateway-destination-endpoint-served`` metadata, kvgate reads where the request went from
  the bundled Envoy route's own ``x-kvgate-upstream-host`` response header, and sends no echo when it has
  neither; the reference picker echoes a ``fail: ...`` text instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson
import pytest
import yaml
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption, Metadata
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import ListValue, Struct, Value
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contracts.epp import (
    CONFORMANCE_HEADER,
    CONFORMANCE_SERVED,
    DESTINATION,
    LB_NS,
    MAX_CHUNK,
    MODEL_REWRITE,
    PRIMARY,
    SERVED,
    SUBSET_KEY,
    SUBSET_NS,
    UPSTREAM_HEADER,
)
from extproc.config import GatewayConfig, parse_config
from extproc.routing.router import RoutingPolicy
from extproc.scheduling.registry import build_profile, parse_scheduling
from extproc.server import EXT_PROC_SERVICE, Gateway
from kvgate.cli import main as kvgate
from tests.polling import until

MODEL = "SmolLM2-135M-Instruct"
OTHER_MODEL = "other-model"
POOL = tuple(f"127.0.0.{i + 1}:8000" for i in range(4))
OTHER = "127.0.0.9:8000"
UNKNOWN = "10.9.9.9:8000"
CHAT = "/v1/chat/completions"
FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: How many endpoints a decision lists: the pick and ``max_fallbacks`` (2) fallbacks.
LISTED = 3
#: Subset hint markers: the namespace without the key; no namespace at all.
NO_KEY = object()
ABSENT = object()

GatewayFactory = Callable[..., Awaitable[Gateway]]


# --- the picker under test -------------------------------------------------------------------------------


def gateway_config(
    model_dir: str,
    *,
    conformance: bool = True,
    flow: dict[str, Any] | None = None,
    metrics_url: str | None = None,
) -> GatewayConfig:
    """The picker under test on 127.0.0.1 port 0: ``conformance`` mode unless told; ``flow``: a
    ``[flow]`` table; ``metrics_url``: the first endpoint's, scraped with a 30 s timeout."""
    raw: dict[str, Any] = {
        "extproc": {
            "listen": "127.0.0.1:0",
            "health_listen": "127.0.0.1:0",
            "metrics_listen": "",
            "max_body_bytes": 4 * 1024 * 1024,
            "max_fallbacks": LISTED - 1,
            "conformance": conformance,
        },
        "models": [{"name": MODEL, "model_dir": model_dir, "max_model_len": 1 << 20}],
        "endpoints": [{"id": f"e{i}", "address": a, "models": [MODEL]} for i, a in enumerate(POOL)]
        + [{"id": "other", "address": OTHER, "models": [OTHER_MODEL]}],
    }
    if flow is not None:
        raw["flow"] = flow
    if metrics_url is not None:
        raw["endpoints"][0]["metrics_url"] = metrics_url
        raw["scrape"] = {"timeout_s": 30.0}
    return parse_config(raw)


@pytest.fixture
async def start(model_dir: str) -> AsyncIterator[GatewayFactory]:
    """Starts real gateways (:func:`gateway_config`'s keywords); all are drained at the end."""
    started: list[Gateway] = []

    async def make(**options: Any) -> Gateway:
        gateway = Gateway(gateway_config(model_dir, **options))
        started.append(gateway)
        await gateway.start()
        return gateway

    yield make
    for gateway in started:
        await gateway.aclose(grace_s=0)


@pytest.fixture
async def gateway(start: GatewayFactory) -> Gateway:
    return await start()


# --- what Envoy sends ------------------------------------------------------------------------------------


def hint_metadata(value: Any) -> Metadata:
    """``metadata_context`` with the subset hint namespace; ``value`` the key's value (``NO_KEY``: the
    namespace without the key)."""
    ns = Struct()
    if value is not NO_KEY:
        ns.fields[SUBSET_KEY].CopyFrom(as_value(value))
    return Metadata(filter_metadata={SUBSET_NS: ns})


def as_value(value: Any) -> Value:
    if isinstance(value, list):
        return Value(list_value=ListValue(values=[as_value(v) for v in value]))
    if isinstance(value, str):
        return Value(string_value=value)
    return Value(number_value=float(value))


def request_headers(
    path: str = CHAT, *, extra: dict[str, str] | None = None, metadata: Metadata | None = None
) -> pb.ProcessingRequest:
    hs = {":method": "POST", ":path": path, "content-type": "application/json", "x-request-id": "c1"}
    hs.update(extra or {})
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()])
        ),
        metadata_context=metadata,
        protocol_config=pb.ProtocolConfiguration(request_body_mode=FULL_DUPLEX),
    )


def body_chunks(body: bytes, size: int, *, end: bool = True) -> list[pb.ProcessingRequest]:
    """``body`` in messages of ``size`` bytes, the last with ``end_of_stream`` (``end``)."""
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    return [
        pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=end and i == len(parts) - 1))
        for i, p in enumerate(parts)
    ]


def trailers() -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_trailers=pb.HttpTrailers())


def chat(content: str = "Write as if you were a critic: San Francisco", model: str = MODEL) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}]})


def response_headers(lb: dict[str, str] | None, headers: dict[str, str]) -> pb.ProcessingRequest:
    meta = None
    if lb is not None:
        ns = Struct()
        ns.update(lb)
        meta = Metadata(filter_metadata={LB_NS: ns})
    hs = {":status": "200", **headers}
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()])
        ),
        metadata_context=meta,
    )


async def exchange(gateway: Gateway, msgs: Iterable[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    """One ext_proc stream: send ``msgs``, close the sending side, read every response."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['extproc']}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        return [r async for r in stub.Process(iter(list(msgs)))]


# --- what the picker answers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Routed:
    """A routed request's answer: the destination list, the headers set, the body streamed back."""

    picks: list[str]
    headers: dict[str, str]
    body: bytes
    chunks: list[int]
    trailers_answered: bool


def routed(resps: list[pb.ProcessingResponse]) -> Routed:
    """Checks the shape every routed answer must have and returns its parts: the headers reply first
    (route cache cleared; header == ``envoy.lb`` metadata; distinct ``ip:port`` entries), then the body
    chunks (each <= 62,000 bytes, ``end_of_stream`` on the last only), then a TrailersResponse if Envoy
    sent trailers."""
    assert resps and resps[0].WhichOneof("response") == "request_headers", resps[:1]
    common = resps[0].request_headers.response
    assert common.clear_route_cache
    hs = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    overwrite = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD  # a client's own copy never survives
    assert all(h.append_action == overwrite for h in common.header_mutation.set_headers)
    assert all(not h.header.value for h in common.header_mutation.set_headers)  # raw_value only
    lb = resps[0].dynamic_metadata.fields[LB_NS].struct_value.fields
    assert lb[DESTINATION].string_value == hs[DESTINATION]
    picks = hs[DESTINATION].split(",")
    assert len(set(picks)) == len(picks) and all(p.rpartition(":")[2].isdigit() for p in picks)
    assert lb[PRIMARY].string_value == picks[0]
    rest = resps[1:]
    answered = bool(rest) and rest[-1].WhichOneof("response") == "request_trailers"
    if answered:
        rest = rest[:-1]
    assert all(r.WhichOneof("response") == "request_body" for r in rest)
    streamed = [r.request_body.response.body_mutation.streamed_response for r in rest]
    assert [s.end_of_stream for s in streamed] == [False] * (len(streamed) - 1) + [True]
    sizes = [len(s.body) for s in streamed]
    assert all(size <= MAX_CHUNK for size in sizes)
    body = b"".join(s.body for s in streamed)
    assert hs["content-length"] == str(len(body))
    return Routed(picks, hs, body, sizes, answered)


def refused(resps: list[pb.ProcessingResponse]) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, the OpenAI-style ``error`` object, headers) of the one ImmediateResponse in ``resps``."""
    assert len(resps) == 1 and resps[0].WhichOneof("response") == "immediate_response", resps
    imm = resps[0].immediate_response
    hs = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    assert hs["content-type"] == "application/json"
    error = orjson.loads(imm.body)["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return imm.status.code, error, hs


# --- subset hint and conformance selection ---------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One protocol rule: a request with a subset ``hint`` (``ABSENT``: no namespace) and ``extra``
    headers, answered with a destination list drawn from exactly ``eligible`` (``None``: 503)."""

    rule: str
    hint: Any = ABSENT
    extra: dict[str, str] = field(default_factory=dict)
    eligible: tuple[str, ...] | None = POOL


A, B, C, D = POOL
SELECTION_CASES = [
    Case("no hint: the whole pool"),
    Case("a client's own destination header: overwritten", extra={DESTINATION: UNKNOWN}),
    Case("hint namespace without the key: the whole pool", hint=NO_KEY),
    Case("hint of one: only it", hint=[C], eligible=(C,)),
    Case("hint of two: only those, both listed", hint=[B, D], eligible=(B, D)),
    Case("hint as one comma-separated string", hint=f"{A},{C}", eligible=(A, C)),
    Case("hint string: blanks trimmed, empty items dropped", hint=f"  {A} , ,  {C}  ", eligible=(A, C)),
    Case("hint list item holding two addresses", hint=[f"{B}, {D}"], eligible=(B, D)),
    Case("hint with an unknown address: the known one", hint=[UNKNOWN, B], eligible=(B,)),
    Case("hint of unknown addresses only: 503", hint=[UNKNOWN], eligible=None),
    Case("empty hint list: 503, never the whole pool", hint=[], eligible=None),
    Case("empty hint string: 503", hint="", eligible=None),
    Case("hint naming another model's endpoint only: 503", hint=[OTHER], eligible=None),
    Case("hint: same IP, another port: 503", hint=["127.0.0.2:9999"], eligible=None),
    Case("hint: a bare IP matches no ip:port (kvgate)", hint=["127.0.0.2"], eligible=None),
    Case("hint neither list nor string: 503", hint=7, eligible=None),
    Case("selection by IP", extra={CONFORMANCE_HEADER: "127.0.0.3"}, eligible=(C,)),
    Case("selection by ip:port", extra={CONFORMANCE_HEADER: D}, eligible=(D,)),
    Case("selection of pod IPs joined", extra={CONFORMANCE_HEADER: "127.0.0.1,127.0.0.2"}, eligible=(A, B)),
    Case("selection with blanks", extra={CONFORMANCE_HEADER: " 127.0.0.1 , 127.0.0.4 "}, eligible=(A, D)),
    Case("selection of no endpoint: 503", extra={CONFORMANCE_HEADER: "10.9.9.9"}, eligible=None),
    Case("selection on another port: 503", extra={CONFORMANCE_HEADER: "127.0.0.1:9999"}, eligible=None),
    Case("selection within the hint", hint=[A, B], extra={CONFORMANCE_HEADER: "127.0.0.2"}, eligible=(B,)),
    Case(
        "selection outside the hint: the hint holds, 503 (kvgate)",
        hint=[C],
        extra={CONFORMANCE_HEADER: "127.0.0.1"},
        eligible=None,
    ),
]


@pytest.mark.parametrize("case", SELECTION_CASES, ids=lambda c: c.rule)
async def test_the_pick_comes_from_the_subset_hint_and_the_selection(gateway: Gateway, case: Case) -> None:
    meta = None if case.hint is ABSENT else hint_metadata(case.hint)
    resps = await exchange(
        gateway, [request_headers(extra=case.extra, metadata=meta), *body_chunks(chat(), 64)]
    )
    if case.eligible is None:
        status, error, _ = refused(resps)
        assert (status, error["type"]) == (503, "service_unavailable")
        return
    answer = routed(resps)
    assert set(answer.picks) <= set(case.eligible)
    assert len(answer.picks) == min(LISTED, len(case.eligible))  # every eligible one, up to the list size


async def test_an_unhealthy_endpoint_in_the_hint_is_not_eligible(gateway: Gateway) -> None:
    gateway.fleet.set_state(gateway.fleet.by_address(C).id, healthy=False)  # type: ignore[union-attr]
    msgs = [request_headers(metadata=hint_metadata([C])), *body_chunks(chat(), 1024)]
    status, error, _ = refused(await exchange(gateway, msgs))
    assert (status, error["type"]) == (503, "service_unavailable")
    answer = routed(
        await exchange(gateway, [request_headers(metadata=hint_metadata([B, C])), *body_chunks(chat(), 1024)])
    )
    assert answer.picks == [B]


NO_SUBSET_FILTER = parse_scheduling(
    {
        "plugins": [{"type": t} for t in ("model", "healthy", "in-flight", "max-score")],
        "profiles": [
            {
                "name": "no-subset-filter",
                "plugins": [{"ref": "model"}, {"ref": "healthy"}, {"ref": "in-flight"}, {"ref": "max-score"}],
            }
        ],
    }
)


@pytest.mark.parametrize(
    ("hint", "eligible"), [([C], (C,)), ([B, D], (B, D)), ([], None), ([UNKNOWN], None)], ids=str
)
async def test_the_hint_holds_whatever_filters_the_profile_lists(
    gateway: Gateway, hint: list[str], eligible: tuple[str, ...] | None
) -> None:
    """An operator's profile without the ``subset`` filter (policy ``scheduling``) still picks only from
    the hint: the router applies it before any profile runs."""
    router = gateway.router
    router.apply(RoutingPolicy(build_profile(NO_SUBSET_FILTER), block_size=router.policy.block_size))
    resps = await exchange(gateway, [request_headers(metadata=hint_metadata(hint)), *body_chunks(chat(), 64)])
    if eligible is None:
        assert refused(resps)[0] == 503
    else:
        assert set(routed(resps).picks) == set(eligible)


async def test_the_selection_header_is_ignored_outside_conformance_mode(start: GatewayFactory) -> None:
    gateway = await start(conformance=False)
    msgs = [request_headers(extra={CONFORMANCE_HEADER: "127.0.0.3"}), *body_chunks(chat(), 1024)]
    answer = routed(await exchange(gateway, msgs))
    assert len(answer.picks) == LISTED and set(answer.picks) <= set(POOL)


# --- FULL_DUPLEX_STREAMED: the headers reply at the body's end, the body streamed back ---------------------


def large(size: int) -> bytes:
    """A chat body of about ``size`` bytes."""
    return chat("lorem ipsum " * (size // 12))


@pytest.mark.parametrize(
    ("shape", "body", "messages"),
    [
        ("one chunk with end_of_stream", chat(), lambda b: body_chunks(b, len(b))),
        ("many small chunks", chat("x " * 400), lambda b: body_chunks(b, 100)),
        (
            "an empty last chunk ends it",
            chat(),
            lambda b: [*body_chunks(b, 50, end=False), *body_chunks(b"", 1)],
        ),
        ("trailers end it", chat(), lambda b: [*body_chunks(b, 50, end=False), trailers()]),
        ("exactly 62,000 bytes", None, lambda b: body_chunks(b, 16 * 1024)),
        ("200 kB in 64 KiB chunks", large(200_000), lambda b: body_chunks(b, 64 * 1024)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
async def test_body_is_streamed_back_after_the_headers_reply(
    gateway: Gateway,
    shape: str,
    body: bytes | None,
    messages: Callable[[bytes], list[pb.ProcessingRequest]],
) -> None:
    if body is None:  # a chat body padded to exactly one full chunk
        base = chat("")
        body = chat("y" * (MAX_CHUNK - len(base)))
        assert len(body) == MAX_CHUNK
    msgs = messages(body)
    resps = await exchange(gateway, [request_headers(), *msgs])
    answer = routed(resps)  # nothing before the headers reply: no per-chunk acknowledgement
    assert answer.body == body
    assert answer.chunks == [min(MAX_CHUNK, len(body) - off) for off in range(0, len(body), MAX_CHUNK)]
    assert answer.trailers_answered == (msgs[-1].WhichOneof("request") == "request_trailers")
    assert len(answer.picks) == LISTED and set(answer.picks) <= set(POOL)


async def test_content_length_follows_a_model_name_rewrite(gateway: Gateway) -> None:
    body = chat("rewrite me")
    msgs = [request_headers(extra={MODEL_REWRITE: OTHER_MODEL}), *body_chunks(body, 16)]
    answer = routed(await exchange(gateway, msgs))
    assert answer.picks == [OTHER]
    assert orjson.loads(answer.body)["model"] == OTHER_MODEL and len(answer.body) != len(body)


# --- errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("why", ["unhealthy", "draining"])
async def test_no_ready_endpoint_is_503(gateway: Gateway, why: str) -> None:
    for state in list(gateway.fleet):
        gateway.fleet.set_state(state.id, **{"healthy": False} if why == "unhealthy" else {"draining": True})
    status, error, _ = refused(await exchange(gateway, [request_headers(), *body_chunks(chat(), 1024)]))
    assert (status, error["type"], error["code"]) == (503, "service_unavailable", "no_endpoint")


async def test_flow_control_shedding_is_429(start: GatewayFactory) -> None:
    """Every endpoint saturated (``max_in_flight = 0``) and a queue of one: the first request is held
    (Envoy's message timeout extended), the second is shed with 429 ``queue_full`` at once."""
    gateway = await start(
        flow={"saturation": {"max_in_flight": 0}, "bands": {"default": {"max_requests": 1}}}
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['extproc']}") as channel:
        held = pb_grpc.ExternalProcessorStub(channel).Process()
        for msg in [request_headers(), *body_chunks(chat(), 1024)]:
            await held.write(msg)
        first = await held.read()
        assert first.HasField("override_message_timeout"), first
        status, error, hs = refused(await exchange(gateway, [request_headers(), *body_chunks(chat(), 1024)]))
        assert (status, error["type"], error["code"]) == (429, "rate_limit_error", "queue_full")
        assert int(hs["retry-after"]) >= 1
        held.cancel()


# --- the served endpoint ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    """A response-headers message: ``metadata`` the ``envoy.lb`` served key's value and ``upstream`` the
    bundled route's ``x-kvgate-upstream-host`` (each ``pick``, ``fallback``, or ``None``: absent);
    ``echo``: which one the picker reports as served (``None``: no echo header)."""

    rule: str
    metadata: str | None
    upstream: str | None
    echo: str | None
    conformance: bool = True


SERVED_CASES = [
    Served("served by the fallback, in metadata", "fallback", None, "fallback"),
    Served("served by the pick, in metadata", "pick", None, "pick"),
    Served("metadata wins over kvgate's own header", "fallback", "pick", "fallback"),
    Served("kvgate's own upstream header alone (kvgate)", None, "fallback", "fallback"),
    Served("neither: no echo (kvgate)", None, None, None),
    Served("conformance off: never an echo", "fallback", "fallback", None, conformance=False),
]


@pytest.mark.parametrize("case", SERVED_CASES, ids=lambda c: c.rule)
async def test_the_served_endpoint_is_read_back_and_echoed(start: GatewayFactory, case: Served) -> None:
    """The list is ordered: the pick (first) carries the request's in-flight slot until the response
    says where it was served; the served endpoint then carries it."""
    gateway = await start(conformance=case.conformance)
    fleet = gateway.fleet

    def in_flight(address: str) -> int:
        state = fleet.by_address(address)
        assert state is not None
        return state.in_flight

    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['extproc']}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        for msg in [request_headers(), *body_chunks(chat(), 1024)]:
            await call.write(msg)
        replies = [await call.read()]
        while not replies[-1].request_body.response.body_mutation.streamed_response.end_of_stream:
            replies.append(await call.read())
        picks = routed(replies).picks
        assert [in_flight(p) for p in picks] == [1] + [0] * (LISTED - 1)
        where = {"pick": picks[0], "fallback": picks[1]}
        lb = {"unrelated": "x"} if case.metadata is None else {SERVED: where[case.metadata]}
        upstream = {} if case.upstream is None else {UPSTREAM_HEADER: where[case.upstream]}
        await call.write(response_headers(lb, upstream))
        reply = await call.read()
        served = case.metadata or case.upstream
        if served is not None:
            assert in_flight(where[served]) == 1 and sum(in_flight(p) for p in picks) == 1
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
    mutation = reply.response_headers.response.header_mutation
    echoed = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    assert echoed == ({} if case.echo is None else {CONFORMANCE_SERVED: where[case.echo]})
    assert UPSTREAM_HEADER in mutation.remove_headers  # kvgate's internal header never reaches the client


# --- the response phases ---------------------------------------------------------------------------------


async def test_the_response_is_streamed_back_and_its_end_completes_the_request(gateway: Gateway) -> None:
    """The Inference Extension's gateways send the response to the picker too (FULL_DUPLEX_STREAMED both
    ways, no kvgate completion log): each response body chunk is sent back as it came (the gateway
    forwards nothing else), and the response's end ends the request's count at its endpoint (flow
    control's in-flight limit, the load estimate)."""
    fleet = gateway.fleet
    start = request_headers()
    start.protocol_config.response_body_mode = FULL_DUPLEX
    chunks = [(b'data: {"choices": []}\n\n', False), (b"data: [DONE]\n\n", False), (b"", True)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['extproc']}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        for msg in [start, *body_chunks(chat(), 1024)]:
            await call.write(msg)
        replies = [await call.read()]
        while not replies[-1].request_body.response.body_mutation.streamed_response.end_of_stream:
            replies.append(await call.read())
        pick = routed(replies).picks[0]
        state = fleet.by_address(pick)
        assert state is not None and state.outstanding == 1
        await call.write(response_headers({SERVED: pick}, {"content-type": "text/event-stream"}))
        assert (await call.read()).HasField("response_headers")
        back = []
        for chunk, end in chunks:
            await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end)))
            streamed = (await call.read()).response_body.response.body_mutation.streamed_response
            back.append((streamed.body, streamed.end_of_stream))
        assert back == chunks
        assert state.outstanding == 0 and state.completed_since_scrape == 1
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
    assert state.outstanding == 0 and state.completed_since_scrape == 1 and state.in_flight == 0


# --- health ---------------------------------------------------------------------------------------------


async def statuses(gateway: Gateway, port: str) -> dict[str, int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports[port]}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        out = {}
        for service in ("liveness", "readiness", EXT_PROC_SERVICE):
            out[service] = (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Check(health_pb2.HealthCheckRequest(service="no-such-service"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        return out


async def eventually(gateway: Gateway, port: str, expected: dict[str, int], timeout_s: float = 10) -> None:
    """Poll the health services (the scraper's round, every 0.1 s, re-evaluates readiness) until they
    read ``expected``, failing after ``timeout_s``."""
    seen: dict[str, int] = {}

    async def check() -> None:
        seen.update(await statuses(gateway, port))

    deadline = time.monotonic() + timeout_s
    await check()
    while seen != expected:
        assert time.monotonic() < deadline, seen
        await asyncio.sleep(0.005)
        await check()


ALL_SERVING = dict.fromkeys(("liveness", "readiness", EXT_PROC_SERVICE), SERVING)


@pytest.mark.parametrize("port", ["health", "extproc"])
async def test_health_services_follow_readiness(gateway: Gateway, port: str) -> None:
    assert await statuses(gateway, port) == ALL_SERVING
    for state in list(gateway.fleet):
        gateway.fleet.set_state(state.id, healthy=False)
    await eventually(
        gateway, port, {"liveness": SERVING, "readiness": NOT_SERVING, EXT_PROC_SERVICE: NOT_SERVING}
    )
    gateway.fleet.set_state(gateway.fleet.by_address(A).id, healthy=True)  # type: ignore[union-attr]
    await eventually(gateway, port, ALL_SERVING)


# --- FailOpen is a choice, FailClose the default --------------------------------------------------------


def rendered_ext_proc(fail_open: bool, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """The ext_proc filter of ``kvgate envoy-config`` (``--fail-open`` when asked)."""
    argv = ["envoy-config", "--extproc", "127.0.0.1:9002"] + (["--fail-open"] if fail_open else [])
    assert kvgate(argv) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f["typed_config"] for f in hcm["http_filters"] if f["name"].endswith(".ext_proc")]
    assert isinstance(ext_proc, dict)
    return ext_proc


@pytest.mark.parametrize("fail_open", [False, True], ids=["default: FailClose", "--fail-open"])
async def test_fail_open_is_a_choice_and_the_picker_serves_the_mode_it_renders(
    gateway: Gateway, fail_open: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvgate envoy-config`` fails closed (``failure_mode_allow: false``, FULL_DUPLEX_STREAMED bodies)
    unless ``--fail-open`` is given; then Envoy may go on without its picker only with a body it kept
    (BUFFERED). The picker answers either mode as rendered: streamed, the destination in the headers
    reply; buffered, the headers let through at once and the destination, metadata and body in the
    body's reply."""
    ext_proc = rendered_ext_proc(fail_open, capsys)
    assert ext_proc["failure_mode_allow"] is fail_open
    mode_name = ext_proc["processing_mode"]["request_body_mode"]
    assert mode_name == ("BUFFERED" if fail_open else "FULL_DUPLEX_STREAMED")
    first = request_headers()
    first.protocol_config.request_body_mode = ProcessingMode.BodySendMode.Value(mode_name)
    body = chat("hello " * 40)
    if not fail_open:
        answer = routed(await exchange(gateway, [first, *body_chunks(body, 100)]))
        assert answer.body == body and set(answer.picks) <= set(POOL)
        return
    go, reply = await exchange(gateway, [first, *body_chunks(body, len(body))])
    assert go.WhichOneof("response") == "request_headers"
    assert not go.request_headers.response.HasField("header_mutation")
    common = reply.request_body.response
    hs = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    lb = reply.dynamic_metadata.fields[LB_NS].struct_value.fields
    assert hs[DESTINATION] == lb[DESTINATION].string_value and set(hs[DESTINATION].split(",")) <= set(POOL)
    assert common.clear_route_cache and common.body_mutation.body == body
    assert hs["content-length"] == str(len(body))


async def test_a_draining_picker_stays_not_serving(start: GatewayFactory) -> None:
    """Once the drain has begun, a scrape round that still runs (while the drain awaits its streams)
    finds the fleet routable but leaves every service NOT_SERVING."""
    gateway = await start()
    await gateway.aclose(grace_s=0)
    gateway._on_scrape_round()  # a round racing the drain
    for service in ("", "liveness", "readiness", EXT_PROC_SERVICE):
        got = await gateway.health.Check(health_pb2.HealthCheckRequest(service=service), None)
        assert got.status == NOT_SERVING, service


async def test_readiness_is_known_and_not_serving_before_the_first_scrape_round(model_dir: str) -> None:
    """The health port answers as soon as it listens, while the first scrape round still runs (held here
    by a metrics endpoint that has not answered yet): ``liveness`` SERVING, ``readiness`` and the ext_proc
    service NOT_SERVING (never NOT_FOUND); SERVING once the round is done."""
    answer = asyncio.Event()

    async def metrics(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer.wait()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(metrics, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    gateway = Gateway(gateway_config(model_dir, metrics_url=f"http://127.0.0.1:{port}/metrics"))
    starting = asyncio.create_task(gateway.start())
    try:
        await until(lambda: "health" in gateway.ports or starting.done(), 10)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['health']}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            got = {}
            for service in ("liveness", "readiness", EXT_PROC_SERVICE):
                request = health_pb2.HealthCheckRequest(service=service)
                got[service] = (await stub.Check(request, wait_for_ready=True, timeout=10)).status
        assert not starting.done()  # the first round is still waiting for the metrics
        assert got == {"liveness": SERVING, "readiness": NOT_SERVING, EXT_PROC_SERVICE: NOT_SERVING}
        answer.set()
        await asyncio.wait_for(starting, 30)
        await eventually(gateway, "health", ALL_SERVING)
    finally:
        answer.set()
        if not starting.done():
            starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await gateway.aclose(grace_s=0)
        server.close()
        await server.wait_closed()
