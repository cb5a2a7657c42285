"""The ext_proc stream state machine in memory: ProcessingRequests in, ProcessingResponses out.

A real :class:`Router` over a real :class:`Fleet` (SmolLM2's tokenizer, the default scheduling profile, a
seeded rng) and a real :class:`Gate` with in-memory keys; the clock is fixed, so token buckets never
refill. No gRPC: :class:`StreamProcessor` is driven message by message as Envoy drives it
(``tests/extproc/test_server.py`` does the same over real gRPC).
"""

from __future__ import annotations

import logging
import random
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption, Metadata
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format
from google.protobuf.struct_pb2 import Struct

from contracts.epp import (
    CONFORMANCE_HEADER,
    CONFORMANCE_SERVED,
    DECISION_NS,
    DESTINATION,
    JWT_NS,
    LB_NS,
    MAX_CHUNK,
    MODEL_HEADER,
    MODEL_REWRITE,
    PRIMARY,
    SERVED,
    SUBSET_KEY,
    SUBSET_NS,
    TENANT_HEADER,
    UPSTREAM_HEADER,
)
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.admission.gate import (
    AuthConfig,
    Gate,
    JwtConfig,
    Settle,
    Ticket,
)
from extproc.admission.keys import ApiKey, KeyStore, hash_key, new_key
from extproc.admission.tenants import Tenant, TenantMatch, Tenants, TokenLimit
from extproc.admission.usage import Usage
from extproc.errors import Unavailable
from extproc.fleet import Fleet
from extproc.index.approximate import ApproximateIndex
from extproc.models.registry import ModelAssets, ModelRegistry
from extproc.processor import ProcessorConfig, StreamProcessor
from extproc.routing.router import Decision, Router, RoutingPolicy, Tokens
from extproc.routing.timeouts import (
    FIRST_BYTE_TIMEOUT_HEADER,
    REQUEST_TIMEOUT_HEADER,
    Timeouts,
    TimeoutTable,
)
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile

MODEL = "smol"
OTHER = "other"
ADDRESSES = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
OTHER_ADDRESS = "10.0.0.9:8000"
UNKNOWN_ADDRESS = "10.9.9.9:8000"
NOW = 1000.0
CHAT = "/v1/chat/completions"
LIMIT = 1 << 20

KEY, ORPHAN, STRANGER = new_key(), new_key(), new_key()
ACME = Tenant(
    "acme",
    ("smol*",),
    TenantMatch(claims=(("tenant", frozenset({"acme"})),)),
    tokens=TokenLimit(per_minute=600, burst=1000),
)
WIDE = Tenant("wide", ("*",), TenantMatch(groups=frozenset({"wide"})))
KEYS = KeyStore([ApiKey("k1", "acme", hash_key(KEY), 1), ApiKey("k2", "gone", hash_key(ORPHAN), 1)])
ACME_KEY = {"authorization": f"Bearer {KEY}"}


def clock() -> float:
    return NOW


# --- the cores -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def assets(model_dir: str) -> ModelAssets:
    # A window wider than SmolLM2's 8192 tokens: the chunking tests stream bodies of 15,000-31,000 tokens
    # (the context-length check has its own tests in test_context_length.py).
    return ModelAssets.load(MODEL, Path(model_dir), max_model_len=1 << 20)


def make_router(assets: ModelAssets, cls: type[Router] = Router) -> Router:
    endpoints = [Endpoint(EndpointId(f"e{i}"), a, frozenset({MODEL})) for i, a in enumerate(ADDRESSES)]
    endpoints.append(Endpoint(EndpointId("o"), OTHER_ADDRESS, frozenset({OTHER})))
    return cls(
        Fleet(endpoints),
        ModelRegistry([assets]),
        ApproximateIndex(),
        RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16),
        rng=random.Random(0),
    )


@pytest.fixture
def router(assets: ModelAssets) -> Router:
    return make_router(assets)


def make_gate(settle: Settle = Settle.USAGE) -> Gate:
    idp = JwtConfig("https://idp", ("kvgate",), jwks_uri="https://idp/jwks")
    return Gate(AuthConfig(jwt=idp, default_max_tokens=100, settle=settle), Tenants([ACME, WIDE]), KEYS)


def processor(
    router: Router, gate: Gate | None = None, *, conformance: bool = False, limit: int = LIMIT
) -> StreamProcessor:
    return StreamProcessor(
        router, ProcessorConfig(max_body_bytes=limit, conformance=conformance), clock, gate
    )


# --- Envoy's messages ------------------------------------------------------------------------------------


def struct(fields: dict[str, Any]) -> Struct:
    s = Struct()
    s.update(fields)
    return s


def metadata(**namespaces: dict[str, Any]) -> Metadata:
    """Dynamic metadata; namespace names with dots are passed as ``**{"envoy.lb": {...}}``."""
    return Metadata(filter_metadata={ns: struct(fields) for ns, fields in namespaces.items()})


#: What jwt_authn verified for our provider (issuer, audience): every payload it passes on has them.
VERIFIED = {"iss": "https://idp", "aud": ["kvgate", "other"]}


def jwt(claims: Any = None, status: Any = None) -> Metadata:
    fields: dict[str, Any] = {}
    if claims is not None:
        fields["jwt_payload"] = {**VERIFIED, **claims} if isinstance(claims, dict) else claims
    if status is not None:
        fields["jwt_status"] = status
    return metadata(**{JWT_NS: fields})


def header_map(headers: dict[str, str], value_form: bool = False) -> HeaderMap:
    if value_form:  # Envoy sends ``value`` instead of ``raw_value`` when so configured
        return HeaderMap(headers=[HeaderValue(key=k, value=v) for k, v in headers.items()])
    return HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])


def headers(
    path: str = CHAT,
    method: str = "POST",
    *,
    end: bool = False,
    extra: dict[str, str] | None = None,
    meta: Metadata | None = None,
) -> pb.ProcessingRequest:
    hs = {":path": path, ":method": method, "x-request-id": "r1", **(extra or {})}
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(hs), end_of_stream=end), metadata_context=meta
    )


def body(chunk: bytes, end: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=end))


def trailers() -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_trailers=pb.HttpTrailers())


def response_headers(
    status: str = "200",
    extra: dict[str, str] | None = None,
    meta: Metadata | None = None,
    value_form: bool = False,
) -> pb.ProcessingRequest:
    hs = {":status": status, **(extra or {})}
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=header_map(hs, value_form)), metadata_context=meta
    )


def response_body(chunk: bytes, end: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end))


def chat(content: str = "hello", model: str = MODEL, **extra: Any) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}], **extra})


def sized(n: int) -> bytes:
    """A valid completion request of exactly ``n`` bytes."""
    empty = orjson.dumps({"model": MODEL, "prompt": ""})
    out = orjson.dumps({"model": MODEL, "prompt": "x" * (n - len(empty))})
    assert len(out) == n
    return out


def route(proc: StreamProcessor, payload: bytes, **kw: Any) -> list[pb.ProcessingResponse]:
    """Headers then the whole body in one chunk: the responses to the body."""
    assert proc.handle(headers(**kw)) == []
    return proc.handle(body(payload))


# --- reading the answers ---------------------------------------------------------------------------------


def set_headers(mutation: pb.HeaderMutation) -> dict[str, str]:
    assert all(h.append_action == HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD for h in mutation.set_headers)
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def immediate(out: list[pb.ProcessingResponse]) -> tuple[int, Any, dict[str, str], str]:
    """(status, decoded JSON body, headers, details) of the one ImmediateResponse in ``out``."""
    assert len(out) == 1 and out[0].WhichOneof("response") == "immediate_response", out
    assert json_format.MessageToDict(out[0].dynamic_metadata) == {"kvgate": {"rejected": True}}
    imm = out[0].immediate_response
    hs = set_headers(imm.headers)
    assert hs["content-type"] == "application/json"
    return imm.status.code, orjson.loads(imm.body), hs, imm.details


