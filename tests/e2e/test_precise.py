"""The precise index end to end: engines' KV events -> node agents -> feeds -> two gateway replicas.

A local etcd and two node agents (each supervising a simulated vLLM that publishes KV events over ZMQ)
run as processes; two :class:`extproc.server.Gateway` objects run in the test's event loop, both in
``precise`` index mode, both following etcd and both agents' feeds. Prompts are sent straight to an
engine's OpenAI API (not through a gateway), so whatever the gateways learn comes from the events alone.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from contracts.digest import Digest
from contracts.etcd import EtcdSettings, encode_value, policy_key
from contracts.events import EndpointId
from extproc.config import parse_config
from extproc.routing.request import Kind, ParsedRequest, parse_body
from extproc.server import Gateway
from kvgate.dev.etcd import EtcdServer
from kvgate.dev.procs import Child
from runtime.etcd import connect
from tests.e2e.conftest import FAST_SIM
from tests.e2e.test_agents import MODEL, start_agent
from tests.polling import poll_async

pytestmark = pytest.mark.e2e
LONG = "The precise index knows what each engine holds because the engine says so in its events. " * 6
#: Blocks of sim-1's KV cache: a handful of prompts evict the oldest by LRU.
SMALL_KV_BLOCKS = 48
SMALL_KV = ("--kv-blocks", str(SMALL_KV_BLOCKS), "--max-model-len", str(SMALL_KV_BLOCKS * 16))
#: Long enough that a lingering speculative entry would be seen, were it not dropped.
SPECULATIVE_TTL_S = 60.0
_counter = itertools.count()


@dataclass
class Fleet:
    """The processes: etcd, the agents, and each engine's ``host:port`` by endpoint id."""

    etcd: EtcdServer
    agents: list[Child]
    engines: dict[str, str]
    #: Each engine's agent admin port (``GET /status``).
    admin: dict[str, int]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("precise")
    etcd = EtcdServer(workdir / "etcd")
    etcd.start()
    agents: list[Child] = []
    try:
        started = [
            start_agent(workdir, etcd.address, 0),
            start_agent(workdir, etcd.address, 1, args=(*FAST_SIM, *SMALL_KV)),
        ]
        agents = [child for child, _ in started]
        engines, admin = {}, {}
        for child, ready in started:
            status = child.wait_for_json_file(ready, 120)
            for engine in status["engines"]:
                engines[engine["id"]] = engine["address"]
                admin[engine["id"]] = status["admin_port"]
        yield Fleet(etcd, agents, engines, admin)
    finally:
        for child in agents:
            child.stop()
        etcd.stop()


@pytest.fixture
async def gateways(fleet: Fleet) -> AsyncIterator[list[Gateway]]:
    config = parse_config(
        {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            "models": [{"name": MODEL, "gguf": "smollm2"}],
            "etcd": {"endpoints": [fleet.etcd.address]},
            "index": {"mode": "precise", "speculative_ttl_s": SPECULATIVE_TTL_S},
        }
    )
    gateways = [Gateway(config), Gateway(config)]
    started: list[Gateway] = []
    try:
        for gateway in gateways:
            await gateway.start()
            started.append(gateway)
        await poll_async(
            lambda: all(_attached(g, fleet) for g in gateways) or None, 10, "both feeds attached"
        )
        yield gateways
    finally:
        for gateway in started:
            await gateway.aclose(grace_s=0.1)


def _attached(gateway: Gateway, fleet: Fleet) -> bool:
    clients = gateway.cluster.feeds.clients
    return len(clients) == len(fleet.engines) and all(c.connected for c in clients.values())


def fresh_prompt(tag: str) -> str:
    """A prompt no engine has seen (about 8 blocks of 16 tokens)."""
    return f"{tag} {next(_counter)}. {LONG}"


def request(prompt: str) -> ParsedRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    return parse_body(Kind.CHAT, orjson.dumps(body))


def digests(gateway: Gateway, prompt: str) -> list[Digest]:
    parsed = request(prompt)
    return gateway.router.digests(parsed, gateway.router.tokens(parsed, exact_count=True))  # the whole chain


def matches(gateways: list[Gateway], prompt: str) -> list[dict[EndpointId, int]]:
    """Each gateway's ``index.match`` of the prompt's chain now."""
    now = time.monotonic()
    return [g.index.match(digests(g, prompt), now) for g in gateways]


