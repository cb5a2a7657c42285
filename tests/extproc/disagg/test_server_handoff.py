"""The handoff over real gRPC and HTTP: a Gateway whose model route disaggregates, a fake prefill engine
on 127.0.0.1 (aiohttp, ephemeral port) answering, failing or hanging; the decode endpoint is never
contacted by the gateway (Envoy would be)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.config import parse_config
from extproc.server import Gateway
from tests.extproc.test_server import body_msgs, chat_body, decision, headers_msg, run, streamed_body
from tests.polling import until

MODEL = "SmolLM2-135M-Instruct"
DECODE = "127.0.0.2:8000"
PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-engine",
    "remote_block_ids": [3, 4],
    "remote_host": "127.0.0.1",
    "remote_port": 1,
}


class FakePrefill:
    """A prefill engine: ``mode`` ``ok`` (answers with transfer params), ``fail`` (503), ``junk`` (200
    without them), ``shape`` (200 with block ids of the wrong type), ``deep`` (200 with params nested
    past what orjson re-encodes) or ``hang``."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.seen: list[tuple[dict[str, Any], str | None]] = []
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((await request.json(), request.headers.get("x-request-id")))
        if self.mode == "fail":
            return web.json_response({"error": {"code": 503}}, status=503)
        if self.mode == "junk":
            return web.json_response({"choices": []})
        if self.mode == "shape":
            return web.json_response(
                {"choices": [], "kv_transfer_params": {**PARAMS, "remote_block_ids": "3,4"}}
            )
        if self.mode == "deep":
            deep = "[" * 300 + "]" * 300
            text = f'{{"choices": [], "kv_transfer_params": {{"nest": {deep}, {json.dumps(PARAMS)[1:]}}}'
            return web.Response(text=text, content_type="application/json")
        if self.mode == "hang":
            await self.release.wait()
        return web.json_response({"choices": [], "kv_transfer_params": PARAMS})


@pytest.fixture
async def prefill() -> AsyncIterator[tuple[FakePrefill, str]]:
    fake = FakePrefill()
    app = web.Application()
    app.add_routes([web.post("/v1/chat/completions", fake.handle)])
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield fake, f"127.0.0.1:{runner.addresses[0][1]}"
    finally:
        fake.release.set()
        await runner.cleanup()


async def start_gateway(
    model_dir: str,
    prefill: str,
    tmp_path: Path,
    engine: str,
    bootstrap: bool = True,
    prefill_timeout_s: float = 0.5,
) -> Gateway:
    policy = tmp_path / "policy.json"
    route = {"disaggregation": {"mode": "disaggregated", "prefill_timeout_s": prefill_timeout_s}}
    policy.write_text(json.dumps({"models": {MODEL: route}}))
    port = {"bootstrap_port": 8998} if engine == "sglang" and bootstrap else {}
    config = parse_config(
        {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            "models": [{"name": MODEL, "model_dir": model_dir}],
            "endpoints": [
                {
                    "id": "p",
                    "address": prefill,
                    "models": [MODEL],
                    "role": "prefill",
                    "engine": engine,
                    **port,
                },
                {"id": "d", "address": DECODE, "models": [MODEL], "role": "decode", "engine": engine},
            ],
            "policy": {"file": str(policy)},
        }
    )
    gw = Gateway(config)
    await gw.start()
    return gw


@pytest.fixture
async def gateway(model_dir: str, prefill: tuple[FakePrefill, str], tmp_path: Path) -> AsyncIterator[Gateway]:
    gw = await start_gateway(model_dir, prefill[1], tmp_path, "vllm")
    yield gw
    await gw.aclose(grace_s=0)


@pytest.fixture
async def sglang(model_dir: str, prefill: tuple[FakePrefill, str], tmp_path: Path) -> AsyncIterator[Gateway]:
    gw = await start_gateway(model_dir, prefill[1], tmp_path, "sglang")
    yield gw
    await gw.aclose(grace_s=0)