def error(out: list[pb.ProcessingResponse]) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, OpenAI ``error`` object, headers) of a rejection."""
    status, doc, hs, details = immediate(out)
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert details == f"kvgate_{err['type']}"
    return status, err, hs


def models_listed(out: list[pb.ProcessingResponse]) -> list[str]:
    status, doc, _, details = immediate(out)
    assert (status, details, doc["object"]) == (200, "kvgate_models", "list")
    return [m["id"] for m in doc["data"]]


@dataclass
class Reply:
    """The routing decision: the headers reply, then the body streamed back."""

    set_headers: dict[str, str]
    remove_headers: list[str]
    lb: dict[str, str]
    chunks: list[tuple[bytes, bool]]
    decision: dict[str, Any]

    @property
    def destination(self) -> list[str]:
        return self.set_headers[DESTINATION].split(",")

    @property
    def body(self) -> bytes:
        return b"".join(c for c, _ in self.chunks)


def reply(out: Sequence[pb.ProcessingResponse]) -> Reply:
    first, *rest = out
    assert first.WhichOneof("response") == "request_headers", out
    common = first.request_headers.response
    assert common.clear_route_cache
    meta = json_format.MessageToDict(first.dynamic_metadata)
    assert set(meta) == {LB_NS, DECISION_NS}
    chunks = []
    for r in rest:
        assert r.WhichOneof("response") == "request_body", r
        streamed = r.request_body.response.body_mutation.streamed_response
        chunks.append((streamed.body, streamed.end_of_stream))
    mutation = common.header_mutation
    return Reply(set_headers(mutation), list(mutation.remove_headers), meta[LB_NS], chunks, meta[DECISION_NS])


def trailers_only(out: list[pb.ProcessingResponse]) -> None:
    assert out == [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]


def in_flight(router: Router) -> dict[str, int]:
    return {s.address: s.in_flight for s in router.fleet if s.in_flight}


# --- request headers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_a_routed_path_takes_post_only(router: Router, method: str) -> None:
    """An engine answers anything but POST on a routed path with 405: the gateway refuses it at the
    headers (404, as for /v1/models' wrong methods), before a decision or a slot is spent on it."""
    proc = processor(router)
    status, err, _ = error(proc.handle(headers(CHAT, method)))
    assert (status, err["message"]) == (404, "Use POST for /v1/chat/completions.")
    assert proc.handle(body(chat())) == []  # answered: the body is drained
    assert proc.decision is None and in_flight(router) == {}


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("GET", "/v1/models", [OTHER, MODEL]),
        ("HEAD", "/v1/models?limit=1", [OTHER, MODEL]),
        ("POST", "/v1/models", (404, "Use GET for /v1/models.")),
        ("POST", CHAT, (400, "The request body is empty; expected a JSON object.")),
        ("GET", "/v1/completions?x=1", (404, "Use POST for /v1/completions.")),
        ("DELETE", "/v1/nope?x=1", (404, "Unknown path /v1/nope; kvgate routes")),
        (None, None, (404, "Unknown path /; kvgate routes")),  # no pseudo-headers: GET /
    ],
)
@pytest.mark.parametrize("value_form", [False, True])
def test_headers_only_requests_are_answered_at_once(
    router: Router, method: str | None, path: str | None, expected: Any, value_form: bool
) -> None:
    hs = {"x-request-id": "r1"} | ({":method": method, ":path": path} if method and path else {})
    proc = processor(router)
    end = pb.HttpHeaders(headers=header_map(hs, value_form), end_of_stream=True)
    out = proc.handle(pb.ProcessingRequest(request_headers=end))
    if isinstance(expected, list):
        assert models_listed(out) == expected
    else:
        status, err, _ = error(out)
        assert (status, err["message"][: len(expected[1])]) == expected
    assert proc.decision is None and in_flight(router) == {}
    assert proc.handle(body(b"{}")) == []  # answered: a late body is drained


@pytest.mark.parametrize(
    ("extra", "meta", "expected"),
    [
        (ACME_KEY, None, [MODEL]),  # acme may use smol* only
        ({}, jwt({"sub": "u", "groups": ["wide"]}), [OTHER, MODEL]),
        ({}, None, 401),
    ],
)
def test_models_are_listed_within_the_principals_scope(
    router: Router, extra: dict[str, str], meta: Metadata | None, expected: Any
) -> None:
    out = processor(router, make_gate()).handle(
        headers("/v1/models", "GET", end=True, extra=extra, meta=meta)
    )
    if expected == 401:
        assert error(out)[0] == 401
    else:
        assert models_listed(out) == expected


@pytest.mark.parametrize(
    ("method", "finish", "expected"),
    [
        # Envoy sends end_of_stream on a later message when the client's stream ends in an empty
        # DATA frame (HTTP/2) or a zero-length chunk: still a GET, still the list
        ("GET", [body(b"", end=True)], [OTHER, MODEL]),
        ("HEAD", [body(b"", end=False), trailers()], [OTHER, MODEL]),
        ("GET", [body(b"ignored", end=True)], [OTHER, MODEL]),
        ("POST", [body(chat(), end=True)], 404),
    ],
)
def test_models_with_a_body_phase(
    router: Router, method: str, finish: list[pb.ProcessingRequest], expected: Any
) -> None:
    proc = processor(router)
    assert proc.handle(headers("/v1/models", method)) == []
    outs = [proc.handle(m) for m in finish]
    assert all(o == [] for o in outs[:-1])
    if expected == 404:
        status, err, _ = error(outs[-1])
        assert (status, err["message"]) == (404, "Use GET for /v1/models.")
    else:
        assert models_listed(outs[-1]) == expected  # the ImmediateResponse alone: no TrailersResponse


@pytest.mark.parametrize(
    "before",
    [
        [headers()],  # in the body phase
        [headers(), body(chat())],  # after the decision
        [headers("/v1/models", "GET", end=True)],  # after an immediate answer
    ],
)
def test_request_headers_twice_is_an_internal_error(
    router: Router, before: list[pb.ProcessingRequest]
) -> None:
    proc = processor(router)
    for msg in before:
        proc.handle(msg)
    status, err, _ = error(proc.handle(headers()))
    assert (status, err["type"], err["message"]) == (500, "server_error", "Request headers received twice.")


# --- request body ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "late", "message"),
    [
        ([], body(b"{}"), "Request body outside the body phase."),
        ([headers(), body(chat())], body(b"{}"), "Request body outside the body phase."),
        ([], trailers(), "Request trailers before the request headers."),
    ],
    ids=["body-first", "body-after-decision", "trailers-first"],
)
def test_messages_outside_their_phase_are_internal_errors(
    router: Router, before: list[pb.ProcessingRequest], late: pb.ProcessingRequest, message: str
) -> None:
    proc = processor(router)
    for msg in before:
        proc.handle(msg)
    status, err, _ = error(proc.handle(late))
    assert (status, err["type"], err["message"]) == (500, "server_error", message)


@pytest.mark.parametrize(
    ("gate", "answered"),
    [
        (False, [headers(), body(sized(LIMIT + 1), end=False)]),  # 413
        (True, [headers()]),  # 401 at the headers, before any body
        (False, [headers(), headers()]),  # 500
        (False, [headers(), pb.ProcessingRequest()]),  # 400
        (False, [headers("/nope", "GET", end=True)]),  # 404
    ],
    ids=["413", "401", "500", "400", "404"],
)
def test_after_an_answer_the_rest_of_the_request_is_drained(
    router: Router, gate: bool, answered: list[pb.ProcessingRequest]
) -> None:
    proc = processor(router, make_gate() if gate else None)
    outs = [proc.handle(m) for m in answered]
    immediate(outs[-1])
    assert proc.handle(body(b"more", end=False)) == []
    assert proc.handle(body(b"", end=True)) == []
    trailers_only(proc.handle(trailers()))
    assert proc.decision is None and in_flight(router) == {}


@pytest.mark.parametrize(
    ("chunks", "rejected_at"),
    [
        ([1000], None),  # exactly the limit
        ([600, 400], None),
        ([0, 1000], None),  # an empty chunk counts nothing
        ([1001], 0),
        ([600, 401], 1),
        ([999, 0, 2], 2),
    ],
)
def test_body_limit(router: Router, chunks: list[int], rejected_at: int | None) -> None:
    payload = sized(sum(chunks))
    proc = processor(router, limit=1000)
    assert proc.handle(headers("/v1/completions")) == []
    outs, off = [], 0
    for i, n in enumerate(chunks):
        outs.append(proc.handle(body(payload[off : off + n], end=i == len(chunks) - 1)))
        off += n
    if rejected_at is None:
        assert all(o == [] for o in outs[:-1])
        assert reply(outs[-1]).body == payload
        return
    assert all(o == [] for o in outs[:rejected_at])
    status, err, _ = error(outs[rejected_at])
    assert (status, err["type"]) == (413, "invalid_request_error")
    assert err["message"] == "The request body exceeds the gateway's limit of 1000 bytes."
    assert all(o == [] for o in outs[rejected_at + 1 :])
    assert proc.decision is None


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([body(chat())], "reply"),  # end of stream on the last body chunk
        ([body(chat()[:5], end=False), body(chat()[5:], end=False), trailers()], "reply+trailers"),
        ([body(b"", end=False), body(chat(), end=False), trailers()], "reply+trailers"),
        ([trailers()], 400),  # trailers with no body at all: the empty body is refused, nothing else
        ([body(chat()), trailers()], "trailers"),  # trailers after the body: only the TrailersResponse
    ],
    ids=["last-chunk", "trailers", "empty-chunk-then-trailers", "trailers-no-body", "trailers-after-body"],
)
def test_end_of_stream(router: Router, messages: list[pb.ProcessingRequest], expected: Any) -> None:
    proc = processor(router)
    assert proc.handle(headers()) == []
    outs = [proc.handle(m) for m in messages]
    last = outs[-1]
    if expected == 400:
        status, err, _ = error(last)
        assert (status, err["message"]) == (400, "The request body is empty; expected a JSON object.")
        return
    if expected == "trailers":
        assert reply(outs[0]).body == chat()
        trailers_only(last)
        return
    assert all(o == [] for o in outs[:-1])
    if expected == "reply+trailers":
        assert last[-1] == pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        last = last[:-1]
    assert reply(last).body == chat()
    assert proc.decision is not None