def pick(gateway: Gateway, prompt: str) -> tuple[str, int]:
    """(endpoint the gateway would pick, blocks it was known to hold); nothing is recorded."""
    decision = gateway.router.decide(request(prompt), request_id="test", now=time.monotonic())
    gateway.router.finish(decision)
    return decision.endpoints[0].id, decision.matched_blocks


async def send(client: httpx.AsyncClient, address: str, prompt: str) -> None:
    """Send a chat request straight to an engine (its cache stores the prompt)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    resp = await client.post(f"http://{address}/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text


async def post(client: httpx.AsyncClient, url: str) -> Any:
    resp = await client.post(url)
    assert resp.status_code == 200, resp.text
    return resp


def everywhere(gateways: list[Gateway], prompt: str, endpoint: str, blocks: int | None) -> bool | None:
    """Probe: both gateways' matches are identical and give ``endpoint`` ``blocks`` leading blocks
    (``None``: any number > 0); for ``blocks == 0`` the endpoint must be absent."""
    got = matches(gateways, prompt)
    if got[0] != got[1]:
        return None
    held = got[0].get(EndpointId(endpoint), 0)
    ok = held > 0 if blocks is None else held == blocks
    return True if ok else None


async def test_both_gateways_learn_and_forget_from_events(fleet: Fleet, gateways: list[Gateway]) -> None:
    prompt = fresh_prompt("learn")
    n_blocks = len(digests(gateways[0], prompt))
    assert n_blocks >= 4
    async with httpx.AsyncClient(timeout=30) as client:
        await send(client, fleet.engines["sim-0"], prompt)
        await poll_async(lambda: everywhere(gateways, prompt, "sim-0", n_blocks), 2, "the prompt indexed")
        assert matches(gateways, prompt)[0] == {EndpointId("sim-0"): n_blocks}  # and nowhere else
        for gateway in gateways:
            assert pick(gateway, prompt) == ("sim-0", n_blocks)

        # Eviction by reset: the engine reports its cache cleared.
        await post(client, f"http://{fleet.engines['sim-0']}/reset_prefix_cache")
        await poll_async(lambda: everywhere(gateways, prompt, "sim-0", 0), 2, "the reset seen")
        for gateway in gateways:
            assert pick(gateway, prompt)[1] == 0


async def test_lru_eviction_reaches_both_gateways(fleet: Fleet, gateways: list[Gateway]) -> None:
    """sim-1 has a tiny KV cache: the prompts sent after the first evict it (LRU). What every prompt
    shares (the chat template's default system prompt) stays, being used by each; the rest goes."""
    first = fresh_prompt("lru")
    chain = digests(gateways[0], first)
    fillers = [fresh_prompt("lru filler") for _ in range(SMALL_KV_BLOCKS // len(chain) + 2)]
    shared = shared_blocks(chain, digests(gateways[0], fillers[0]))
    assert 0 < shared < len(chain)
    async with httpx.AsyncClient(timeout=30) as client:
        await send(client, fleet.engines["sim-1"], first)
        await poll_async(
            lambda: everywhere(gateways, first, "sim-1", len(chain)), 2, "the first prompt indexed"
        )
        for filler in fillers:
            await send(client, fleet.engines["sim-1"], filler)
        await poll_async(lambda: everywhere(gateways, first, "sim-1", shared), 2, "the eviction seen")
        await poll_async(
            lambda: everywhere(gateways, fillers[-1], "sim-1", None), 2, "the last filler indexed"
        )


def shared_blocks(a: list[Digest], b: list[Digest]) -> int:
    """Leading blocks two chains have in common."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def test_dropped_batches_are_replayed(fleet: Fleet, gateways: list[Gateway]) -> None:
    """The engine's next 2 KV batches skip PUB (still replayable): the agent sees the seq gap when a
    later batch arrives and fetches the missing ones from the replay socket, so the prompt sent while
    batches were dropped still reaches both gateways' indexes (PUB never carried it)."""
    address = fleet.engines["sim-0"]
    dropped = fresh_prompt("dropped")
    n_blocks = len(digests(gateways[0], dropped))
    async with httpx.AsyncClient(timeout=30) as client:
        got = await post(client, f"http://{address}/_sim/drop_next_kv_batches?n=2")
        assert got.json() == {"dropping": 2}
        await send(client, address, dropped)
        # Batches after the dropped ones reveal the gap; send until one does.
        deadline, later = time.monotonic() + 5, 0
        while not everywhere(gateways, dropped, "sim-0", n_blocks):
            assert time.monotonic() < deadline, f"dropped prompt never indexed: {matches(gateways, dropped)}"
            await send(client, address, fresh_prompt("after the gap"))
            later += 1
            await asyncio.sleep(0.05)  # pacing between probes, not a readiness wait
        assert later >= 1  # the prompt's own batch never came over PUB: a later one revealed the gap
        status = (await client.get(f"http://127.0.0.1:{fleet.admin['sim-0']}/status")).json()
    (engine,) = [e for e in status["engines"] if e["id"] == "sim-0"]
    assert engine["kv_subscriber"]["replayed"] >= 2 and engine["kv_subscriber"]["lost_reports"] == 0
    log = await asyncio.to_thread(Path(fleet.agents[0].log_path).read_text)
    assert "KV events lost" not in log  # recovered by replay, not by clearing the endpoint


async def test_speculative_entries_do_not_mask_eviction(fleet: Fleet, gateways: list[Gateway]) -> None:
    """A routing decision recorded speculatively (the engine has not even seen the prompt yet) is
    dropped when the engine reports its cache cleared, long before its TTL."""
    gateway = gateways[0]
    prompt = fresh_prompt("speculative")
    parsed = request(prompt)
    decision = gateway.router.decide(parsed, request_id="spec", now=time.monotonic())
    gateway.router.commit(decision, time.monotonic())
    gateway.router.finish(decision)
    chosen = decision.endpoints[0].id
    n_blocks = len(decision.digests)
    assert matches([gateway], prompt)[0][chosen] == n_blocks  # speculative: the engine has not seen it
    assert pick(gateway, prompt) == (chosen, n_blocks)
    async with httpx.AsyncClient(timeout=30) as client:
        await post(client, f"http://{fleet.engines[chosen]}/reset_prefix_cache")
    started = time.monotonic()
    await poll_async(lambda: everywhere(gateways, prompt, chosen, 0), 2, "the speculation dropped")
    assert time.monotonic() - started < SPECULATIVE_TTL_S
    assert pick(gateway, prompt) != (chosen, n_blocks)


async def agent_block_sizes(client: httpx.AsyncClient, fleet: Fleet) -> set[int]:
    """Every agent's ``index_block_size`` (``GET /status``)."""
    sizes = set()
    for port in set(fleet.admin.values()):
        status = (await client.get(f"http://127.0.0.1:{port}/status")).json()
        sizes.add(status["index_block_size"])
    return sizes


async def until_agents(client: httpx.AsyncClient, fleet: Fleet, size: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while await agent_block_sizes(client, fleet) != {size}:
        assert time.monotonic() < deadline, f"agents not at block size {size} after {timeout_s:g} s"
        await asyncio.sleep(0.05)  # polling interval of an HTTP probe, not a readiness stand-in


async def test_a_new_index_block_size_reaches_agents_and_gateways_live(
    fleet: Fleet, gateways: list[Gateway]
) -> None:
    """``policy/index/block_size`` changed in etcd: both gateways hash prompts in the new blocks at once,
    and each agent translates its engine's KV events anew in them (the endpoint cleared, then the
    engine's replay), so a prefix the engine held before the change is found under its new digests; no
    process restarts."""
    before = fresh_prompt("before the change")
    key = policy_key("/kvgate/", "index/block_size")
    etcd = await connect(EtcdSettings(endpoints=(fleet.etcd.address,)))
    assert etcd.kv is not None
    async with httpx.AsyncClient(timeout=30) as client:
        try:
            await send(client, fleet.engines["sim-0"], before)
            n16 = len(digests(gateways[0], before))
            await poll_async(
                lambda: everywhere(gateways, before, "sim-0", n16), 2, "indexed in 16-token blocks"
            )
            await etcd.kv.put(key, encode_value(32))
            await poll_async(
                lambda: all(g.router.policy.block_size == 32 for g in gateways) or None, 5, "at 32"
            )
            await until_agents(client, fleet, 32, 5)
            n32 = len(digests(gateways[0], before))
            assert n32 == n16 // 2 > 0
            await poll_async(lambda: everywhere(gateways, before, "sim-0", n32), 5, "the held prefix in 32s")
            after = fresh_prompt("after the change")
            await send(client, fleet.engines["sim-0"], after)
            n_after = len(digests(gateways[0], after))
            await poll_async(lambda: everywhere(gateways, after, "sim-0", n_after), 5, "a new prompt at 32")
        finally:
            await etcd.kv.delete(key)
            await poll_async(
                lambda: all(g.router.policy.block_size == 16 for g in gateways) or None, 5, "back"
            )
            await until_agents(client, fleet, 16, 5)
            await etcd.close()
