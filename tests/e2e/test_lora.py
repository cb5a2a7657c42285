"""LoRA adapter affinity (issue 21): 2 simulated replicas, 4 adapters, 2 adapter slots each.

The replicas (load/sim, in this event loop) serve adapters with vLLM's ``--max-loras`` slots and export
``vllm:lora_requests_info``; a :class:`extproc.server.Gateway` (in this loop too, static endpoints naming
the adapters) scrapes them. Requests held streaming straight on the replicas put adapters in their slots;
the gateway's decisions are then read from its router, as Envoy would get them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest

from extproc.config import parse_config
from extproc.routing.request import Kind, parse_body
from extproc.server import Gateway
from load.sim.engine import EngineConfig
from load.sim.server import SimConfig, SimFleet
from load.sim.timing import TimingModel
from tests.polling import poll_async

pytestmark = pytest.mark.e2e
BASE = "smol"
ADAPTERS = ("a1", "a2", "a3", "a4")


@pytest.fixture
async def sims(model_dir: str) -> AsyncIterator[SimFleet]:
    config = SimConfig(
        BASE,
        Path(model_dir),
        engine=EngineConfig(max_loras=2),
        timing=TimingModel(time_scale=1.0, lora_load_s=0.01),
        lora_modules=ADAPTERS,
    )
    async with SimFleet(config, 2) as fleet:
        yield fleet


@pytest.fixture
async def gateway(sims: SimFleet, model_dir: str) -> AsyncIterator[Gateway]:
    endpoints = [
        {
            "id": r.id,
            "address": r.address,
            "models": [BASE],
            "adapters": list(ADAPTERS),
            "metrics_url": f"http://{r.address}/metrics",
        }
        for r in sims.replicas
    ]
    config = parse_config(
        {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            "models": [{"name": BASE, "model_dir": model_dir}],
            "endpoints": endpoints,
            "scrape": {"interval_s": 0.05},
        }
    )
    gw = Gateway(config)
    await gw.start()
    try:
        yield gw
    finally:
        await gw.aclose(grace_s=0.1)


def pick(gateway: Gateway, model: str) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Hello from {model}."}],
        "max_tokens": 4,
    }
    decision = gateway.router.decide(
        parse_body(Kind.CHAT, orjson.dumps(body)), request_id="t", now=time.monotonic()
    )
    gateway.router.finish(decision)
    return decision.endpoints[0].id


@contextlib.asynccontextmanager
async def running(client: httpx.AsyncClient, address: str, adapter: str) -> AsyncIterator[None]:
    """A long streamed request for ``adapter`` held open on the replica at ``address``."""
    body = {
        "model": adapter,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 4000,
        "stream": True,
    }
    async with client.stream("POST", f"http://{address}/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        chunks = resp.aiter_bytes()  # kept: closing the iterator would close the stream
        await anext(chunks)  # the first chunk: the request is in
        yield


def adapters_seen(gateway: Gateway, endpoint: str) -> frozenset[str] | None:
    state = gateway.fleet.get(endpoint)  # type: ignore[arg-type]
    lora = None if state is None or state.metrics is None else state.metrics.lora
    return None if lora is None else lora.running


async def test_adapters_go_where_loaded_and_new_ones_where_a_slot_is_free(
    sims: SimFleet, gateway: Gateway
) -> None:
    r0, r1 = sims.replicas
    async with httpx.AsyncClient(timeout=30) as client:
        # The gateway and the replicas agree on what each serves.
        models = (await client.get(f"http://{r0.address}/v1/models")).json()["data"]
        assert [m["id"] for m in models] == [BASE, *ADAPTERS] and models[1]["parent"] == BASE
        async with (
            running(client, r0.address, "a1"),
            running(client, r0.address, "a2"),
            running(client, r1.address, "a3"),
        ):
            await poll_async(
                lambda: adapters_seen(gateway, r0.id) == {"a1", "a2"} or None, 5, "r0's adapters scraped"
            )
            await poll_async(
                lambda: adapters_seen(gateway, r1.id) == {"a3"} or None, 5, "r1's adapters scraped"
            )
            # Requests for a loaded adapter go where it is, though that replica is the busier one.
            assert [pick(gateway, a) for a in ("a1", "a2", "a3", "a1")] == [r0.id, r0.id, r1.id, r0.id]
            # A new adapter goes to the replica with a free slot (r0's are both busy).
            assert pick(gateway, "a4") == r1.id
            metrics = (await client.get(f"http://{r0.address}/metrics")).text
            assert 'running_lora_adapters="a1,a2"' in metrics and 'max_lora="2"' in metrics
        # Requests over: a1 and a2 still sit in r0's slots (vLLM's LRU), a3 and a4 in r1's.
        await poll_async(lambda: adapters_seen(gateway, r0.id) == frozenset() or None, 5, "r0 idle")
        assert pick(gateway, "a2") == r0.id
        assert pick(gateway, "a4") == r1.id
        # The simulator counted each adapter's load once.
        assert r0.engine.loras.loads == 2 and r1.engine.loras.loads == 1