@pytest.mark.parametrize(
    ("path", "payload", "expected"),
    [
        ("/v1/chat/completions?api-version=1", chat(), "routed"),
        ("/v1/completions", orjson.dumps({"model": MODEL, "prompt": "hi"}), "routed"),
        ("/v1/nope", chat(), (404, None, "Unknown path /v1/nope; kvgate routes")),
        (CHAT, b"", (400, None, "The request body is empty; expected a JSON object.")),
        (CHAT, b"{not json", (400, None, "The request body is not valid JSON.")),
        (CHAT, b"[]", (400, None, "The request body must be a JSON object.")),
        (CHAT, chat(model="ghost"), (404, "model_not_found", "The model `ghost` does not exist.")),
    ],
)
def test_request_body_outcomes(router: Router, path: str, payload: bytes, expected: Any) -> None:
    proc = processor(router)
    out = route(proc, payload, path=path)
    if expected == "routed":
        assert reply(out).body == payload
        return
    status, err, _ = error(out)
    assert (status, err["code"]) == expected[:2]
    assert err["message"].startswith(expected[2])
    assert proc.decision is None and in_flight(router) == {}


# --- the decision ----------------------------------------------------------------------------------------


def test_decision_reply_shape(router: Router) -> None:
    proc = processor(router)
    payload = chat("hello " * 40)
    r = reply(route(proc, payload))
    decision = proc.decision
    assert decision is not None
    assert r.destination == [s.address for s in decision.endpoints]  # the pick, then the fallbacks
    assert len(r.destination) == 3 and set(r.destination) == set(ADDRESSES)
    assert r.set_headers == {
        DESTINATION: decision.destination,
        "content-length": str(len(payload)),
        MODEL_HEADER: MODEL,  # Envoy routes on it to the model's idle timeout, and removes it upstream
        REQUEST_TIMEOUT_HEADER: "1800000",  # the default bound (a non-streamed request: no first-byte bound)
    }
    assert r.remove_headers == []
    assert r.lb == {DESTINATION: decision.destination, PRIMARY: r.destination[0]}
    assert r.decision == {  # for the access log; the fixed clock makes the decision take 0 us
        "model": MODEL,
        "endpoint": decision.endpoints[0].id,
        "matched_blocks": 0,
        "prompt_blocks": decision.prompt_blocks,
        "decision_us": 0,
        "matched_tokens": 0,  # matched blocks x block size: the drift alarm's prediction
    }
    assert r.chunks == [(payload, True)]
    assert in_flight(router) == {r.destination[0]: 1}
    # Nobody held its first block: its tokenization stopped there, its length in blocks is estimated,
    # and the rest of the window is hashed for the index record once the answer is out.
    assert decision.rest is not None and len(decision.digests) == 1
    proc.after_send()
    assert decision.rest is None and abs(len(decision.digests) - decision.prompt_blocks) <= 1


class Ticking:
    """A clock that stands still until something advances it."""

    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


class TimedRouter(Router):
    """Tokenizing takes 1 ms and deciding 2.5 ms of ``ticking`` time."""

    ticking = Ticking()

    def tokens(self, *args: Any, **kwargs: Any) -> Tokens:
        self.ticking.now += 0.001
        return super().tokens(*args, **kwargs)

    def decide(self, *args: Any, **kwargs: Any) -> Decision:
        self.ticking.now += 0.0025
        return super().decide(*args, **kwargs)


def test_decision_metadata_times_the_decision_and_counts_matched_blocks(assets: ModelAssets) -> None:
    router = make_router(assets, TimedRouter)
    payload = chat("hello " * 40)
    seen = []
    for _ in range(2):  # the second request finds the prompt where the first was sent
        proc = StreamProcessor(router, ProcessorConfig(max_body_bytes=LIMIT), TimedRouter.ticking)
        r = reply(route(proc, payload))
        proc.after_send()
        seen.append(r.decision)
    blocks = seen[1]["prompt_blocks"]  # exact: a lead exists, so the whole window was hashed
    assert blocks >= 3 and abs(seen[0]["prompt_blocks"] - blocks) <= 1  # the first estimated (nothing held)
    assert [(d["matched_blocks"], d["decision_us"]) for d in seen] == [(0, 3500), (blocks, 3500)]
    assert seen[0]["endpoint"] == seen[1]["endpoint"]


@pytest.mark.parametrize(
    ("size", "chunks"),
    [
        (100, [100]),
        (MAX_CHUNK - 1, [MAX_CHUNK - 1]),
        (MAX_CHUNK, [MAX_CHUNK]),
        (MAX_CHUNK + 1, [MAX_CHUNK, 1]),
        (2 * MAX_CHUNK, [MAX_CHUNK, MAX_CHUNK]),
        (2 * MAX_CHUNK + 7, [MAX_CHUNK, MAX_CHUNK, 7]),
    ],
)
def test_body_is_streamed_back_in_chunks(router: Router, size: int, chunks: list[int]) -> None:
    payload = sized(size)
    r = reply(route(processor(router), payload, path="/v1/completions"))
    assert [len(c) for c, _ in r.chunks] == chunks
    assert [end for _, end in r.chunks] == [False] * (len(chunks) - 1) + [True]
    assert r.body == payload and r.set_headers["content-length"] == str(size)


def test_timeouts_per_model_and_stream(router: Router) -> None:
    table = TimeoutTable(Timeouts(request_s=0), {MODEL: Timeouts(request_s=60, first_byte_s=2.5)})
    proc = StreamProcessor(router, ProcessorConfig(max_body_bytes=LIMIT, timeouts=table), clock)
    r = reply(route(proc, chat("hi", stream=True)))
    bounds = (r.set_headers[REQUEST_TIMEOUT_HEADER], r.set_headers[FIRST_BYTE_TIMEOUT_HEADER])
    assert bounds == ("60000", "2500")


def test_buffered_body_mode_routes_in_the_body_reply(router: Router) -> None:
    """Envoy in BUFFERED body mode (the bundled config with ``--fail-open``) waits for the headers reply
    before sending the whole body: the headers are let through unchanged, and the body's reply carries
    the routing headers, the metadata and the body."""
    proc = processor(router)
    first = headers()
    first.protocol_config.request_body_mode = ProcessingMode.BUFFERED
    (go,) = proc.handle(first)
    assert go.WhichOneof("response") == "request_headers"
    assert not go.request_headers.response.HasField("header_mutation")
    payload = chat("hello " * 40)
    (reply,) = proc.handle(body(payload))
    common = reply.request_body.response
    decision = proc.decision
    assert decision is not None
    assert set_headers(common.header_mutation)[DESTINATION] == decision.destination
    assert common.clear_route_cache and common.body_mutation.body == payload
    lb = json_format.MessageToDict(reply.dynamic_metadata)[LB_NS]
    assert lb[DESTINATION] == decision.destination


@pytest.mark.parametrize(
    ("rewrite", "model", "destination"),
    [
        (OTHER, OTHER, [OTHER_ADDRESS]),  # a model with no tokenizer: routed on its bytes
        ("", MODEL, list(ADDRESSES)),  # an empty header is no rewrite
    ],
)
def test_model_rewrite_header(router: Router, rewrite: str, model: str, destination: list[str]) -> None:
    payload = chat(temperature=0.5)
    r = reply(route(processor(router), payload, extra={MODEL_REWRITE: rewrite}))
    sent = orjson.loads(r.body)
    assert sent == {**orjson.loads(payload), "model": model}
    assert r.set_headers["content-length"] == str(len(r.body))
    assert sorted(r.destination) == sorted(destination)


