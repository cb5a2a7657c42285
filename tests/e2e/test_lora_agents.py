"""LoRA and cache salt end to end through node agents (issue 21): engines' KV events -> agents -> feeds ->
a gateway's precise index, and the engines' LoRA metric -> the agents' loads -> the gateway's fleet.

A local etcd and two node agents, each supervising a simulated vLLM that serves adapters ``a1``..``a3``
(``[[engines]] lora_modules``, 2 slots) and publishes KV events; one :class:`extproc.server.Gateway` in
this loop follows etcd and both feeds. Requests are sent straight to an engine, so whatever the gateway
learns comes from the events and loads alone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import orjson
import pytest

from contracts.events import EndpointId
from extproc.config import parse_config
from extproc.routing.request import Kind, parse_body
from extproc.server import Gateway
from kvgate.dev.etcd import EtcdServer
from kvgate.dev.procs import Child
from tests.e2e.conftest import FAST_SIM
from tests.e2e.test_agents import MODEL, start_agent
from tests.polling import poll_async

pytestmark = pytest.mark.e2e
ADAPTERS = {"a1": "/lora/a1", "a2": "/lora/a2", "a3": "/lora/a3"}
TEXT = "Adapters and salts keep their own blocks, and the gateway must know which engine holds them. " * 6


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """The etcd address and each engine's ``host:port`` by id."""
    workdir = tmp_path_factory.mktemp("lora-agents")
    etcd = EtcdServer(workdir / "etcd")
    etcd.start()
    agents: list[Child] = []
    try:
        options = {"lora_modules": ADAPTERS, "max_loras": 2}
        started = [
            start_agent(workdir, etcd.address, i, args=FAST_SIM, engine_options=options) for i in (0, 1)
        ]
        agents = [child for child, _ in started]
        addresses = {}
        for child, ready in started:
            for engine in child.wait_for_json_file(ready, 120)["engines"]:
                addresses[engine["id"]] = engine["address"]
        yield etcd.address, addresses
    finally:
        for child in agents:
            child.stop()
        etcd.stop()


@pytest.fixture
async def gateway(engines: tuple[str, dict[str, str]]) -> AsyncIterator[Gateway]:
    etcd, addresses = engines
    config = parse_config(
        {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            "models": [{"name": MODEL, "gguf": "smollm2"}],
            "etcd": {"endpoints": [etcd]},
            "index": {"mode": "precise"},
        }
    )
    gw = Gateway(config)
    await gw.start()
    try:
        await poll_async(lambda: _attached(gw, len(addresses)) or None, 10, "both feeds attached")
        yield gw
    finally:
        await gw.aclose(grace_s=0.1)


def _attached(gateway: Gateway, n: int) -> bool:
    clients = gateway.cluster.feeds.clients
    return len(clients) == n and all(c.connected for c in clients.values())


def body(
    model: str, tag: str, salt: str | None = None, max_tokens: int = 1, stream: bool = False
) -> dict[str, object]:
    out: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": f"{tag}. {TEXT}"}],
        "max_tokens": max_tokens,
    }
    if salt is not None:
        out["cache_salt"] = salt
    if stream:
        out["stream"] = True
    return out


def pick(gateway: Gateway, request: dict[str, object]) -> tuple[str, int]:
    decision = gateway.router.decide(
        parse_body(Kind.CHAT, orjson.dumps(request)), request_id="t", now=time.monotonic()
    )
    gateway.router.finish(decision)
    return decision.endpoints[0].id, decision.matched_blocks


async def test_lora_and_salted_prompts_match_the_engine_that_holds_them(
    engines: tuple[str, dict[str, str]], gateway: Gateway
) -> None:
    _, addresses = engines
    state = gateway.fleet.get(EndpointId("sim-0"))
    assert state is not None and state.endpoint.adapters == set(ADAPTERS)  # registered by the agent
    lora, salted = body("a1", "lora"), body(MODEL, "salted", salt="tenant-7")
    async with httpx.AsyncClient(timeout=30) as client:
        for address, request in ((addresses["sim-0"], lora), (addresses["sim-1"], salted)):
            resp = await client.post(f"http://{address}/v1/chat/completions", json=request)
            assert resp.status_code == 200, resp.text
    await poll_async(
        lambda: pick(gateway, lora) if pick(gateway, lora)[1] > 4 else None, 5, "the LoRA prompt indexed"
    )
    await poll_async(
        lambda: pick(gateway, salted) if pick(gateway, salted)[1] > 4 else None, 5, "the salted prompt"
    )
    assert pick(gateway, lora)[0] == "sim-0" and pick(gateway, salted)[0] == "sim-1"
    # The same words under the base model, another adapter or another salt are other blocks.
    for other in (body(MODEL, "lora"), body("a2", "lora"), body(MODEL, "salted", salt="tenant-8")):
        assert pick(gateway, other)[1] == 0


async def test_the_engines_adapters_reach_the_gateway_on_the_agents_feed(
    engines: tuple[str, dict[str, str]], gateway: Gateway
) -> None:
    _, addresses = engines
    async with httpx.AsyncClient(timeout=30) as client, contextlib.AsyncExitStack() as held:
        request = body("a2", "long", max_tokens=4000, stream=True)
        resp = await held.enter_async_context(
            client.stream("POST", f"http://{addresses['sim-1']}/v1/chat/completions", json=request)
        )
        chunks = resp.aiter_bytes()
        await anext(chunks)  # the request is in
        state = gateway.fleet.get(EndpointId("sim-1"))
        assert state is not None

        def running() -> frozenset[str] | None:
            lora = None if state.metrics is None else state.metrics.lora
            return lora.running if lora is not None and lora.running else None

        assert await poll_async(running, 5, "the adapter in the agent's load") == {"a2"}
        assert (
            state.metrics is not None and state.metrics.lora is not None and state.metrics.lora.max_lora == 2
        )
        assert pick(gateway, body("a2", "new prompt"))[0] == "sim-1"  # the lora scorer: a2 is active there
