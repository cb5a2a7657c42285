"""Authentication in the ext_proc stream over real gRPC, with the metadata Envoy's jwt_authn forwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct

from extproc.admission.keys import ApiKey, hash_key, new_key, write_keys
from extproc.config import parse_config
from extproc.server import Gateway
from tests.extproc.test_server import (
    ADDRESSES,
    MODEL,
    body_msgs,
    chat_body,
    decision,
    error_of,
    headers_msg,
    run,
)

KEY = new_key()


@pytest.fixture
async def gateway(model_dir: str, tmp_path: Path) -> AsyncIterator[Gateway]:
    keys = tmp_path / "keys.json"
    write_keys(keys, [ApiKey("k1", "acme", hash_key(KEY), 1)])
    config = parse_config(
        {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            "models": [{"name": MODEL, "model_dir": model_dir}],
            "endpoints": [{"id": f"e{i}", "address": a, "models": [MODEL]} for i, a in enumerate(ADDRESSES)]
            + [{"id": "other", "address": "127.0.0.9:8000", "models": ["other-model"]}],
            "auth": {
                "jwt": {"issuer": "https://idp", "audiences": ["kvgate"], "jwks_uri": "https://idp/jwks"},
                "api_keys_file": str(keys),
                "default_max_tokens": 100,
                "settle": "usage",
            },
            "tenants": [
                {
                    "id": "acme",
                    "models": ["SmolLM2-*"],
                    "match": {"claims": {"tenant": "acme"}},
                    "tokens": {"per_minute": 6000, "burst": 1000},
                },
                {"id": "wide", "models": ["*"], "match": {"groups": ["wide"]}},
            ],
        }
    )
    gw = Gateway(config)
    await gw.start()
    yield gw
    await gw.aclose(grace_s=0)


def jwt_metadata(claims: dict[str, Any] | None = None, failure: str | None = None) -> Metadata:
    ns = Struct()
    if claims is not None:  # jwt_authn verified iss and aud: a payload always carries ours
        ns.update({"jwt_payload": {"iss": "https://idp", "aud": "kvgate", **claims}})
    if failure is not None:
        ns.update({"jwt_status": {"code": 16, "message": failure}})
    return Metadata(filter_metadata={"envoy.filters.http.jwt_authn": ns})


ACME_JWT = jwt_metadata({"iss": "https://idp", "sub": "svc", "tenant": "acme", "exp": 2e9})


def mutation(resps: list[pb.ProcessingResponse]) -> tuple[dict[str, HeaderValueOption], list[str]]:
    m = resps[0].request_headers.response.header_mutation
    return {h.header.key: h for h in m.set_headers}, list(m.remove_headers)


async def test_verified_jwt_routes_and_sets_tenant(gateway: Gateway) -> None:
    msgs = [
        headers_msg(
            "/v1/chat/completions",
            extra={"authorization": "Bearer a.b.c", "x-kvgate-tenant": "wide"},  # a client-sent tenant
            metadata=ACME_JWT,
        ),
        *body_msgs(chat_body("hello")),
    ]
    resps = await run(gateway, msgs)
    decision(resps)
    set_headers, removed = mutation(resps)
    tenant = set_headers["x-kvgate-tenant"]
    assert tenant.header.raw_value == b"acme"  # overwritten with the verified tenant
    assert tenant.append_action == HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert removed == ["authorization"]  # engines never see the credential


async def test_api_key_routes(gateway: Gateway) -> None:
    msgs = [
        headers_msg("/v1/chat/completions", extra={"authorization": f"Bearer {KEY}"}),
        *body_msgs(chat_body("hi")),
    ]
    set_headers, _ = mutation(await run(gateway, msgs))
    assert set_headers["x-kvgate-tenant"].header.raw_value == b"acme"


@pytest.mark.parametrize(
    ("extra", "metadata", "status", "code"),
    [
        ({}, None, 401, "missing_credentials"),
        ({"x-kvgate-tenant": "acme"}, None, 401, "missing_credentials"),  # a header alone is nothing
        ({"authorization": "Bearer sk-kvg-nope"}, None, 401, "invalid_api_key"),
        ({"authorization": "Bearer a.b.c"}, jwt_metadata(failure="Jwt is expired"), 401, "invalid_token"),
        ({}, jwt_metadata({"tenant": "unknown"}), 403, "no_tenant"),
    ],
)
async def test_refused_at_the_headers(
    gateway: Gateway, extra: dict[str, str], metadata: Metadata | None, status: int, code: str
) -> None:
    # Answered at the request headers: the body is never buffered for an unauthenticated client.
    got, err = error_of(
        await run(gateway, [headers_msg("/v1/chat/completions", extra=extra, metadata=metadata)])
    )
    assert (got, err["error"]["code"]) == (status, code)
    assert err["error"]["type"] == ("invalid_request_error" if status == 401 else "permission_error")


async def test_model_outside_scope_is_403(gateway: Gateway) -> None:
    msgs = [
        headers_msg("/v1/chat/completions", metadata=ACME_JWT),
        *body_msgs(chat_body("hi", model="other-model")),
    ]
    status, err = error_of(await run(gateway, msgs))
    assert status == 403 and err["error"]["type"] == "permission_error" and err["error"]["param"] == "model"
    # The model rewrite header cannot be used to escape the scope either.
    msgs = [
        headers_msg(
            "/v1/chat/completions", extra={"x-gateway-model-name-rewrite": "other-model"}, metadata=ACME_JWT
        ),
        *body_msgs(chat_body("hi")),
    ]
    assert error_of(await run(gateway, msgs))[0] == 403


async def test_models_list_is_scoped(gateway: Gateway) -> None:
    resps = await run(gateway, [headers_msg("/v1/models", method="GET", end=True, metadata=ACME_JWT)])
    assert [m["id"] for m in orjson.loads(resps[0].immediate_response.body)["data"]] == [MODEL]
    wide = jwt_metadata({"groups": ["wide"]})
    resps = await run(gateway, [headers_msg("/v1/models", method="GET", end=True, metadata=wide)])
    assert len(orjson.loads(resps[0].immediate_response.body)["data"]) == 2


async def test_token_budget_429_with_retry_after(gateway: Gateway) -> None:
    big = chat_body("hi", max_tokens=900)
    resps = await run(gateway, [headers_msg("/v1/chat/completions", metadata=ACME_JWT), *body_msgs(big)])
    decision(resps)  # admitted: ~920 of the 1000-token bucket reserved (and not yet settled)
    resps = await run(gateway, [headers_msg("/v1/chat/completions", metadata=ACME_JWT), *body_msgs(big)])
    status, err = error_of(resps)
    headers = {h.header.key: h.header.raw_value for h in resps[0].immediate_response.headers.set_headers}
    assert (
        status == 429
        and err["error"]["type"] == "rate_limit_error"
        and err["error"]["code"] == "tokens_exceeded"
    )
    assert 1 <= int(headers["retry-after"]) <= 10


async def stream_through(gateway: Gateway, status: bytes, body: bytes, content_type: bytes) -> float:
    """One admitted request (500 output tokens reserved) and its response; the tenant's budget after."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['extproc']}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers_msg("/v1/chat/completions", metadata=ACME_JWT))
        for m in body_msgs(chat_body("settle me", max_tokens=500)):
            await call.write(m)
        while not (await call.read()).request_body.response.body_mutation.streamed_response.end_of_stream:
            pass
        hs = [
            HeaderValue(key=":status", raw_value=status),
            HeaderValue(key="content-type", raw_value=content_type),
        ]
        await call.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=HeaderMap(headers=hs))))
        await call.read()
        for i in range(0, len(body), 10):
            chunk = pb.HttpBody(body=body[i : i + 10], end_of_stream=i + 10 >= len(body))
            await call.write(pb.ProcessingRequest(response_body=chunk))
            assert (await call.read()).HasField("response_body")
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
    assert gateway.gate is not None
    tenant = gateway.gate.tenants.get("acme")
    assert tenant is not None
    for _ in range(100):  # the server settles when the stream closes, just after our last read
        level = gateway.gate.budgets.level(tenant, time.monotonic())
        assert level is not None
        if level > 500:
            break
        await asyncio.sleep(0.01)
    return level


async def test_settles_to_reported_usage(gateway: Gateway) -> None:
    sse = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    sse += b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\ndata: [DONE]\n\n'
    # Reserved prompt + 500; charged 7 + 3 only (the bucket refills 100 tokens/s meanwhile).
    assert await stream_through(gateway, b"200", sse, b"text/event-stream") >= 1000 - 10 - 0.5


async def test_failed_response_is_refunded(gateway: Gateway) -> None:
    assert await stream_through(gateway, b"503", b'{"error": {}}', b"application/json") >= 1000 - 0.5