@pytest.mark.parametrize(
    "handoff",
    [
        {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "203.0.113.9", "remote_port": 1}},
        {"bootstrap_host": "203.0.113.9", "bootstrap_port": 1, "bootstrap_room": 7},
    ],
)
@pytest.mark.parametrize("rewrite", [None, OTHER])
def test_a_clients_handoff_fields_never_reach_an_engine(
    router: Router, handoff: dict[str, Any], rewrite: str | None
) -> None:
    """Only the gateway's disaggregation tells an engine where to fetch KV (extproc/disagg)."""
    payload = chat(temperature=0.5)
    extra = {MODEL_REWRITE: rewrite} if rewrite else None
    r = reply(route(processor(router), orjson.dumps({**orjson.loads(payload), **handoff}), extra=extra))
    assert orjson.loads(r.body) == {**orjson.loads(payload), "model": rewrite or MODEL}
    assert r.set_headers["content-length"] == str(len(r.body))


def test_a_body_without_handoff_fields_is_sent_as_it_came(router: Router) -> None:
    payload = chat(temperature=0.5) + b"  "  # not re-encoded: the bytes stay the client's
    assert reply(route(processor(router), payload)).body == payload


@pytest.mark.parametrize(
    ("conformance", "selection", "expected"),
    [
        (True, "10.0.0.2", ["10.0.0.2:8000"]),  # an ip pins every port on it
        (True, " 10.0.0.3:8000 , ,", ["10.0.0.3:8000"]),
        (True, "10.0.0.1:8000,10.0.0.3", ["10.0.0.1:8000", "10.0.0.3:8000"]),
        (True, "10.0.0.1:9999", 503),  # nothing eligible
        (True, ",", 503),  # an empty selection pins to nothing at all
        (False, "10.0.0.2", list(ADDRESSES)),  # the header is honoured only in conformance mode
    ],
)
def test_conformance_selection(router: Router, conformance: bool, selection: str, expected: Any) -> None:
    out = route(processor(router, conformance=conformance), chat(), extra={CONFORMANCE_HEADER: selection})
    if expected == 503:
        status, err, _ = error(out)
        assert (status, err["type"], err["code"]) == (503, "service_unavailable", "no_endpoint")
        return
    assert sorted(reply(out).destination) == expected


@pytest.mark.parametrize(
    ("hint", "expected"),
    [
        ({SUBSET_NS: {SUBSET_KEY: ["10.0.0.2:8000", ""]}}, ["10.0.0.2:8000"]),  # list form
        ({SUBSET_NS: {SUBSET_KEY: "10.0.0.1:8000, 10.0.0.3:8000,"}}, ["10.0.0.1:8000", "10.0.0.3:8000"]),
        ({SUBSET_NS: {SUBSET_KEY: [OTHER_ADDRESS, "10.0.0.2:8000"]}}, ["10.0.0.2:8000"]),
        ({SUBSET_NS: {SUBSET_KEY: []}}, 503),  # an empty subset: no endpoint, never "all"
        ({SUBSET_NS: {SUBSET_KEY: ""}}, 503),
        ({SUBSET_NS: {SUBSET_KEY: 7}}, 503),  # neither list nor string: empty
        ({SUBSET_NS: {SUBSET_KEY: [UNKNOWN_ADDRESS]}}, 503),
        ({SUBSET_NS: {"other-key": ["10.0.0.2:8000"]}}, list(ADDRESSES)),  # no hint
        ({"some.filter": {SUBSET_KEY: ["10.0.0.2:8000"]}}, list(ADDRESSES)),
        ({}, list(ADDRESSES)),
    ],
)
def test_subset_hint(router: Router, hint: dict[str, dict[str, Any]], expected: Any) -> None:
    out = route(processor(router), chat(), meta=metadata(**hint) if hint else None)
    if expected == 503:
        status, err, _ = error(out)
        assert (status, err["code"], err["message"]) == (
            503,
            "no_endpoint",
            f"No ready endpoint for model `{MODEL}`.",
        )
        assert in_flight(router) == {}
        return
    assert sorted(reply(out).destination) == expected


# --- the response path -----------------------------------------------------------------------------------


@pytest.mark.parametrize("conformance", [False, True])
@pytest.mark.parametrize(
    ("lb", "upstream", "value_form", "served"),
    [
        ("fallback", None, False, "fallback"),  # from envoy.lb metadata
        (None, "fallback", False, "fallback"),  # from the bundled route's header
        (None, "fallback", True, "fallback"),
        ("", "fallback", False, "fallback"),  # an empty metadata value falls back to the header
        ("absent", "fallback", False, "fallback"),  # envoy.lb without the served key: likewise
        ("pick", "fallback", False, "pick"),  # metadata wins
        ("pick", None, False, "pick"),
        (None, None, False, None),  # nothing reported: the pick stands
        (UNKNOWN_ADDRESS, None, False, UNKNOWN_ADDRESS),  # not in the fleet: the pick stands
    ],
)
def test_response_headers_read_the_served_endpoint(
    router: Router,
    conformance: bool,
    lb: str | None,
    upstream: str | None,
    value_form: bool,
    served: str | None,
) -> None:
    proc = processor(router, conformance=conformance)
    r = reply(route(proc, chat()))
    pick, fallback = r.destination[0], r.destination[1]
    names = {"pick": pick, "fallback": fallback}
    meta = None if lb is None else metadata(**{LB_NS: {SERVED: names.get(lb, lb)}})
    if lb == "absent":
        meta = metadata(**{LB_NS: {DESTINATION: r.set_headers[DESTINATION]}})
    extra = {"content-type": "application/json"}
    if upstream is not None:
        extra[UPSTREAM_HEADER] = names[upstream]
    (out,) = proc.handle(response_headers(extra=extra, meta=meta, value_form=value_form))
    assert out.WhichOneof("response") == "response_headers"
    mutation = out.response_headers.response.header_mutation
    assert list(mutation.remove_headers) == [UPSTREAM_HEADER]  # the client never sees it
    reported = names.get(served, served) if served else None
    echo = {CONFORMANCE_SERVED: reported} if conformance and reported else {}
    assert set_headers(mutation) == echo
    decision = proc.decision
    assert decision is not None and decision.served is not None
    moved = served == "fallback"
    assert decision.served.address == (fallback if moved else pick)
    assert in_flight(router) == {(fallback if moved else pick): 1}  # bookkeeping moved to the fallback
    assert decision.recorded == moved  # served() records where it really went
    proc.close()
    assert in_flight(router) == {}


def test_response_headers_without_a_decision(router: Router) -> None:
    proc = processor(router, conformance=True)
    models_listed(proc.handle(headers("/v1/models", "GET", end=True)))
    meta = metadata(**{LB_NS: {SERVED: ADDRESSES[0]}})
    (out,) = proc.handle(response_headers(extra={UPSTREAM_HEADER: ADDRESSES[0]}, meta=meta))
    mutation = out.response_headers.response.header_mutation
    assert (set_headers(mutation), list(mutation.remove_headers)) == ({}, [UPSTREAM_HEADER])
    assert in_flight(router) == {}


