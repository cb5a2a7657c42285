"""The migration proxy against real simulator replicas (in process, 127.0.0.1:0), without Envoy: the
hosts it may use come only from the header Envoy writes; failed tries before any byte go to the next."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from engines.gguf import ensure_model_dir, smollm2_gguf_path
from extproc.migration.proxy import LIMIT_HEADER, UPSTREAMS_HEADER, MigrationProxy
from load.sim.server import SimConfig, SimFleet
from load.sim.timing import TimingModel
from tests.e2e.test_flow import metric

MODEL = "SmolLM2-135M-Instruct"
CLOSED = "127.0.0.1:1"  # nothing listens there: a refused connection
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    config = SimConfig(MODEL, ensure_model_dir(smollm2_gguf_path()), timing=TimingModel(time_scale=0.01))
    async with SimFleet(config, 2) as fleet:
        yield fleet


@pytest.fixture
async def proxy() -> AsyncIterator[tuple[MigrationProxy, aiohttp.ClientSession]]:
    p = MigrationProxy()
    await p.start(("127.0.0.1", 0), ("127.0.0.1", 0))
    async with aiohttp.ClientSession() as http:
        yield p, http
    await p.aclose()


async def post(
    proxy: tuple[MigrationProxy, aiohttp.ClientSession],
    hosts: list[str],
    body: dict[str, Any],
    **headers: str,
) -> tuple[int, bytes]:
    p, http = proxy
    sent = {UPSTREAMS_HEADER: ",".join(hosts), **headers} if hosts else headers
    url = f"http://127.0.0.1:{p.ports['proxy']}/v1/chat/completions"
    async with http.post(url, data=orjson.dumps(body), headers=sent) as response:
        return response.status, await response.read()


async def migrations(proxy: tuple[MigrationProxy, aiohttp.ClientSession], outcome: str) -> float:
    p, http = proxy
    async with http.get(f"http://127.0.0.1:{p.ports['metrics']}/metrics") as response:
        return metric(await response.text(), "kvgate_migrations_total", model=MODEL, outcome=outcome)


async def test_no_hosts_is_503(proxy: tuple[MigrationProxy, aiohttp.ClientSession]) -> None:
    status, body = await post(proxy, [], CHAT)
    assert status == 503 and orjson.loads(body)["error"]["code"] == "no_endpoint"


async def test_a_whole_request_is_reissued_to_the_next_host(
    fleet: SimFleet, proxy: tuple[MigrationProxy, aiohttp.ClientSession]
) -> None:
    first, second = fleet.addresses
    async with aiohttp.ClientSession() as http, http.post(f"http://{first}/_sim/fail_next?n=1"):
        pass
    status, body = await post(proxy, [first, second], CHAT)
    assert status == 200 and orjson.loads(body)["usage"]["completion_tokens"] == 8
    assert await migrations(proxy, "reissued") == 1


async def test_a_refused_stream_is_reissued_and_complete(
    fleet: SimFleet, proxy: tuple[MigrationProxy, aiohttp.ClientSession]
) -> None:
    status, body = await post(proxy, [CLOSED, fleet.addresses[0]], {**CHAT, "stream": True})
    events = [e[6:] for e in body.split(b"\n\n") if e]
    assert status == 200 and events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    assert all(b"usage" not in e for e in events)  # the proxy's own usage request stays hidden
    assert await migrations(proxy, "reissued") == 1


async def test_the_limit_bounds_the_tries(proxy: tuple[MigrationProxy, aiohttp.ClientSession]) -> None:
    status, _ = await post(proxy, [CLOSED, CLOSED, CLOSED], {**CHAT, "stream": True}, **{LIMIT_HEADER: "1"})
    assert status == 503
    assert await migrations(proxy, "lost") == 1


async def test_a_client_error_passes_through(
    fleet: SimFleet, proxy: tuple[MigrationProxy, aiohttp.ClientSession]
) -> None:
    status, body = await post(proxy, fleet.addresses, {"model": MODEL, "stream": True, "messages": "x"})
    assert status == 400 and "error" in orjson.loads(body)
    assert await migrations(proxy, "reissued") == 0


HANDOFF: dict[str, Any] = {
    "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_host": "10.0.0.1"},
    "bootstrap_host": "10.0.0.1",
    "bootstrap_port": 8998,
    "bootstrap_room": 7,
}


def chunk(text: str, produced: int, finish: str | None = None) -> bytes:
    return (
        b"data: "
        + orjson.dumps(
            {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
                "usage": {"prompt_tokens": 2, "completion_tokens": produced, "total_tokens": 2 + produced},
            }
        )
        + b"\n\n"
    )


class Host:
    """An engine that records each body: ``fail`` answers 500, ``cut`` dies after its first chunk, ``ok``
    answers whole."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.seen: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        doc = await request.json()
        self.seen.append(doc)
        if self.mode == "fail":
            return web.json_response({"error": {"message": "down"}}, status=500)
        if not doc.get("stream"):
            answer = {"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop", "index": 0}
            return web.json_response({"choices": [answer]})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk("Hello", 1))
        if self.mode == "cut":
            assert request.transport is not None
            request.transport.close()  # the engine dies mid-stream
            return response
        await response.write(chunk(" world", 2, "stop"))
        await response.write(b"data: [DONE]\n\n")
        return response


