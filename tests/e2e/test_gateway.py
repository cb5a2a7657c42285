"""End to end: the OpenAI SDK -> real Envoy -> ext_proc -> simulated vLLM replicas, as `kvgate up` runs."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable

import httpx
import openai
import pytest

from kvgate.dev.procs import http_get
from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM, Spy

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
LONG = "Kvgate routes requests that share a prefix to the replica that already holds its KV cache. " * 12


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


def chat(stack: Stack, system: str, user: str) -> tuple[str, int]:
    """(replica that served it, cached prompt tokens)."""
    raw = client(stack).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=4,
    )
    completion = raw.parse()
    details = completion.usage.prompt_tokens_details if completion.usage else None
    return raw.headers["x-kvgate-replica"], (details.cached_tokens or 0) if details else 0


def prompt_tokens_total(stack: Stack) -> float:
    total = 0.0
    for engine in stack.engines:
        got = http_get(engine["metrics_url"])
        assert got is not None and got[0] == 200
        for line in got[1].decode().splitlines():
            if line.startswith("vllm:prompt_tokens_total"):
                total += float(line.split()[-1])
    return total


def test_models_listed(stack: Stack) -> None:
    assert [m.id for m in client(stack).models.list()] == [MODEL]


def test_shared_prefix_lands_on_one_replica_and_hits_cache(stack: Stack) -> None:
    system = "shared-prefix test. " + LONG
    first, _ = chat(stack, system, "What is kvgate?")
    results = [chat(stack, system, f"Follow-up question {i}?") for i in range(4)]
    assert {replica for replica, _ in results} == {first}
    assert all(cached >= 64 for _, cached in results), results  # the shared system prompt was a cache hit


def test_distinct_prefixes_spread(stack: Stack) -> None:
    replicas = {chat(stack, f"{i} distinct-prefix test. {LONG}", "Hello?")[0] for i in range(8)}
    assert len(replicas) >= 3


def test_completions_and_tokens_match_engine(stack: Stack) -> None:
    c = client(stack)
    done = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3)
    assert done.usage is not None and done.usage.completion_tokens == 3
    assert done.choices[0].text


def test_streaming_sync(stack: Stack) -> None:
    stream = client(stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream please."}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


async def test_async_and_streaming(stack: Stack) -> None:
    aclient = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> str:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"async {i}"}], max_tokens=5, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    texts = await asyncio.gather(*(one(i) for i in range(8)))
    assert all(texts)
    await aclient.close()


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        (b"{not json", 400, "invalid_request_error"),
        (
            b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
            400,
            "invalid_request_error",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
            400,
            "invalid_request_error",
        ),
        (
            json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            404,
            "invalid_request_error",
        ),
        (
            json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}
            ).encode(),
            400,
            "invalid_request_error",
        ),
        (
            json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "x" * (3 * 1024 * 1024)}]}
            ).encode(),
            413,
            "invalid_request_error",
        ),
    ],
    ids=["invalid-json", "non-utf8", "missing-model", "unknown-model", "wrong-type", "oversize"],
)
def test_bad_input_rejected_and_never_forwarded(stack: Stack, body: bytes, status: int, kind: str) -> None:
    before = prompt_tokens_total(stack)
    resp = httpx.post(
        f"{stack.url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert error["type"] == kind and error["message"] and "Traceback" not in resp.text
    assert "x-kvgate-replica" not in resp.headers
    assert prompt_tokens_total(stack) == before


def test_sdk_sees_openai_errors(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError):
        client(stack).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client(stack).chat.completions.create(model=MODEL, messages=[])


def test_client_destination_header_is_ignored(stack: Stack, spy: Spy) -> None:
    req = urllib.request.Request(
        f"{stack.url}/v1/chat/completions",
        data=json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        ).encode(),
        headers={
            "content-type": "application/json",
            "x-gateway-destination-endpoint": spy.address,
            "x-kvgate-destination-primary": spy.address,
            "x-envoy-original-dst-host": spy.address,
        },
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200 and resp.headers["x-kvgate-replica"].startswith("sim-")
        assert "x-kvgate-upstream-host" not in resp.headers
    assert spy.hits == []


def test_extproc_down_fails_closed(tmp_path_factory: pytest.TempPathFactory, spy: Spy) -> None:
    options = StackOptions(
        replicas=1, port=0, sim_args=FAST_SIM, with_extproc=False, workdir=tmp_path_factory.mktemp("closed")
    )
    with Stack(options) as closed:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
        resp = httpx.post(
            f"{closed.url}/v1/chat/completions",
            content=body,
            timeout=30,
            headers={
                "content-type": "application/json",
                "x-gateway-destination-endpoint": spy.address,
                "x-envoy-original-dst-host": spy.address,
            },
        )
        assert resp.status_code == 503
        assert resp.json()["error"]["type"] == "service_unavailable"
        assert prompt_tokens_total(closed) == 0
    assert spy.hits == []


def endpoint_gauge(stack: Stack, name: str) -> dict[str, float]:
    got = http_get(f"http://127.0.0.1:{stack.extproc_ports['metrics']}/metrics")
    assert got is not None and got[0] == 200
    values = {}
    for line in got[1].decode().splitlines():
        if line.startswith(name + "{"):
            values[line.split('endpoint="', 1)[1].split('"', 1)[0]] = float(line.split()[-1])
    return values


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_scheduler_sees_load_while_streams_run(stack: Stack) -> None:
    """Envoy closes the ext_proc stream right after routing, so the scheduler's load comes from the engines'
    running + waiting plus what it routed since the last scrape: it must be non-zero while a long streamed
    response runs, on the replica serving it, and go back to zero when it ends."""
    stream = client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "load test"}], max_tokens=400, stream=True
    )
    it = iter(stream)
    next(it)  # the response has started
    replica = stream.response.headers["x-kvgate-replica"]
    wait_for(lambda: endpoint_gauge(stack, "kvgate_endpoint_load").get(replica, 0) >= 1, "load seen")
    for _ in it:
        pass
    wait_for(lambda: not any(endpoint_gauge(stack, "kvgate_endpoint_load").values()), "load back to 0")
    wait_for(lambda: not any(endpoint_gauge(stack, "kvgate_endpoint_in_flight").values()), "streams closed")