@pytest.mark.parametrize(
    ("msg", "expected"),
    [
        (response_body(b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}', True), "response_body"),
        (response_body(b"data: x\n\n", False), "response_body"),
        (pb.ProcessingRequest(response_trailers=pb.HttpTrailers()), "response_trailers"),
    ],
)
def test_response_body_and_trailers_pass_unchanged(
    router: Router, msg: pb.ProcessingRequest, expected: str
) -> None:
    proc = processor(router)
    route(proc, chat())
    (out,) = proc.handle(msg)
    assert out.WhichOneof("response") == expected
    assert out == pb.ProcessingResponse(**{expected: getattr(out, expected)})
    assert not out.HasField("dynamic_metadata")
    assert getattr(out, expected).ByteSize() == 0  # no mutation at all


# --- failures --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("before", [[], [headers()]])
def test_unset_message_is_a_bad_request(router: Router, before: list[pb.ProcessingRequest]) -> None:
    proc = processor(router)
    for msg in before:
        proc.handle(msg)
    status, err, _ = error(proc.handle(pb.ProcessingRequest()))
    assert (status, err["type"], err["message"]) == (
        400,
        "invalid_request_error",
        "Unexpected ext_proc message.",
    )


class BrokenRouter(Router):
    """Stands in only to make scheduling fail unexpectedly."""

    def decide(self, *args: Any, **kwargs: Any) -> Decision:
        raise RuntimeError("scorer blew up on 10.0.0.1:8000 with secret-state")


@pytest.mark.parametrize("gate", [False, True])
def test_unexpected_exception_is_a_generic_500(
    assets: ModelAssets, caplog: pytest.LogCaptureFixture, gate: bool
) -> None:
    g = make_gate() if gate else None
    proc = processor(make_router(assets, BrokenRouter), g)
    with caplog.at_level(logging.ERROR, logger="extproc.processor"):
        out = route(proc, chat(max_tokens=10), extra=ACME_KEY)
    status, err, _ = error(out)
    assert status == 500
    assert err == {
        "message": "The gateway failed to process the request.",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert b"secret" not in out[0].immediate_response.body
    assert b"blew" not in out[0].immediate_response.details.encode()
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.getMessage() == "request r1: internal error in ext_proc" and record.exc_info
    proc.close()
    if g is not None:  # a gateway fault costs the tenant nothing
        assert proc.ticket is not None and proc.ticket.charged == 0
        assert g.budgets.level(ACME, NOW) == 1000


# --- lifecycle -------------------------------------------------------------------------------------------


def test_after_send_commits_the_decision_once(router: Router) -> None:
    proc = processor(router)
    proc.after_send()  # nothing decided yet: nothing to do
    assert proc.handle(headers()) == []
    proc.after_send()
    r = reply(proc.handle(body(chat("hello " * 40))))
    decision = proc.decision
    assert decision is not None and not decision.recorded
    assert router.index.occupancy() == {}  # the reply goes out before the bookkeeping
    proc.after_send()
    pick = decision.endpoints[0]
    assert decision.recorded and pick.address == r.destination[0]
    assert router.index.occupancy() == {pick.id: len(decision.digests)}
    proc.after_send()
    assert router.index.occupancy() == {pick.id: len(decision.digests)}
    assert in_flight(router) == {pick.address: 1}  # committing is not finishing


def test_close_releases_in_flight_exactly_once(router: Router) -> None:
    pinned = {CONFORMANCE_HEADER: ADDRESSES[1]}
    first, second = processor(router, conformance=True), processor(router, conformance=True)
    reply(route(first, chat(), extra=pinned))
    reply(route(second, chat("other"), extra=pinned))
    assert in_flight(router) == {ADDRESSES[1]: 2}
    first.close()  # without after_send: close commits too
    assert first.decision is not None and first.decision.recorded and first.decision.finished
    first.close()
    assert in_flight(router) == {ADDRESSES[1]: 1}  # the second request's slot is untouched
    second.close()
    assert in_flight(router) == {}
    idle = processor(router)
    idle.close()  # no decision: nothing to release
    assert idle.handle(body(b"{}")) == []


# --- behind a Gateway API gateway: no completion log -----------------------------------------------------
#
# A third-party gateway using kvgate as its endpoint picker has no ``kvgate-completions`` access log: the
# ext_proc stream itself is all it sees of the response (its processing mode names the response phases).


def gateway_headers(
    response_mode: ProcessingMode.BodySendMode.ValueType | None = ProcessingMode.FULL_DUPLEX_STREAMED,
    request_id: str | None = "r1",
) -> pb.ProcessingRequest:
    """Request headers as a gateway sends them: FULL_DUPLEX_STREAMED request body, ``response_mode`` for
    the response body (``None``: no protocol configuration at all, as older Envoys send)."""
    msg = headers(extra={} if request_id is None else {"x-request-id": request_id})
    if request_id is None:
        kept = [h for h in msg.request_headers.headers.headers if h.key != "x-request-id"]
        del msg.request_headers.headers.headers[:]
        msg.request_headers.headers.headers.extend(kept)
    if response_mode is not None:
        msg.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
        msg.protocol_config.response_body_mode = response_mode
    return msg


def gateway_route(proc: StreamProcessor, payload: bytes, **kw: Any) -> Reply:
    assert proc.handle(gateway_headers(**kw)) == []
    return reply(proc.handle(body(payload)))


def outstanding(router: Router) -> dict[str, int]:
    return {s.address: s.outstanding for s in router.fleet if s.outstanding}


def completions(router: Router) -> dict[str, int]:
    return {s.address: s.completed_since_scrape for s in router.fleet if s.completed_since_scrape}


END_BY_BODY = [response_headers(), response_body(b'{"id": "x"}', False), response_body(b"", True)]
END_BY_TRAILERS = [
    response_headers(),
    response_body(b"data: x\n\n", False),
    pb.ProcessingRequest(response_trailers=pb.HttpTrailers()),
]
END_BY_HEADERS = [
    pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=header_map({":status": "204"}), end_of_stream=True)
    )
]


@pytest.mark.parametrize(
    ("mode", "ends"),
    [
        (ProcessingMode.FULL_DUPLEX_STREAMED, END_BY_BODY),
        (ProcessingMode.FULL_DUPLEX_STREAMED, END_BY_TRAILERS),
        (ProcessingMode.FULL_DUPLEX_STREAMED, END_BY_HEADERS),
        (ProcessingMode.STREAMED, END_BY_BODY),
        (ProcessingMode.BUFFERED, END_BY_BODY),
        (None, END_BY_BODY),  # no protocol configuration: the response's end still ends it
    ],
    ids=["full-duplex", "trailers", "headers-only", "streamed", "buffered", "unsaid"],
)
def test_the_response_end_seen_by_the_picker_completes_the_request(
    router: Router, mode: Any, ends: list[pb.ProcessingRequest]
) -> None:
    """The response's end crossing the ext_proc stream (its body's ``end_of_stream``, its trailers, or
    headers that end it) is the request's completion: the pick's outstanding count falls and the
    completion is counted, once, whatever comes after (the stream's end, a completion log entry)."""
    proc = processor(router)
    pick = gateway_route(proc, chat(), response_mode=mode).destination[0]
    assert outstanding(router) == {pick: 1}
    for msg in ends:
        proc.handle(msg)
    assert outstanding(router) == {} and completions(router) == {pick: 1}
    proc.close()
    assert router.completed("r1", NOW) is None  # a completion log entry after it: nothing more
    assert outstanding(router) == {} and completions(router) == {pick: 1} and in_flight(router) == {}


@pytest.mark.parametrize("mode", [ProcessingMode.FULL_DUPLEX_STREAMED, ProcessingMode.STREAMED])
def test_a_stream_ended_before_the_response_did_completes_the_request(router: Router, mode: Any) -> None:
    """With the response body sent to the picker, the ext_proc stream lasts as long as the response: its
    end before the response's end (the client left, the upstream reset) ends the request too."""
    proc = processor(router)
    pick = gateway_route(proc, chat(), response_mode=mode).destination[0]
    proc.handle(response_headers())
    proc.handle(response_body(b"data: x\n\n", False))
    assert outstanding(router) == {pick: 1}
    proc.close()
    assert outstanding(router) == {} and completions(router) == {pick: 1}


def test_a_completion_log_entry_first_counts_once(router: Router) -> None:
    """A gateway that also writes the completion log (the bundled Envoy reading usage from response
    bodies): whichever reports the end first counts it, the other nothing."""
    proc = processor(router)
    pick = gateway_route(proc, chat(), response_mode=ProcessingMode.STREAMED).destination[0]
    assert router.completed("r1", NOW) is not None
    for msg in END_BY_BODY:
        proc.handle(msg)
    proc.close()
    assert outstanding(router) == {} and completions(router) == {pick: 1}


@pytest.mark.parametrize("with_response_headers", [False, True])
def test_the_bundled_envoy_stream_end_is_no_completion(router: Router, with_response_headers: bool) -> None:
    """The bundled Envoy sends no response body (``response_body_mode: NONE``): its ext_proc stream ends
    right after routing (or the response headers) while the engine still answers, so only the completion
    log ends the request."""
    proc = processor(router)
    pick = gateway_route(proc, chat(), response_mode=ProcessingMode.NONE).destination[0]
    if with_response_headers:
        proc.handle(response_headers())
    proc.close()
    assert outstanding(router) == {pick: 1} and completions(router) == {}
    assert router.completed("r1", NOW) is not None
    assert outstanding(router) == {} and completions(router) == {pick: 1}