@pytest.fixture
async def hosts() -> AsyncIterator[list[tuple[Host, str]]]:
    """Three hosts: ``fail``, ``cut`` and ``ok`` (their modes may be changed)."""
    out, runners = [], []
    for mode in ("fail", "cut", "ok"):
        host = Host(mode)
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", host.handle)])
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        out.append((host, f"127.0.0.1:{runner.addresses[0][1]}"))
    try:
        yield out
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reissue_carries_no_handoff_fields(
    hosts: list[tuple[Host, str]], proxy: tuple[MigrationProxy, aiohttp.ClientSession], stream: bool
) -> None:
    """They paired the first host with its prefill (an SGLang room serves once): the next host serves the
    request aggregated."""
    (failing, first), _, (ok, second) = hosts
    status, _ = await post(proxy, [first, second], {**CHAT, "stream": stream, **HANDOFF})
    assert status == 200 and await migrations(proxy, "reissued") == 1
    ((tried,), (again,)) = failing.seen, ok.seen
    assert all(k in tried for k in HANDOFF)  # the first try is the ext_proc's body, as it came
    assert not any(k in again for k in HANDOFF)
    assert {k: v for k, v in tried.items() if k not in HANDOFF} == again


async def test_a_continuation_carries_no_handoff_fields(
    hosts: list[tuple[Host, str]], proxy: tuple[MigrationProxy, aiohttp.ClientSession]
) -> None:
    _, (cut, first), (ok, second) = hosts
    status, body = await post(proxy, [first, second], {**CHAT, "stream": True, **HANDOFF})
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert await migrations(proxy, "resumed") == 1
    ((tried,), (cont,)) = cut.seen, ok.seen
    assert all(k in tried for k in HANDOFF)
    assert not any(k in cont for k in HANDOFF) and cont["messages"][-1]["content"] == "Hello"


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engines_redirect_is_not_followed(
    proxy: tuple[MigrationProxy, aiohttp.ClientSession], stream: bool
) -> None:
    """Only Envoy's header names the hosts: an engine answering 307 elsewhere does not get the prompt resent
    to the host its ``Location`` names; its answer is passed back as an answer (not retried there)."""
    called: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        called.append(request.path)
        return web.json_response({})

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"http://{other_address}/steal")

    runners = []
    for route in (web.post("/steal", elsewhere), web.post("/v1/chat/completions", moved)):
        app = web.Application()
        app.add_routes([route])
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
    other_address, engine = (f"127.0.0.1:{r.addresses[0][1]}" for r in runners)
    try:
        status, _ = await post(proxy, [engine], {**CHAT, "stream": stream})
        assert status == 307 and called == []
    finally:
        for runner in runners:
            await runner.cleanup()
