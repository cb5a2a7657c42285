"""Fuzzing the ext_proc through its real gRPC server (issue 24 part 3): an in-process :class:`Gateway`
(SmolLM2's template and tokenizer, four endpoints, the admission gate off) on 127.0.0.1, and a real gRPC
channel carrying what Envoy would: request headers for any routed path (or any path, any method), then
the fuzzed body in one or several chunks, sometimes large enough to be parsed off the event loop; and
streams whose messages come in any order.

Property: every stream ends normally (never a gRPC error) after well-formed ProcessingResponses; a
routed request gets either a decision (headers, then its body streamed back) or an ImmediateResponse
with an OpenAI-style JSON error of a 4xx (or 503), never the 500 of an escaped exception.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from hypothesis import example, given
from hypothesis import strategies as st

from extproc.config import parse_config
from extproc.server import Gateway
from tests.fuzz.strategies import FUZZ, ROUTED, mutated_body

MODEL = "SmolLM2-135M-Instruct"
CLIENT_STATUSES = {400, 401, 403, 404, 405, 413, 429, 503}
#: Bodies from this size on are parsed off the event loop (ProcessorConfig.offload_bytes' default).
OFFLOAD_BYTES = 32 * 1024


class _Server:
    """A Gateway on an event loop of its own thread, so that Hypothesis drives it from a plain test."""

    def __init__(self, model_dir: str) -> None:
        config = parse_config(
            {
                "extproc": {
                    "listen": "127.0.0.1:0",
                    "health_listen": "127.0.0.1:0",
                    "metrics_listen": "",
                    "max_body_bytes": 1024 * 1024,
                },
                "models": [{"name": MODEL, "model_dir": model_dir, "max_model_len": 1 << 20}],
                "endpoints": [
                    {"id": f"e{i}", "address": f"127.0.0.{i + 1}:8000", "models": [MODEL]} for i in range(4)
                ],
            }
        )
        self.gateway = Gateway(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="extproc-fuzz", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.gateway.start(), self.loop).result(60)
        self.port = self.gateway.ports["extproc"]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.gateway.aclose(grace_s=0), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture(scope="module")
def stub(model_dir: str) -> Iterator[pb_grpc.ExternalProcessorStub]:
    server = _Server(model_dir)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.ExternalProcessorStub(channel)
    server.close()


def _headers(path: str, method: str = "POST", end: bool = False) -> pb.ProcessingRequest:
    hs = {":path": path, ":method": method, "x-request-id": "fuzz", "content-type": "application/json"}
    header_map = HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map, end_of_stream=end))


def _body(chunk: bytes, end: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=end))


def _exchange(
    stub: pb_grpc.ExternalProcessorStub, msgs: list[pb.ProcessingRequest]
) -> list[pb.ProcessingResponse]:
    try:
        return list(stub.Process(iter(msgs), timeout=60))
    except grpc.RpcError as exc:  # the property: never
        raise AssertionError(f"the ext_proc stream failed: {exc.code()} {exc.details()}") from exc


def _check(resps: list[pb.ProcessingResponse], body: bytes) -> None:
    assert resps, "no response at all"
    first = resps[0]
    kind = first.WhichOneof("response")
    if kind == "immediate_response":
        assert len(resps) == 1
        imm = first.immediate_response
        assert imm.status.code in CLIENT_STATUSES, (imm.status.code, imm.body[:300])
        ctype = {h.header.key: h.header.raw_value for h in imm.headers.set_headers}["content-type"]
        assert ctype == b"application/json"
        error = orjson.loads(imm.body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        return
    assert kind == "request_headers", first
    streamed = [r.request_body.response.body_mutation.streamed_response for r in resps[1:]]
    assert b"".join(s.body for s in streamed) == body
    assert [s.end_of_stream for s in streamed][-1:] == [True]


cases = st.sampled_from(ROUTED).flatmap(lambda path: st.tuples(st.just(path), mutated_body(path, MODEL)))


@FUZZ
@given(
    case=cases,
    chunks=st.integers(1, 4),
    large=st.integers(0, 9).map(lambda n: n == 0),
)
@example(case=("/v1/completions", {"model": MODEL, "prompt": [2**32] * 40}), chunks=1, large=False)
@example(case=("/v1/completions", {"model": MODEL, "prompt": [2**32] * 40}), chunks=2, large=True)
def test_fuzzed_bodies_over_grpc(
    stub: pb_grpc.ExternalProcessorStub, case: tuple[str, dict[str, Any]], chunks: int, large: bool
) -> None:
    path, doc = case
    if large:  # parsed, rendered and tokenized off the event loop (StreamProcessor.prepare)
        doc = {**doc, "user": "x" * OFFLOAD_BYTES}
    body = orjson.dumps(doc)
    size = -(-len(body) // chunks)
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    msgs = [_headers(path), *(_body(p, i == len(parts) - 1) for i, p in enumerate(parts))]
    _check(_exchange(stub, msgs), body)


@FUZZ
@given(
    raw=st.binary(max_size=300), path=st.sampled_from(ROUTED) | st.text(max_size=12).map(lambda s: "/" + s)
)
def test_any_bytes_any_path_over_grpc(stub: pb_grpc.ExternalProcessorStub, raw: bytes, path: str) -> None:
    resps = _exchange(stub, [_headers(path), _body(raw, True)])
    assert resps
    for resp in resps:
        assert resp.WhichOneof("response") is not None


messages = st.lists(
    st.one_of(
        st.builds(_headers, st.sampled_from(ROUTED), st.sampled_from(["POST", "GET"]), st.booleans()),
        st.builds(_body, st.binary(max_size=40) | st.just(b'{"model": "x"}'), st.booleans()),
        st.just(pb.ProcessingRequest(request_trailers=pb.HttpTrailers())),
        st.just(pb.ProcessingRequest(response_headers=pb.HttpHeaders())),
        st.builds(
            lambda data, end: pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end)),
            st.binary(max_size=20),
            st.booleans(),
        ),
        st.just(pb.ProcessingRequest(response_trailers=pb.HttpTrailers())),
    ),
    max_size=6,
)


@FUZZ
@given(msgs=messages)
def test_messages_in_any_order_over_grpc(
    stub: pb_grpc.ExternalProcessorStub, msgs: list[pb.ProcessingRequest]
) -> None:
    for resp in _exchange(stub, msgs):
        assert resp.WhichOneof("response") is not None