def test_requests_without_an_id_are_each_outstanding(router: Router) -> None:
    """Requests without ``x-request-id`` (logged as ``-``) are each their own request to the router: one's
    routing never takes another's outstanding slot, one's end never ends another."""
    procs = [processor(router, conformance=True) for _ in range(3)]
    for i, proc in enumerate(procs):
        msg = gateway_headers(request_id=None)  # pinned to one endpoint (the conformance selection)
        msg.request_headers.headers.headers.add(key=CONFORMANCE_HEADER, raw_value=ADDRESSES[1].encode())
        assert proc.handle(msg) == []
        reply(proc.handle(body(chat(f"question {i}"))))
        assert proc.request_id == "-"
    assert outstanding(router) == {ADDRESSES[1]: 3}
    assert router.completed("-", NOW) is None  # no completion log entry names them
    ids = [proc.decision.request_id for proc in procs if proc.decision is not None]
    assert len(set(ids)) == 3 and all(re.fullmatch("-[0-9a-f]{16}", i) for i in ids)
    assert router.completed(ids[0], NOW) is not None
    assert outstanding(router) == {ADDRESSES[1]: 2} and completions(router) == {ADDRESSES[1]: 1}


def test_two_streams_with_one_client_id_are_each_outstanding(router: Router) -> None:
    """A gateway that keeps the clients' ``x-request-id`` (the bundled Envoy replaces it): two streams
    sending the same id are still two requests to the router. The second's routing never takes the first's
    outstanding slot, and each one's end completes its own request at its own endpoint."""
    procs = [processor(router, conformance=True) for _ in range(2)]
    for i, (proc, address) in enumerate(zip(procs, ADDRESSES[:2], strict=True)):
        msg = gateway_headers(request_id="same")  # each pinned to its own endpoint
        msg.request_headers.headers.headers.add(key=CONFORMANCE_HEADER, raw_value=address.encode())
        assert proc.handle(msg) == []
        assert reply(proc.handle(body(chat(f"question {i}")))).destination[0] == address
        assert proc.request_id == "same"  # logged as sent
    assert outstanding(router) == {ADDRESSES[0]: 1, ADDRESSES[1]: 1}
    for msg in END_BY_BODY:
        procs[0].handle(msg)
    procs[0].close()
    assert outstanding(router) == {ADDRESSES[1]: 1} and completions(router) == {ADDRESSES[0]: 1}
    for msg in END_BY_BODY:
        procs[1].handle(msg)
    procs[1].close()
    assert outstanding(router) == {} and completions(router) == {ADDRESSES[0]: 1, ADDRESSES[1]: 1}


@pytest.mark.parametrize(
    ("mode", "echoed"),
    [
        (ProcessingMode.FULL_DUPLEX_STREAMED, True),
        (ProcessingMode.STREAMED, False),
        (ProcessingMode.BUFFERED, False),
        (None, False),
    ],
)
def test_a_full_duplex_response_body_is_streamed_back(router: Router, mode: Any, echoed: bool) -> None:
    """In FULL_DUPLEX_STREAMED response body mode the gateway forwards only what the picker sends back:
    each chunk is returned as it came (``streamed_response``, ``end_of_stream`` as sent). Other modes
    keep the body themselves: the answer is an empty BodyResponse."""
    proc = processor(router)
    gateway_route(proc, chat(), response_mode=mode)
    proc.handle(response_headers())
    sent = [(b'data: {"a": 1}\n\n', False), (b"data: [DONE]\n\n", False), (b"", True)]
    for chunk, end in sent:
        (out,) = proc.handle(response_body(chunk, end))
        assert out.WhichOneof("response") == "response_body"
        if echoed:
            streamed = out.response_body.response.body_mutation.streamed_response
            assert (streamed.body, streamed.end_of_stream) == (chunk, end)
        else:
            assert out == pb.ProcessingResponse(response_body=pb.BodyResponse())


@pytest.mark.parametrize("end", [True, False])
def test_a_large_full_duplex_response_chunk_goes_back_in_chunks(router: Router, end: bool) -> None:
    """A chunk larger than 62,000 bytes goes back as the request body does: in chunks of at most that,
    whole and in order, ``end_of_stream`` (as sent) on the last only."""
    proc = processor(router)
    gateway_route(proc, chat())
    proc.handle(response_headers())
    data = bytes(range(256)) * 500  # 128,000 bytes
    out = proc.handle(response_body(data, end))
    streamed = [r.response_body.response.body_mutation.streamed_response for r in out]
    assert [len(s.body) for s in streamed] == [MAX_CHUNK, MAX_CHUNK, len(data) - 2 * MAX_CHUNK]
    assert b"".join(s.body for s in streamed) == data
    assert [s.end_of_stream for s in streamed] == [False, False, end]


# --- with a gate -----------------------------------------------------------------------------------------


TOKEN = "Bearer eyJ.x.y"  # what jwt_authn failed to verify
BAD_TOKEN = ("invalid_token", "The bearer token was rejected: ")


@pytest.mark.parametrize(
    ("authorization", "meta", "expected"),
    [
        (f"Bearer {KEY}", None, "acme"),
        (None, jwt({"sub": "svc", "tenant": "acme"}), "acme"),
        ("Bearer garbage", jwt({"sub": "u", "groups": ["wide"]}), "wide"),  # verified claims win
        (None, None, (401, "missing_credentials", "Missing credentials")),
        (None, jwt(), (401, "missing_credentials", "Missing credentials")),  # namespace, nothing in it
        (None, jwt("not-a-struct"), (401, "invalid_identity", "The identity metadata is not")),
        ("Basic dXNlcjpwYXNz", None, (401, "missing_credentials", "Missing credentials")),
        (f"Bearer {STRANGER}", None, (401, "invalid_api_key", "Incorrect API key provided.")),
        (TOKEN, jwt(status={"code": 16, "message": "Jwt is expired"}), (401, *BAD_TOKEN, "Jwt is expired.")),
        (TOKEN, jwt(status={"code": 16}), (401, *BAD_TOKEN, "not a valid token.")),  # no reason given
        (TOKEN, jwt(status="failed"), (401, "invalid_identity", "The identity metadata is not")),
        (None, jwt({"tenant": "nobody"}), (403, "no_tenant", "No tenant is configured for this identity.")),
        (f"Bearer {ORPHAN}", None, (403, "no_tenant", "The API key's tenant is not configured.")),
    ],
)
def test_identification_at_the_request_headers(
    router: Router, authorization: str | None, meta: Metadata | None, expected: Any
) -> None:
    extra = {"authorization": authorization} if authorization else {}
    proc = processor(router, make_gate())
    out = proc.handle(headers(extra=extra, meta=meta))
    if isinstance(expected, tuple):
        status, err, _ = error(out)  # before any body is buffered
        assert (status, err["code"]) == expected[:2] and err["message"].startswith("".join(expected[2:]))
        assert KEY not in err["message"] and "garbage" not in err["message"]
        assert proc.handle(body(chat())) == [] and proc.decision is None
        return
    assert out == []
    assert proc.principal is not None and proc.principal.tenant.id == expected
    r = reply(proc.handle(body(chat())))
    assert r.set_headers[TENANT_HEADER] == expected
    assert r.remove_headers == ["authorization"]  # engines never see the credential
    assert proc.ticket is not None and proc.ticket.tenant.id == expected


@pytest.mark.parametrize(
    "fields",
    [
        {"jwt_payload": {**VERIFIED, "tenant": "acme"}, "jwt_status": {"code": 16}},  # never both
        {"jwt_payload": {**VERIFIED, "tenant": "acme"}, "tenant": "acme"},  # a field jwt_authn never sets
        {"claims": {**VERIFIED, "tenant": "acme"}},
        {"jwt_payload": {"iss": "https://evil", "aud": "kvgate", "tenant": "acme"}},
    ],
)
def test_identity_metadata_of_any_other_shape_is_refused(router: Router, fields: dict[str, Any]) -> None:
    proc = processor(router, make_gate())
    status, err, _ = error(
        proc.handle(headers(extra={"authorization": f"Bearer {KEY}"}, meta=metadata(**{JWT_NS: fields})))
    )
    assert (status, err["code"]) == (401, "invalid_identity")
    assert proc.principal is None and proc.handle(body(chat())) == []


def with_address(request: pb.ProcessingRequest, address: str) -> pb.ProcessingRequest:
    """``request`` with the ``source.address`` attribute Envoy sends when asked (kvgate's auth config)."""
    attributes = Struct()
    attributes.update({"source.address": address})
    request.attributes["envoy.filters.http.ext_proc"].CopyFrom(attributes)
    return request


