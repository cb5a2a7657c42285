"""End to end: the ext_proc protects itself (extproc/overload) behind real Envoy, with one simulated replica.

``[overload] max_decisions = 1``: a client that sends its headers and holds its body back keeps the one
decision in flight, so a burst meanwhile is shed at its headers: 503 ``gateway_overloaded`` with an
OpenAI JSON body and ``Retry-After``, while ``/health`` through Envoy and gRPC health on the ext_proc
answer. Requests flow control holds (``flow/saturation max_in_flight = 1``) are no decisions in flight:
they wait without making others shed. A burst larger than the bound gets only 200s and such 503s, and
the count returns to 0. The loop-lag histogram is exported.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgate.dev.up import Stack, StackOptions
from tests.e2e.test_flow import metric

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        replicas=1,
        port=0,
        sim_args=("--time-scale", "0.5"),
        workdir=tmp_path_factory.mktemp("overload"),
        overlay={"overload": {"max_decisions": 1}, "flow": {"saturation": {"max_in_flight": 1}}},
    )
    with Stack(options) as running:
        yield running


def body(max_tokens: int = 2) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": max_tokens}


@pytest.fixture
async def scraper(stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    """One client for a test's scrapes of the ext_proc's metrics: a new client per scrape costs ~19 ms of
    CPU (its SSL context), so polling every 10 ms with one took about a core from the gateway on a 2-core
    machine."""
    url = f"http://127.0.0.1:{stack.extproc_ports['metrics']}"
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        yield client


async def metrics(scraper: httpx.AsyncClient) -> str:
    return (await scraper.get("/metrics")).text


async def until_metrics(
    scraper: httpx.AsyncClient, condition: Callable[[str], bool], what: str, timeout_s: float = 60
) -> None:
    """Scrape the ext_proc's metrics (``scraper``'s ``/metrics``) every 10 ms until ``condition`` holds of
    them; fails after ``timeout_s`` seconds naming ``what`` was awaited and the last scrape's request and
    flow figures."""
    deadline = time.monotonic() + timeout_s
    while not condition(text := await metrics(scraper)):
        if time.monotonic() > deadline:
            seen = [
                line for line in text.splitlines() if line.startswith(("kvgate_requests", "kvgate_flow_"))
            ]
            raise AssertionError(f"not {what} within {timeout_s:g} s; last seen: {seen}")
        await asyncio.sleep(0.01)


async def grpc_health(stack: Stack) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.extproc_ports['health']}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
        return int(reply.status)


def assert_shed(resp: httpx.Response) -> None:
    assert resp.status_code == 503, resp.text
    assert resp.headers["content-type"] == "application/json" and resp.headers["retry-after"] == "1"
    error = resp.json()["error"]
    assert error["code"] == "gateway_overloaded" and error["message"]


async def in_flight(scraper: httpx.AsyncClient) -> float:
    return metric(await metrics(scraper), "kvgate_extproc_decisions_in_flight")


async def test_a_held_back_body_fills_the_bound_and_a_burst_is_shed_health_answers(
    stack: Stack, scraper: httpx.AsyncClient
) -> None:
    release = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "hi"}],'
        await release.wait()
        yield b' "max_tokens": 2}'

    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        held = asyncio.create_task(
            client.post("/v1/chat/completions", content=slow(), headers={"content-type": "application/json"})
        )
        await until_metrics(  # the slow request's headers reached the ext_proc: one decision in flight
            scraper,
            lambda text: metric(text, "kvgate_extproc_decisions_in_flight") == 1,
            "one decision in flight",
        )
        assert await in_flight(scraper) == 1
        burst = await asyncio.gather(*(client.post("/v1/chat/completions", json=body()) for _ in range(20)))
        for resp in burst:
            assert_shed(resp)
        assert (await client.get("/health")).status_code == 200  # bodyless: never counted, never shed
        assert await grpc_health(stack) == health_pb2.HealthCheckResponse.SERVING
        release.set()
        assert (await held).status_code == 200
        assert (await client.post("/v1/chat/completions", json=body())).status_code == 200
    text = await metrics(scraper)
    assert metric(text, "kvgate_extproc_overload_sheds_total") >= 20
    assert metric(text, "kvgate_extproc_decisions_in_flight") == 0
    assert metric(text, "kvgate_extproc_decision_limit") == 1
    assert metric(text, "kvgate_extproc_loop_lag_seconds_count") > 0
    assert "kvgate_extproc_loop_lag_peak_seconds" in text and "kvgate_extproc_saturation" in text


def queued_at_least(n: int) -> Callable[[str], bool]:
    return lambda text: metric(text, "kvgate_flow_queued") >= n


async def test_requests_flow_control_holds_are_not_decisions_in_flight(
    stack: Stack, scraper: httpx.AsyncClient
) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        routed = metric(await metrics(scraper), "kvgate_requests_total", outcome="routed")
        # The long request keeps the engine's one slot while three short ones are held: ~9 s of output at
        # this time scale (1,500 tokens, ~4.5 s, ended before the third was held on a loaded machine).
        busy = asyncio.create_task(client.post("/v1/chat/completions", json=body(max_tokens=3000)))
        # The engine has its one request before another is sent: one sent beside it may reach the ext_proc
        # first, and then the long one is held only for the short one's few ms, and none after it is.
        await until_metrics(
            scraper,
            lambda text: metric(text, "kvgate_requests_total", outcome="routed") > routed,
            "the long request routed",
        )
        routed_at = time.monotonic()
        waiting = []
        for n in (1, 2, 3):  # one at a time: each is held (the engine has its one request), none is shed
            waiting.append(asyncio.create_task(client.post("/v1/chat/completions", json=body())))
            await until_metrics(scraper, queued_at_least(n), f"{n} held")
            # A later scrape: the one above may have run (on the metrics thread) between the request's
            # queueing and the end of its decision, a few statements apart on the event loop.
            text = await metrics(scraper)
            since = f"{time.monotonic() - routed_at:.1f} s after the long one was routed ({busy.done()=})"
            assert metric(text, "kvgate_flow_queued") >= n, since
            assert metric(text, "kvgate_extproc_decisions_in_flight") == 0, since
        answers = await asyncio.gather(busy, *waiting)
    assert [r.status_code for r in answers] == [200] * 4


async def test_a_burst_gets_only_answers_or_overload_503s_and_the_count_returns_to_zero(
    stack: Stack, scraper: httpx.AsyncClient
) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=body()) for _ in range(48)))
        health = await grpc_health(stack)
    for resp in answers:
        if resp.status_code != 200:
            assert_shed(resp)
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert await in_flight(scraper) == 0