def sample(gw: Gateway, name: str, **labels: str) -> float:
    return gw.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_prefilled_then_routed_to_the_decode_endpoint(
    gateway: Gateway, prefill: tuple[FakePrefill, str]
) -> None:
    fake, _ = prefill
    payload = chat_body("hello there", max_tokens=9, stream=True)
    resps = await run(gateway, [headers_msg("/v1/chat/completions"), *body_msgs(payload)])
    first, *routed = resps
    assert first.WhichOneof("response") is None and first.override_message_timeout.seconds == 5
    destination, _, _ = decision(routed)
    assert destination == DECODE
    sent = orjson.loads(streamed_body(routed))
    assert sent["kv_transfer_params"]["remote_engine_id"] == "prefill-engine"
    assert (sent["stream"], sent["max_tokens"]) == (True, 9)
    ((asked, request_id),) = fake.seen
    assert asked["kv_transfer_params"]["do_remote_decode"] is True
    assert (asked["stream"], asked["max_tokens"], request_id) == (False, 1, "r1")
    assert sample(gateway, "kvgate_pd_decisions_total", mode="disaggregated", reason="disaggregated") == 1
    assert sample(gateway, "kvgate_pd_prefill_seconds_count", model=MODEL, outcome="ok") == 1
    assert sample(gateway, "kvgate_requests_total", outcome="routed") == 1


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("fail", "status"),
        ("junk", "bad_response"),
        ("shape", "bad_response"),
        ("deep", "bad_response"),
        ("hang", "timeout"),
    ],
)
async def test_a_failed_or_late_prefill_is_served_aggregated(
    gateway: Gateway, prefill: tuple[FakePrefill, str], mode: str, reason: str
) -> None:
    prefill[0].mode = mode
    payload = chat_body("hello there", max_tokens=9)
    resps = await run(gateway, [headers_msg("/v1/chat/completions"), *body_msgs(payload)])
    destination, _, _ = decision(resps[1:])
    assert destination == DECODE
    assert streamed_body(resps[1:]) == payload
    assert sample(gateway, "kvgate_pd_fallbacks_total", model=MODEL, reason=reason) == 1
    assert sample(gateway, "kvgate_pd_prefill_seconds_count", model=MODEL, outcome=reason) == 1
    assert all(s.in_flight == 0 for s in gateway.fleet if s.endpoint.role == "prefill")


@pytest.mark.parametrize(("mode", "failure"), [("ok", None), ("fail", "status"), ("hang", "timeout")])
async def test_sglang_routes_at_once_and_sends_the_prefill_beside(
    sglang: Gateway, prefill: tuple[FakePrefill, str], mode: str, failure: str | None
) -> None:
    fake = prefill[0]
    fake.mode = mode
    payload = chat_body("hello there", max_tokens=9, stream=True)
    resps = await run(sglang, [headers_msg("/v1/chat/completions"), *body_msgs(payload)])
    destination, _, _ = decision(resps)  # the decision first: nothing waits for the prefill
    assert destination == DECODE
    decode = orjson.loads(streamed_body(resps))
    await until(lambda: bool(fake.seen), 5.0)
    ((asked, request_id),) = fake.seen
    fields = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    assert [asked[k] for k in fields] == [decode[k] for k in fields]
    assert (asked["bootstrap_host"], asked["bootstrap_port"], request_id) == ("127.0.0.1", 8998, "r1")
    assert (asked["stream"], decode["stream"]) == (False, True)
    prefill_state = next(s for s in sglang.fleet if s.endpoint.role == "prefill")
    await until(lambda: prefill_state.in_flight == 0, 5.0)
    errors = sample(sglang, "kvgate_pd_prefill_errors_total", model=MODEL, reason=failure or "status")
    assert errors == (0 if failure is None else 1)
    assert sample(sglang, "kvgate_pd_prefill_seconds_count", model=MODEL, outcome=failure or "ok") == 1


async def test_an_sglang_decode_pick_with_no_prefill_is_a_503_counted_no_prefill(
    model_dir: str, prefill: tuple[FakePrefill, str], tmp_path: Path
) -> None:
    """The prefill endpoint has no bootstrap port: none fits, the decode server cannot serve alone."""
    gw = await start_gateway(model_dir, prefill[1], tmp_path, "sglang", bootstrap=False)
    try:
        payload = chat_body("hello there", max_tokens=9)
        (resp,) = await run(gw, [headers_msg("/v1/chat/completions"), *body_msgs(payload)])
        assert resp.immediate_response.status.code == 503
        assert sample(gw, "kvgate_pd_decisions_total", mode="aggregated", reason="no_prefill") == 1
        assert sample(gw, "kvgate_requests_total", outcome="503") == 1
        assert not prefill[0].seen
    finally:
        await gw.aclose(grace_s=0)


async def test_a_vllm_prefill_whose_client_left_is_timed_as_cancelled(
    model_dir: str, prefill: tuple[FakePrefill, str], tmp_path: Path
) -> None:
    """The client goes away (Envoy cancels the ext_proc stream) while the prefill half runs: its time is
    sampled with outcome ``cancelled``, as for an SGLang prefill half, and its slot is freed."""
    fake = prefill[0]
    fake.mode = "hang"
    gw = await start_gateway(model_dir, prefill[1], tmp_path, "vllm", prefill_timeout_s=60.0)
    try:

        async def messages() -> AsyncIterator[pb.ProcessingRequest]:
            for msg in [headers_msg("/v1/chat/completions"), *body_msgs(chat_body("hello there"))]:
                yield msg
            await asyncio.Event().wait()  # Envoy's next message never comes: the client leaves first

        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.ports['extproc']}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process(messages())
            await until(lambda: bool(fake.seen), 10.0)
            call.cancel()
        await until(
            lambda: sample(gw, "kvgate_pd_prefill_seconds_count", model=MODEL, outcome="cancelled") == 1, 10.0
        )
        prefill_state = next(s for s in gw.fleet if s.endpoint.role == "prefill")
        await until(lambda: prefill_state.in_flight == 0, 10.0)
        assert sample(gw, "kvgate_pd_fallbacks_total", model=MODEL, reason="cancelled") == 0
    finally:
        await gw.aclose(grace_s=0)