@pytest.mark.parametrize("peer", ["203.0.113.7:40112", "[2001:db8::7]:40112"])
def test_failed_attempts_are_limited_per_address_envoy_saw(router: Router, peer: str) -> None:
    gate = make_gate()
    burst = gate.config.failed_auth.burst
    bad = {"authorization": "Bearer sk-kvg-guess"}
    for _ in range(burst):
        status, err, _ = error(processor(router, gate).handle(with_address(headers(extra=bad), peer)))
        assert (status, err["code"]) == (401, "invalid_api_key")
    # the next attempt from that address, even with a good key, waits; the port does not matter
    retry_port = peer.rsplit(":", 1)[0] + ":1"
    status, err, hs = error(processor(router, gate).handle(with_address(headers(extra=ACME_KEY), retry_port)))
    assert (status, err["type"], err["code"]) == (429, "rate_limit_error", "auth_attempts_exceeded")
    assert hs["retry-after"] == "1" and KEY not in err["message"]
    # another client is not affected
    assert processor(router, gate).handle(with_address(headers(extra=ACME_KEY), "198.51.100.2:5")) == []


def test_token_budget_429_carries_retry_after(router: Router) -> None:
    gate = make_gate()
    first = processor(router, gate)
    reply(route(first, chat(max_tokens=900), extra=ACME_KEY))
    assert first.ticket is not None
    left = 1000 - first.ticket.reserved
    second = processor(router, gate)
    status, err, hs = error(route(second, chat(max_tokens=100), extra=ACME_KEY))
    assert (status, err["type"], err["code"]) == (429, "rate_limit_error", "tokens_exceeded")
    needed = first.ticket.prompt + 100
    assert hs == {"content-type": "application/json", "retry-after": str(-(-(needed - left) // 10))}
    assert f"retry after {hs['retry-after']}s" in err["message"]
    assert second.ticket is None and sum(in_flight(router).values()) == 1


@pytest.mark.parametrize(
    ("extra", "payload", "meta", "expected"),
    [
        # refused at admission: nothing reserved
        (ACME_KEY, chat(max_tokens=5000), None, (429, "request_too_large", False)),
        (ACME_KEY, chat(model=OTHER), None, (403, "model_not_allowed", False)),
        # the scope applies to the model after the rewrite
        ({**ACME_KEY, MODEL_REWRITE: OTHER}, chat(), None, (403, "model_not_allowed", False)),
        # admitted, then refused by routing: the reservation is refunded
        (ACME_KEY, chat(model="smol-ghost"), None, (404, "model_not_found", True)),
        (ACME_KEY, chat(), metadata(**{SUBSET_NS: {SUBSET_KEY: []}}), (503, "no_endpoint", True)),
    ],
)
def test_admission_refusals_cost_nothing(
    router: Router, extra: dict[str, str], payload: bytes, meta: Metadata | None, expected: Any
) -> None:
    gate = make_gate()
    proc = processor(router, gate)
    status, err, hs = error(route(proc, payload, extra=extra, meta=meta))
    assert (status, err["code"]) == expected[:2]
    assert "retry-after" not in hs
    admitted = expected[2]
    assert (proc.ticket is not None) == admitted
    proc.close()
    if proc.ticket is not None:
        assert proc.ticket.settled and proc.ticket.charged == 0
    assert gate.budgets.level(ACME, NOW) == 1000
    assert in_flight(router) == {}


@pytest.mark.parametrize("how", ["undelivered", "answered_here", "delivered"])
def test_a_request_no_engine_got_is_refunded_at_close(router: Router, how: str) -> None:
    """Decided, then never sent (the shell's finally marks it undelivered: the client left during a
    restore, a prefill half or a step) or answered by the gateway after decide: no engine ran it, so
    close refunds the whole reservation instead of charging it. A sent request without usage is charged
    its reservation as before; a ticket closed either way is never charged or refunded again."""
    gate = make_gate()
    proc = processor(router, gate)
    if how == "answered_here":

        def fail(*args: Any, **kw: Any) -> Any:
            raise Unavailable("a failure after decide", code="test")

        proc._replies = fail  # type: ignore[method-assign]
        status, err, _ = error(route(proc, chat(max_tokens=50), extra=ACME_KEY))
        assert (status, err["code"]) == (503, "test")
    else:
        reply(route(proc, chat(max_tokens=50), extra=ACME_KEY))
    ticket = proc.ticket
    assert ticket is not None and proc.decision is not None and not ticket.settled
    assert gate.budgets.level(ACME, NOW) == 1000 - ticket.reserved
    if how == "undelivered":
        proc.undelivered = True  # the shell's finally
    proc.close()
    expected = ticket.reserved if how == "delivered" else 0
    assert ticket.settled and ticket.charged == expected
    assert gate.budgets.level(ACME, NOW) == 1000 - expected
    assert gate.budgets.charged == {"acme": expected}
    gate.settle(ticket, Usage(5, 5, True), NOW)  # settled once: no second charge
    gate.cancel(ticket, NOW)  # nor a refund
    assert ticket.charged == expected and gate.budgets.level(ACME, NOW) == 1000 - expected
    if how != "delivered":
        assert in_flight(router) == {}


@pytest.mark.parametrize("status", ["500", "503", "429", "404", ""])
def test_a_failed_response_refunds_the_reservation(router: Router, status: str) -> None:
    gate = make_gate()
    proc = processor(router, gate)
    reply(route(proc, chat(max_tokens=50), extra=ACME_KEY))
    assert proc.ticket is not None
    assert gate.budgets.level(ACME, NOW) == 1000 - proc.ticket.reserved
    proc.handle(response_headers(status, {"content-type": "application/json"}))
    assert proc.ticket.settled and proc.ticket.charged == 0
    proc.handle(response_body(b'{"usage": {"prompt_tokens": 5, "completion_tokens": 5}}', True))
    proc.close()
    assert proc.ticket.charged == 0 and gate.budgets.level(ACME, NOW) == 1000


@pytest.mark.parametrize(
    ("settle", "response", "chunks", "charged", "at_body_end"),
    [
        (
            Settle.USAGE,
            {"content-type": "application/json"},
            [b'{"id": "x", "usage": {"prompt_tokens": 7,', b' "completion_tokens": 3}}'],
            lambda t: 10,
            True,
        ),
        (
            Settle.USAGE,
            {"content-type": "text/event-stream; charset=utf-8"},
            [
                b'data: {"choices": []}\n\n',
                b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}}\n\n',
                b"data: [DONE]\n\n",
            ],
            lambda t: 11,
            True,
        ),
        (  # no usage event: one output token per event, estimated
            Settle.USAGE,
            {"content-type": "text/event-stream"},
            [b'data: {"a": 1}\n\ndata: {"a": 2}\n\n', b"data: [DONE]\n\n"],
            lambda t: t.prompt + 2,
            True,
        ),
        (  # JSON without usage: the reservation stands
            Settle.USAGE,
            {"content-type": "application/json"},
            [b'{"id": "x"}'],
            lambda t: t.reserved,
            True,
        ),
        (  # compressed: not read, the reservation is charged at the stream's end
            Settle.USAGE,
            {"content-type": "application/json", "content-encoding": "gzip"},
            [b'{"usage": {"prompt_tokens": 7, "completion_tokens": 3}}'],
            lambda t: t.reserved,
            False,
        ),
        (
            Settle.RESERVATION,
            {"content-type": "application/json"},
            [b'{"usage": {"prompt_tokens": 7, "completion_tokens": 3}}'],
            lambda t: t.reserved,
            False,
        ),
    ],
    ids=["json", "sse-usage", "sse-estimate", "json-no-usage", "gzip", "reservation-mode"],
)
def test_usage_is_settled_once(
    router: Router,
    settle: Settle,
    response: dict[str, str],
    chunks: list[bytes],
    charged: Callable[[Ticket], int],
    at_body_end: bool,
) -> None:
    gate = make_gate(settle)
    proc = processor(router, gate)
    reply(route(proc, chat(max_tokens=50), extra=ACME_KEY))
    proc.after_send()
    ticket = proc.ticket
    assert ticket is not None and ticket.reserved == ticket.prompt + 50
    assert proc.handle(response_headers("200", response))[0].WhichOneof("response") == "response_headers"
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        assert proc.handle(response_body(chunk, last)) == [
            pb.ProcessingResponse(response_body=pb.BodyResponse())
        ]
        assert ticket.settled == (last and at_body_end)
    expected = charged(ticket)
    proc.handle(response_body(b'{"usage": {"prompt_tokens": 900, "completion_tokens": 900}}', True))  # late
    proc.close()
    proc.close()
    assert ticket.settled and ticket.charged == expected
    assert gate.budgets.level(ACME, NOW) == 1000 - expected


def test_tenant_without_a_budget_is_never_read(router: Router) -> None:
    gate = make_gate()
    proc = processor(router, gate)
    reply(route(proc, chat(), meta=jwt({"sub": "u", "groups": ["wide"]})))
    proc.handle(response_headers("200", {"content-type": "application/json"}))
    proc.handle(response_body(b'{"usage": {"prompt_tokens": 7, "completion_tokens": 3}}', True))
    ticket = proc.ticket
    assert ticket is not None and not ticket.settled  # nothing to read: settled at the end
    proc.close()
    assert ticket.settled and ticket.charged == ticket.reserved and gate.budgets.level(WIDE, NOW) is None


# --- preparing a large body off the event loop -----------------------------------------------------------

OFFLOAD = 32 * 1024


@pytest.mark.parametrize(
    ("path", "messages", "expected"),
    [
        (CHAT, [body(chat("x" * OFFLOAD))], True),  # ends a body at least offload_bytes long
        (CHAT, [body(chat("x" * OFFLOAD), end=False), body(b"")], True),  # the size counts every chunk
        (CHAT, [body(b"x" * OFFLOAD, end=False), trailers()], True),  # trailers end it too
        (CHAT, [body(chat("x" * 100))], False),  # small: not worth a thread hop
        (CHAT, [body(chat("x" * OFFLOAD), end=False)], False),  # not the end of the body
        (CHAT, [body(sized(LIMIT + 1))], False),  # over the limit: 413 on the loop, nothing parsed
        ("/v1/models", [body(chat("x" * OFFLOAD))], False),  # not routed: answered without parsing
    ],
)
def test_preparable_only_for_the_end_of_a_large_routed_body(
    router: Router, path: str, messages: list[pb.ProcessingRequest], expected: bool
) -> None:
    proc = processor(router)
    proc.handle(headers(path))
    *before, last = messages
    for msg in before:
        assert not proc.preparable(msg)
        proc.handle(msg)
    assert proc.preparable(last) is expected


def test_preparable_never_without_an_offload_size(router: Router) -> None:
    proc = StreamProcessor(router, ProcessorConfig(max_body_bytes=LIMIT, offload_bytes=None), clock)
    proc.handle(headers())
    assert not proc.preparable(body(chat("x" * OFFLOAD)))


def test_prepared_body_routes_as_if_handled_at_once(assets: ModelAssets) -> None:
    """prepare() then handle() answers exactly as handle() alone (on an identical router), and the
    decision's time counts the preparation."""
    payload = chat("hello " * 8000, max_tokens=7)
    inline = make_router(assets)
    expected = reply(route(processor(inline), payload))
    ticks = iter(range(100))
    prepared_router = make_router(assets)
    proc = StreamProcessor(prepared_router, ProcessorConfig(max_body_bytes=LIMIT), lambda: next(ticks) / 1000)
    proc.handle(headers())
    last = body(payload)
    assert proc.preparable(last)
    proc.prepare(last)
    got = reply(proc.handle(last))
    assert (got.set_headers, got.lb, got.chunks) == (expected.set_headers, expected.lb, expected.chunks)
    assert got.decision["decision_us"] >= 2000  # the clock's ticks inside prepare() are counted
    assert in_flight(prepared_router) == in_flight(inline)


# --- settling the rest of a lazy prompt off the event loop -------------------------------------------------


def prose(rng: random.Random, words: int) -> str:
    """``words`` words never seen before (the prompt's blocks are held by nobody)."""
    return " ".join(f"w{rng.getrandbits(32):x}" for _ in range(words))


def conversation(seed: int) -> list[bytes]:
    """A chat's three turns, each body well under ``offload_bytes`` (~2-6 KB) with thousands of characters
    left to tokenize after the first unheld block: a first turn, then two follow-ups (reply + message)."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": prose(rng, 40)}, {"role": "user", "content": prose(rng, 300)}]
    turns = [orjson.dumps({"model": MODEL, "messages": messages})]
    for _ in range(2):
        messages += [
            {"role": "assistant", "content": prose(rng, 200)},
            {"role": "user", "content": prose(rng, 100)},
        ]
        turns.append(orjson.dumps({"model": MODEL, "messages": messages}))
    assert all(len(t) < OFFLOAD for t in turns)
    return turns


def test_the_rest_is_settled_off_the_loop_by_the_characters_left(router: Router) -> None:
    """``settles_off_loop``: a decided, unrecorded lazy prompt with at least ``offload_rest_chars``
    characters left to tokenize, whatever its body size; never once recorded, or with no threshold."""
    first = conversation(1)[0]

    def decided(limit: int | None, payload: bytes = first) -> StreamProcessor:
        proc = StreamProcessor(router, ProcessorConfig(max_body_bytes=LIMIT, offload_rest_chars=limit), clock)
        reply(route(proc, payload))
        return proc

    proc = decided(0)
    rest = proc.decision.rest if proc.decision is not None else None
    assert rest is not None and rest.chars_left > 1000  # a small body with much left to tokenize
    left = rest.chars_left
    assert decided(left).settles_off_loop() and not decided(left + 1).settles_off_loop()
    assert not decided(None).settles_off_loop()
    small = decided(1024, chat("hello"))  # the default threshold: a short prompt's rest stays on the loop
    assert small.decision is not None and not small.settles_off_loop()
    proc = decided(0)
    proc.after_send()  # recorded on the loop: nothing left to settle
    assert not proc.settles_off_loop()


def test_a_rest_settled_in_a_thread_is_recorded_as_on_the_loop(assets: ModelAssets) -> None:
    """The same chats through two identical routers, one settling every rest in a worker thread (as the
    shell does before ``after_send``), the other on the caller's thread: the same decisions, the same
    index records and the same history memo states, so the follow-ups resume alike."""

    def play(offload: int | None) -> tuple[list[Any], Router, list[str]]:
        router = make_router(assets)
        assets.tokenizer.clear_cache()  # each router starts from the same segment cache
        settled_in: list[str] = []
        outcomes: list[Any] = []
        for seed in (1, 2):
            for payload in conversation(seed):
                proc = StreamProcessor(
                    router, ProcessorConfig(max_body_bytes=LIMIT, offload_rest_chars=offload), clock
                )
                reply(route(proc, payload))
                decision = proc.decision
                assert decision is not None
                if proc.settles_off_loop():
                    assert decision.rest is not None
                    worker = threading.Thread(target=decision.rest.settle, name="settle-worker")
                    worker.start()
                    worker.join(30)
                    settled_in.append(worker.name)
                proc.after_send()
                assert decision.recorded and decision.rest is None
                outcomes.append(
                    (
                        [e.id for e in decision.endpoints],
                        decision.matched_blocks,
                        decision.prompt_tokens,
                        list(decision.digests),
                        router.index.match(decision.digests, NOW),
                    )
                )
                proc.close()
        return outcomes, router, settled_in

    threaded, t_router, t_settled = play(0)
    on_loop, l_router, l_settled = play(None)
    assert len(t_settled) >= 2 and not l_settled  # every first turn at least went through the thread
    assert threaded == on_loop
    assert t_router.index.occupancy() == l_router.index.occupancy()

    def memo(router: Router) -> list[Any]:
        states = router.history._states.values()
        return [
            (s.pieces, list(s.ids), list(s.marks), s.chars, s.specials, s.digests, s.text, s.checked)
            for s in states
        ]

    assert memo(t_router) == memo(l_router) and memo(t_router)
    t_memo, l_memo = t_router.history, l_router.history
    assert (t_memo.hits, t_memo.misses) == (l_memo.hits, l_memo.misses)
    assert t_memo.hits >= 2  # the follow-ups resumed from the memo


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        (b'{"model": "' + b"x" * OFFLOAD + b"", 400, None),  # not JSON
        (chat("x" * OFFLOAD, model="nope"), 404, "model_not_found"),
        (chat("hello " * 9000), 400, "context_length_exceeded"),  # 9000+ tokens: over SmolLM2's 8192
    ],
)
def test_an_error_met_while_preparing_is_the_answer(
    model_dir: str, payload: bytes, status: int, code: str | None
) -> None:
    router = make_router(ModelAssets.load(MODEL, Path(model_dir)))  # SmolLM2's own 8192-token context
    proc = processor(router)
    proc.handle(headers())
    last = body(payload)
    assert proc.preparable(last)
    proc.prepare(last)
    got_status, err, _ = error(proc.handle(last))
    assert (got_status, err["code"]) == (status, code)
    assert in_flight(router) == {}
